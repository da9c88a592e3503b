"""The tiered layer's attention backends beside the gather path of ``tier_layer.TierLayer``, each
chosen once per layer when the cache is built (``kv.build_tier_layer``):

- ``CpuAttentionTierLayer``: decode over a cache held off the GPU runs on the CPU where the cache
  is, and only q and the output cross PCIe (FlexGen §4.2's CPU delegation: ``b*h`` activations
  instead of ``b*s*h`` cache);
- ``Int4KernelTierLayer``: a 4-bit cache written and read in place by the Triton kernels (on the
  compute device, or pinned host memory mapped into them, its blocks staged per decode step);
- ``MappedHostTierLayer``: an uncompressed pinned host cache that the GPU kernels write and read
  in place across PCIe.
"""

from __future__ import annotations

import warnings

import torch

from localgen.attention.metadata import AttentionMetadata
from localgen.attention.prefill import fresh_prefill_attention
from localgen.attention.spec import AttentionSpec
from localgen.attention.triton import triton_kernels
from localgen.kernels.quant_ref import GROUP_SIZE, QuantizedKV
from localgen.runtime.offload.tier_layer import TierLayer


class CpuAttentionTierLayer(TierLayer):
    """A layer on the CPU or disk tier under a GPU, with the policy's ``cpu_cache_compute``:
    decode gathers the step's blocks on the CPU and attends there (multi-threaded torch, every
    spec as in ``TierLayer``); prefill runs on the GPU as in ``TierLayer``."""

    name = "tiered, CPU-computed decode"

    def _decode_device(self) -> torch.device:
        return torch.device("cpu")


class Int4KernelTierLayer(TierLayer):
    """A 4-bit cache that the Triton kernels (CUDA) write and read in place: quantized writes,
    pool writes and decode attention go through them instead of the torch reference twins. The
    cache is on the compute device, or in pinned host memory mapped into the kernels
    (``_host_mapped``): writes land in place, and a decode step copies the range of 4-bit blocks
    it reads to the GPU in one DMA per tensor (``_staged``), with no gather on the CPU and no
    dequantized copy (a quarter of the fp cache's bytes). Prefill as in ``TierLayer``."""

    name = "tiered 4-bit, Triton kernels"
    int4_kernels = True
    graph_safe = True

    def reads_in_place(self) -> bool:
        return True

    def supports(self, spec: AttentionSpec) -> bool:
        return spec.plain  # the int4 kernel has no window, softcap or sinks

    def _host_mapped(self) -> bool:
        return self.store_device != self.device

    def decode(self, kv, q, k, v, meta: AttentionMetadata, spec: AttentionSpec) -> torch.Tensor:
        with self.timers.section("compute"):
            if meta.pool_rows is None:
                return self._decode_int4(q, k, v, meta, spec.scale)
            return self._decode_int4_static(q, k, v, meta, spec.scale)

    def _decode_int4(self, q, k, v, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """A decode step over the 4-bit cache in place: one launch quantizes and writes the new
        K/V, two small ones put them in the pool, then the int4 paged-decode kernel, which
        reads each sequence's own block in fp from its pool row (KIVI) and every earlier block
        4-bit, dequantized in registers (FlexGen §5); nothing is gathered. Same result as the
        reference path (``_attend_recent``), which it falls back to when a sequence gets no pool
        row or shares its last block."""
        self._store(k, v, meta.slot_mapping)  # the Triton quantize-and-write
        plan = self._plan(meta)
        own = None
        if self.recent_blocks:
            if plan.decode is None:
                return self._decode_int4_reference(q, k, v, meta, scale, plan, None)
            rows, init = self._assign_rows(plan, meta)
            if min(rows) < 0:
                return self._decode_int4_reference(q, k, v, meta, scale, plan, (rows, init))
            dev = self.device  # the kernels' index tensors
            if init:
                self._fill_new_rows(plan, [rows[i] for i in init], [plan.decode[0][i] for i in init])
            self._pool_put(plan.tensor("pool_slots", self._pool_slots(rows, plan.decode[1]), dev), k, v)
            own = plan.tensor("rows", rows, dev)
        return self._int4_attention(q, meta, scale, own)

    def _decode_int4_static(self, q, k, v, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """``_decode_int4`` inside a CUDA graph: the pool rows and flat pool slots come with the
        step (``meta.pool_rows``/``pool_slots``, assigned before the replay by
        ``TieredKVCache.graph_pool_rows``), every shape is fixed and nothing runs on the host."""
        self._store(k, v, meta.slot_mapping)
        if not self.recent_blocks:
            return self._int4_attention(q, meta, scale, None)
        self._pool_put(meta.pool_slots, k, v)
        return self._int4_attention(q, meta, scale, meta.pool_rows)

    def _int4_attention(self, q, meta: AttentionMetadata, scale: float,
                        own_rows: torch.Tensor | None) -> torch.Tensor:
        """The int4 paged-decode kernel over this layer's cache; with ``own_rows`` (a pool row per
        sequence) each sequence reads its own block in fp from the pool."""
        own = {} if own_rows is None else dict(own_k=self.pool_k, own_v=self.pool_v, own_rows=own_rows)
        k, v, tables = ((self._packed("k"), self._packed("v"), meta.block_tables) if not self._host_mapped()
                        else self._staged(meta))
        return triton_kernels()[0].paged_decode_attention_int4(
            q, k, v, tables, meta.context_lens, scale, max_context_len=max(meta.context_lens_list), **own)

    def _staged(self, meta: AttentionMetadata) -> tuple[QuantizedKV, QuantizedKV, torch.Tensor]:
        """A decode step's 4-bit blocks of this (host-mapped) layer copied to the GPU, one DMA
        per tensor over the range from the first to the last block the step reads, and the
        block tables shifted onto the copy. Read in place, the kernel crosses PCIe in 64-byte
        rows and 4-byte scales, well below the link's rate; a copy moves them at that rate. The
        pool (each sequence's own block in fp) stays mapped, and the K/V write stays in place."""
        plan = self._plan(meta)
        lo, hi = plan.block_range
        tables = plan.tables_from(lo, meta.block_tables)
        with self.timers.section("ctog"):
            k, v = (QuantizedKV(*(self.t[name + suf][lo:hi].to(self.device, non_blocking=True)
                                  for suf in ("#packed", "#scale", "#min")), GROUP_SIZE) for name in ("k", "v"))
        return k, v, tables

    def _decode_int4_reference(self, q, k, v, meta, scale, plan, assigned):
        """The gather path for the rare steps the kernel does not take (K/V already written)."""
        ids = plan.ids_on(self.store_device)
        kc, vc = self._blocks("k", ids, self.device), self._blocks("v", ids, self.device)
        return self._attend_recent(q, k, v, kc, vc, plan, meta, scale, self.device, assigned)


class MappedHostTierLayer(TierLayer):
    """An uncompressed, pinned host-memory tier that the GPU attends to in place (mapped pinned
    memory is addressable from kernels under unified addressing): the new K/V written and every
    block read across PCIe by the kernels themselves (no gather on the CPU, no staging copy). If
    the kernels refuse host memory, the layer warns once and gathers from then on."""

    name = "tiered, mapped host memory"

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.mapped = True  # False once the kernels refused host memory
        self.stored: "torch.cuda.Event | None" = None  # a side-stream store still in flight

    def reads_in_place(self) -> bool:
        return self.mapped

    def supports(self, spec: AttentionSpec) -> bool:
        return spec.plain  # the Triton paged kernels have no window, softcap or sinks

    def prefill(self, kv, q, k, v, meta: AttentionMetadata, spec: AttentionSpec) -> torch.Tensor:
        out = self._in_place(q, k, v, meta, spec.scale)
        return out if out is not None else super().prefill(kv, q, k, v, meta, spec)

    def decode(self, kv, q, k, v, meta: AttentionMetadata, spec: AttentionSpec) -> torch.Tensor:
        out = self._in_place(q, k, v, meta, spec.scale)
        return out if out is not None else super().decode(kv, q, k, v, meta, spec)

    def _in_place(self, q, k, v, meta: AttentionMetadata, scale: float) -> torch.Tensor | None:
        """``_attend_mapped`` while the kernels take host memory, else None."""
        if not self.mapped:
            return None
        self._await_store()
        return self._attend_mapped(q, k, v, meta, scale)

    def _attend_mapped(self, q, k, v, meta: AttentionMetadata, scale: float):
        """GPU kernels over the pinned host cache: the new K/V written and every block read
        across PCIe by the kernels themselves (no gather on the CPU, no staging copy). Returns
        None (and turns the path off for this layer) if the kernels refuse host memory."""
        decode, prefill, kv_write = triton_kernels()
        kc, vc = self.t["k"], self.t["v"]
        try:
            with self.timers.section("compute"):
                fresh = self._fresh_prefill(meta)
                if fresh and not self.timers.enabled and _room_for(
                        k, v, self.device, k.shape[0] * self.prefill_temp_per_token):
                    self._store_behind(kv_write, k, v, meta.slot_mapping)
                else:
                    kv_write.write_kv(kc, vc, k, v, meta.slot_mapping)
                if fresh:
                    return fresh_prefill_attention(q, k, v, meta.query_lens, scale)
                if meta.is_prefill:
                    return prefill.paged_prefill_attention(q, kc, vc, meta.block_tables,
                                                           meta.context_lens_list, meta.query_lens, scale)
                return decode.paged_decode_attention(q, kc, vc, meta.block_tables, meta.context_lens,
                                                     scale, max_context_len=max(meta.context_lens_list))
        except Exception as e:  # noqa: BLE001  (a Triton build that rejects host pointers)
            warnings.warn(f"GPU kernels cannot read the pinned KV cache in place ({e!r}); "
                          "copying blocks to the GPU instead", RuntimeWarning, stacklevel=2)
            self.mapped = False
            return None

    def _store_behind(self, kv_write, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Write a prefill's K/V into the pinned host cache on a side stream, overlapping the rest
        of the layer (FlexGen §4.2: batch k-1's store runs while batch k computes). The next use of this
        layer's cache waits for it (``_await_store``)."""
        compute = torch.cuda.current_stream(self.device)
        side = _store_stream(self.device)
        prev = _LAST_STORE.get(self.device)
        if prev is not None:  # one store in flight at most: its k/v are the only extra memory
            compute.wait_event(prev)
        side.wait_stream(compute)  # k and v are computed
        with torch.cuda.stream(side):
            kv_write.write_kv(self.t["k"], self.t["v"], k, v, slots)
        for x in (k, v, slots):  # keep their memory from being reused before the write is done
            x.record_stream(side)
        self.stored = _LAST_STORE[self.device] = torch.cuda.Event()
        self.stored.record(side)

    def _await_store(self) -> None:
        if self.stored is not None:
            torch.cuda.current_stream(self.device).wait_event(self.stored)
            self.stored = None


_STORE_STREAMS: dict = {}
_LAST_STORE: dict = {}  # device -> event of the latest side-stream store


def _room_for(k: torch.Tensor, v: torch.Tensor, device: torch.device, later: int = 0) -> bool:
    """Whether a side-stream store fits: it keeps k's and v's storage (views of the fused qkv
    output) alive until it ends, on top of the ``later`` bytes the layer allocates next; the
    limit is 90% of the GPU's memory times this process's allocator fraction (``build_offload``'s
    ``gpu_memory`` cap). The rest of the layer's allocations count too: twice the held K/V alone
    let a store run where the layer's later allocations then exceeded the cap."""
    idx = device.index if device.index is not None else torch.cuda.current_device()  # "cuda" alone
    frac = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _d: 1.0)(idx)  # is refused
    cap = torch.cuda.get_device_properties(idx).total_memory * frac
    held = {x.untyped_storage().data_ptr(): x.untyped_storage().nbytes() for x in (k, v)}
    return torch.cuda.memory_allocated(device) + sum(held.values()) + later < 0.9 * cap



def _store_stream(device: torch.device) -> "torch.cuda.Stream":
    """One side stream per device for cache stores that overlap compute."""
    if device not in _STORE_STREAMS:
        _STORE_STREAMS[device] = torch.cuda.Stream(device)
    return _STORE_STREAMS[device]
