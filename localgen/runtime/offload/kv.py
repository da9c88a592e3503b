"""The paged KV cache split across tiers at layer granularity, optionally 4-bit (FlexGen §4.2, §5).

Each layer's K and V (``[num_blocks, block_size, num_kv_heads, head_dim]``, the plain layout of
``localgen.kv.cache``) live on one tier: the compute device ("gpu"), host memory ("cpu", pinned
when a GPU computes), or a file ``<offload_dir>/kv_<layer:03d>.bin`` mapped read-write ("disk"). With
``compress_cache`` they are stored as 4-bit groups of 64 along head_dim (the hidden dim), packed
uint8 plus fp16 scale/min, in every tier.

Rotated 4-bit KV (on by default with ``compress_cache``; QuaRot, Ashkboos et al. 2024, §4 "KV
cache"; SpinQuant, Liu et al. 2024): before quantizing, each head's K and V are multiplied by a
fixed orthogonal ``R`` ``[head_dim, head_dim]`` (``kv_rotation``). Post-RoPE keys carry a few
outlier channels that stretch every 64-group's range, so plain 4-bit codes leave the other
channels a step or two; a Hadamard-like ``R`` spreads each outlier over all channels and shrinks
the range. Nothing is rotated back on the cache: the query is rotated the same way (scores
``(qR)(kR)^T = qk^T``) and the output over rotated values is ``(PV)R``, turned back by ``R^T`` on
the ``[num_tokens, num_heads, head_dim]`` output. The stored format is unchanged (FlexGen's packed
codes + fp16 scale/min); the cache simply holds ``kR``/``vR``.

Recent block uncompressed (on by default with ``compress_cache``; KIVI, Liu et al. 2024, §3.3
keeps the most recent tokens in full precision, here at block granularity): every token is stored
4-bit as above, and in addition the fp values of each running sequence's last (partly filled)
block are kept in a small write-through pool (``recent_blocks`` blocks per layer, on the tier's
device, least recently written evicted first; ``recent.RecentIndex`` assigns the rows once per step
for every layer). A query reads the keys/values of its own block
(the block holding its position) in full precision and every earlier block 4-bit, in prefill
exactly as in decode: a prompt scored in one prefill sees what token-by-token decoding would see.
A block without a pool entry (evicted, or filled from the prefix cache) falls back to its 4-bit
values, so the pool changes accuracy, never correctness. Most attention mass of small models sits
on the last few tokens, which is where 4-bit keys cost the most.

Attention for an offloaded or compressed layer (``TierKV.attend``, reached through the hook in
``localgen.kv.attention.paged_attention``):
1. new K/V are (quantized on the compute device and) written to the layer's tier at their slots;
2. decode with ``cpu_cache_compute`` and an off-GPU cache: q moves to the CPU, attention runs
   there (multi-threaded torch) over the cache in place, and only the output returns
   (FlexGen's CPU delegation: ``b*h`` activations cross PCIe instead of ``b*s*h`` cache);
3. otherwise the blocks the batch's block tables name are gathered (dequantized) onto the compute
   device and attention runs there over this local copy with remapped block tables.
A layer that is on the compute device and uncompressed gets the plain ``LayerKV`` (no hook).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from localgen.kernels import paged_attention_ref as ref
from localgen.kernels.quant_ref import GROUP_SIZE, QuantizedKV, dequantize_int4, quantize_int4
from localgen.kv.attention import AttentionMetadata, LayerKV, equal_runs, fresh_prefill_attention, pool_slot
from localgen.models.config import ModelConfig
from localgen.runtime.offload.memory import Layout, host_empty
from localgen.runtime.offload.recent import RecentIndex, own_blocks, used_blocks
from localgen.runtime.offload.timers import Timers


DEFAULT_RECENT_BLOCKS = 64  # fp pool rows per layer when the caller does not say (one per sequence)
# where a 4-bit cache on the compute device goes through the Triton kernels (tests add "cpu"
# under TRITON_INTERPRET=1)
INT4_KERNEL_DEVICES = ("cuda",)


def resolve_device(device: torch.device | str) -> torch.device:
    """``device`` with a bare "cuda" made "cuda:<current>": tensors report an index, and
    ``torch.device("cuda") != torch.device("cuda:0")``, so comparing a bare compute device with a
    cache tensor's device silently took the gather path for a GPU-tier 4-bit cache."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return d


def kv_layer_bytes(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                   compress: bool) -> int:
    """Stored bytes of one layer's K and V."""
    return Layout(_kv_items(cfg, num_blocks, block_size, dtype, compress)).nbytes


def _kv_items(cfg, num_blocks, block_size, dtype, compress):
    base = (num_blocks, block_size, cfg.num_kv_heads)
    if not compress:
        return [(n, dtype, base + (cfg.head_dim,)) for n in ("k", "v")]
    ng = -(-cfg.head_dim // GROUP_SIZE)
    items = []
    for n in ("k", "v"):
        items += [(n + "#packed", torch.uint8, base + (cfg.head_dim // 2,)),
                  (n + "#scale", torch.float16, base + (ng,)), (n + "#min", torch.float16, base + (ng,))]
    return items


def kv_rotation(head_dim: int, seed: int = 0) -> torch.Tensor:
    """A fixed orthogonal ``[head_dim, head_dim]`` float64 matrix for rotated 4-bit KV (QuaRot §4).

    Power-of-two ``head_dim``: the normalized Sylvester (Walsh-)Hadamard matrix ``H / sqrt(d)``,
    the online rotation QuaRot applies to keys after RoPE: every entry is ``±1/sqrt(d)``, so each
    input channel (an outlier) is spread evenly over all outputs. (Measured on SmolLM2-135M, a
    seeded random ±1 diagonal in front, QuaRot's randomized variant, did no better.) Other sizes
    (80, 96, ...): a random orthogonal matrix from ``seed`` (QR of a Gaussian with the signs of R's
    diagonal folded in, SpinQuant's initialization). Deterministic for a given ``(head_dim, seed)``.
    Raises ValueError for ``head_dim < 1``.
    """
    if head_dim < 1:
        raise ValueError(f"head_dim must be positive, got {head_dim}")
    if head_dim & (head_dim - 1) == 0:
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < head_dim:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        return h / head_dim ** 0.5
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(head_dim, head_dim, generator=g, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    return q * torch.sign(torch.diagonal(r))[None, :]


class TierKV:
    """One layer's K/V on an offload tier and/or 4-bit; ``attend`` is the attention call site.

    ``rotation``: an orthogonal ``[head_dim, head_dim]`` matrix (``kv_rotation``) or None. When
    given, ``write`` stores ``kR``/``vR`` and ``attend`` rotates q by R and its output by ``R^T``,
    so results equal attention over the unrotated cache up to the (smaller) quantization error.
    ``recent`` (compressed only; None = off): the cache's ``RecentIndex``, which assigns this
    layer's rows of the fp pool of recently written blocks through which each query reads its
    own block in full precision (module docstring); ``recent_blocks`` (0 turns the pool off) is
    its capacity.
    """

    def __init__(self, tensors: dict[str, torch.Tensor], tier: str, compress: bool,
                 compute_device: torch.device, dtype: torch.dtype, cpu_compute: bool, timers: Timers,
                 rotation: torch.Tensor | None = None, recent: RecentIndex | None = None,
                 prefill_temp_per_token: int = 0):
        self.t, self.tier, self.compress = tensors, tier, compress
        self.device = resolve_device(compute_device)
        self.dtype, self.cpu_compute, self.timers = dtype, cpu_compute, timers
        key = tensors["k#packed" if compress else "k"]
        self.store_device = key.device
        self.block_size, self.kv_heads = key.shape[1], key.shape[2]
        self.head_dim = key.shape[3] * (2 if compress else 1)
        self.set_rotation(rotation)
        # the pool: rows ``recent.rows`` assigns, plus the scratch row ``recent.scratch``
        # ([capacity + 1, block_size, kv_heads, head_dim], compute dtype, store device)
        self.recent = recent if compress and recent is not None and recent.capacity else None
        self.recent_blocks = self.recent.capacity if self.recent else 0  # 0 turns the pool off
        self.pool_k = self.pool_v = None
        if self.recent:
            shape = (self.recent.capacity + 1, self.block_size, self.kv_heads, self.head_dim)
            self.pool_k, self.pool_v = (self._pool_tensor(shape) for _ in range(2))
        self.mapped: bool | None = None  # decided on first use (``_zero_copy``)
        self._kernels: bool | None = None  # decided on first use (``_int4_kernels``)
        self.stored: "torch.cuda.Event | None" = None  # a side-stream store still in flight
        self.prefill_temp_per_token = prefill_temp_per_token  # ``prefill_temp_bytes_per_token``

    def _pool_tensor(self, shape: tuple[int, ...]) -> torch.Tensor:
        """One zeroed pool tensor on the store device; pinned for a host tier under a GPU, so
        that the kernels can read and write it in place with the 4-bit cache (``_int4_kernels``)."""
        if self.tier == "cpu" and self.device.type == "cuda":
            n = int(np.prod(shape)) * self.dtype.itemsize
            return host_empty(n, pin=True).view(self.dtype).view(shape).zero_()
        return torch.zeros(shape, dtype=self.dtype, device=self.store_device)

    @property
    def pool_rows(self):
        """Block id -> pool row (the cache's shared ``RecentIndex``)."""
        return self.recent.rows if self.recent else {}

    def set_rotation(self, rotation: torch.Tensor | None) -> None:
        """Use ``rotation`` (``[head_dim, head_dim]`` orthogonal, or None) from now on; only
        meaningful before anything is written (what is stored stays in the old basis)."""
        # in the compute dtype (one matmul per tensor, no casts): rounding R's entries to bf16
        # scales a Hadamard by a constant within 2^-9 and perturbs a random orthogonal matrix by
        # ~2^-9/sqrt(d), below the rounding of the bf16 activations it multiplies
        self.rot = None if rotation is None else rotation.to(self.device, self.dtype)
        self.rot_t = None if rotation is None else self.rot.T.contiguous()

    # -- storage -------------------------------------------------------------------------------
    def write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store new ``[num_tokens, num_kv_heads, head_dim]`` keys/values at flat slots (as
        ``kR``/``vR`` when this layer has a rotation). The recent-block pool is kept by ``attend``."""
        if self.rot is not None:
            k, v = _rotate(k, self.rot), _rotate(v, self.rot)
        self._store(k, v, slots)

    def _store(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, echo: bool = False):
        """Write k/v at ``slots``. ``echo`` (4-bit caches): also return what was stored,
        dequantized, as ``(k4, v4)`` like k/v in the compute dtype on the compute device."""
        if self._int4_kernels():  # quantize and write in one Triton launch
            with self.timers.section("compute"):
                out = tuple(torch.empty(k.shape, dtype=self.dtype, device=k.device)
                            for _ in range(2)) if echo else None
                _triton_kernels()[2].write_kv_int4(self._packed("k"), self._packed("v"), k, v, slots,
                                                   dequantized=out)
            return out
        off = self.store_device != k.device
        slots = slots.to(self.store_device)
        out = []
        for name, x in (("k", k), ("v", v)):
            parts = dict(zip(("#packed", "#scale", "#min"), quantize_int4(x, GROUP_SIZE, dim=-1))) \
                if self.compress else {"": x.to(self.dtype)}
            if echo:
                out.append(dequantize_int4(*parts.values(), GROUP_SIZE, dim=-1, dtype=self.dtype))
            for suf, src in parts.items():
                dst = self.t[name + suf]
                if off:
                    with self.timers.section("gtoc"):
                        src = src.to(self.store_device)
                with self.timers.section("ctod" if self.tier == "disk" else "compute"):
                    dst.view(-1, *dst.shape[2:]).index_copy_(0, slots, src.to(dst.dtype))
        return tuple(out) if echo else None

    def _packed(self, name: str) -> QuantizedKV:
        return QuantizedKV(self.t[name + "#packed"], self.t[name + "#scale"], self.t[name + "#min"],
                           GROUP_SIZE)

    def _int4_kernels(self) -> bool:
        """A 4-bit cache that the Triton kernels (CUDA) write and read in place: quantized writes,
        pool writes and decode attention go through them instead of the torch reference twins.
        The cache is on the compute device, or in pinned host memory mapped into the kernels
        (``_host_mapped``): writes land in place, and a decode step copies the range of 4-bit
        blocks it reads to the GPU in one DMA per tensor (``_staged``), with no gather on the
        CPU and no dequantized copy (a quarter of the fp cache's bytes)."""
        if self._kernels is None:
            here = self.store_device == self.device
            self._kernels = bool(self.compress and self.device.type in INT4_KERNEL_DEVICES
                                 and (here or self._mappable()) and _triton_kernels() is not None)
        return self._kernels

    def _mappable(self) -> bool:
        """A pinned host tier under a GPU that computes its attention (not delegated to the CPU),
        its pool pinned too."""
        return (self.tier == "cpu" and not self.cpu_compute and self.device.type == "cuda"
                and self.t["k#packed"].is_pinned() and (self.pool_k is None or self.pool_k.is_pinned()))

    def _host_mapped(self) -> bool:
        """A 4-bit host cache that the kernels use in place (``_int4_kernels``)."""
        return self._int4_kernels() and self.store_device != self.device

    def _settle_host(self) -> None:
        """Before the host itself reads or writes a mapped 4-bit layer or its pool (the rare
        gather paths): wait until the kernels queued to write them have run."""
        if self._host_mapped():
            torch.cuda.synchronize(self.device)

    def _blocks(self, name: str, ids: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Blocks ``ids`` of K or V, dequantized, on ``device`` in the compute dtype."""
        ids = ids.to(self.store_device)
        term = "dtoc" if self.tier == "disk" else "compute"
        if self.compress:
            self._settle_host()
            with self.timers.section(term):
                p, s, z = (self.t[name + suf][ids] for suf in ("#packed", "#scale", "#min"))
            if device != self.store_device:
                with self.timers.section("ctog"):
                    p, s, z = (x.to(device, non_blocking=True) for x in (p, s, z))
            with self.timers.section("compute"):
                if self._int4_kernels() and device == self.store_device == self.device:
                    return _dequantize_blocks(p, s, z, self.dtype)
                return dequantize_int4(p, s, z, GROUP_SIZE, dim=-1, dtype=self.dtype)
        with self.timers.section(term):
            x = self.t[name][ids]
        if device != self.store_device:
            with self.timers.section("ctog"):
                x = x.to(device, non_blocking=True)
        return x

    # -- attention -----------------------------------------------------------------------------
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        """Write k/v, then attention of q ``[num_tokens, num_heads, head_dim]`` over the cache;
        returns ``[num_tokens, num_heads, head_dim]`` on the compute device."""
        if self.rot is not None:
            k, v = _rotate(k, self.rot), _rotate(v, self.rot)
            q = _rotate(q, self.rot).to(q.dtype)  # (qR)(kR)^T = qk^T
        if self._zero_copy():
            self._await_store()
            out = self._attend_mapped(q, k, v, meta, scale)
            if out is not None:
                return self._unrotate(out)
        if self._int4_kernels() and not meta.is_prefill:
            with self.timers.section("compute"):
                out = (self._decode_int4(q, k, v, meta, scale) if meta.pool_rows is None
                       else self._decode_int4_static(q, k, v, meta, scale))
                return self._unrotate(out)
        if self.compress and _whole_prompts(meta):
            out = self._fresh_int4_prefill(q, k, v, meta, scale)
            with self.timers.section("compute"):
                return self._unrotate(out)
        self._store(k, v, meta.slot_mapping)
        on_cpu = (self.cpu_compute and not meta.is_prefill and self.tier != "gpu"
                  and self.device.type != "cpu")
        where = torch.device("cpu") if on_cpu else self.device
        if self._fresh_prefill(meta):
            # no cached prefix and no 4-bit rounding: the cache would return exactly the k/v just
            # computed, so attend over those where they are instead of reading them back
            # (FlexGen's prefill attends on the GPU before storing the cache off it)
            with self.timers.section("compute"):
                out = fresh_prefill_attention(q, k, v, meta.query_lens, scale)
                return self._unrotate(out)
        plan = self._plan(meta)
        ids = plan.ids_on(self.store_device)
        kc, vc = self._blocks("k", ids, where), self._blocks("v", ids, where)
        if on_cpu:
            with self.timers.section("gtoc"):
                qc = q.to(where)
        else:
            qc = q
        with self.timers.section("compute"):
            if self.recent_blocks:
                out = self._attend_recent(qc, k, v, kc, vc, plan, meta, scale, where)
            elif meta.is_prefill:
                out = ref.paged_prefill_attention(qc, kc, vc, plan.local_on(where),
                                                  meta.context_lens_list, meta.query_lens, scale)
            else:
                out = ref.paged_decode_attention(qc, kc, vc, plan.local_on(where),
                                                 meta.context_lens.to(where), scale)
        if on_cpu:
            with self.timers.section("ctog"):
                out = out.to(self.device)
        with self.timers.section("compute"):
            return self._unrotate(out)

    def _unrotate(self, out: torch.Tensor) -> torch.Tensor:
        """Attention output over the rotated cache back to the model's basis: P(VR) R^T = PV."""
        return out if self.rot is None else _rotate(out, self.rot_t).to(out.dtype)

    def _zero_copy(self) -> bool:
        """An uncompressed, pinned host-memory tier that the GPU attends to in place (mapped
        pinned memory is addressable from kernels under unified addressing), unless the policy
        delegates attention to the CPU."""
        if self.mapped is None:
            k = self.t.get("k")
            self.mapped = bool(self.tier == "cpu" and not self.compress and not self.cpu_compute
                               and self.device.type == "cuda" and k is not None and k.is_pinned()
                               and _triton_kernels() is not None)
        return self.mapped

    def _attend_mapped(self, q, k, v, meta: AttentionMetadata, scale: float):
        """GPU kernels over the pinned host cache: the new K/V written and every block read
        across PCIe by the kernels themselves (no gather on the CPU, no staging copy). Returns
        None (and turns the path off for this layer) if the kernels refuse host memory."""
        decode, prefill, kv_write = _triton_kernels()
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
            import warnings
            warnings.warn(f"GPU kernels cannot read the pinned KV cache in place ({e!r}); "
                          "copying blocks to the GPU instead", RuntimeWarning, stacklevel=2)
            self.mapped = False
            return None

    def _store_behind(self, kv_write, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Write a prefill's K/V into the pinned host cache on a side stream, overlapping the rest
        of the layer (FlexGen §4.2: batch k-1's store runs while batch k computes); a prompt's
        cache crossing PCIe takes ~10 ms per layer for 16k OPT-30B tokens. The next use of this
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

    def _fresh_prefill(self, meta: AttentionMetadata) -> bool:
        """A prefill of whole prompts (context = query for every sequence) on an uncompressed
        tier off the compute device."""
        return not self.compress and self.store_device != self.device and _whole_prompts(meta)

    def _fresh_int4_prefill(self, q, k, v, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Whole prompts into a 4-bit cache: the write returns the 4-bit values it stored
        (``_store(echo=True)``), and the prompts attend over those (plus their own blocks in fp
        with the pool on): the same keys a gather from the cache would give, without the gather
        (6 index kernels and a dequantization per layer and GPU batch, and their host time)."""
        k4, v4 = self._store(k, v, meta.slot_mapping, echo=True)
        with self.timers.section("compute"):
            if not self.recent_blocks:
                return fresh_prefill_attention(q, k4, v4, meta.query_lens, scale)
            fixed = meta.static_prefill
            if fixed is not None:  # a graphed step: rows and pool slots were settled on the host
                out = self._attend_recent_fresh(q, k, v, k4, v4, meta, scale, lambda _L: fixed.mask)
                self._pool_put(fixed.keep_slots, k[fixed.keep_tokens], v[fixed.keep_tokens])
                return out
            plan = self._plan(meta)
            bs = self.block_size
            out = self._attend_recent_fresh(q, k, v, k4, v4, meta, scale,
                                            lambda L: plan.recent_mask(0, L, bs, q.device))
            self._keep_recent(plan, meta, k, v)
            return out

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
        return _triton_kernels()[0].paged_decode_attention_int4(
            q, k, v, tables, meta.context_lens, scale, max_context_len=max(meta.context_lens_list), **own)

    def _staged(self, meta: AttentionMetadata) -> tuple[QuantizedKV, QuantizedKV, torch.Tensor]:
        """A decode step's 4-bit blocks of this (host-mapped) layer copied to the GPU, one DMA
        per tensor over the range from the first to the last block the step reads, and the
        block tables shifted onto the copy. Read in place, the kernel crosses PCIe in 64-byte
        rows and 4-byte scales (measured: 13 GB/s on an H100 host for OPT-30B, 144 sequences); a
        copy moves them at the link's rate. The pool (each sequence's own block in fp) stays
        mapped, and the K/V write stays in place."""
        plan = self._plan(meta)
        lo, hi = plan.block_range
        tables = plan.tables_from(lo, meta.block_tables)
        with self.timers.section("ctog"):
            k, v = (QuantizedKV(*(self.t[name + suf][lo:hi].to(self.device, non_blocking=True)
                                  for suf in ("#packed", "#scale", "#min")), GROUP_SIZE) for name in ("k", "v"))
        return k, v, tables

    def fill_rows(self, rows: torch.Tensor, block_ids: torch.Tensor) -> None:
        """Pool rows made while their block already holds slots start from its 4-bit values
        (``rows``, ``block_ids``: int64 on the store device)."""
        dev = self.store_device
        self.pool_k[rows], self.pool_v[rows] = self._blocks("k", block_ids, dev), self._blocks("v", block_ids, dev)

    def _fill_new_rows(self, plan: "_StepPlan", rows: list[int], block_ids: list[int]) -> None:
        """``fill_rows`` for this step's new rows, their index tensors copied once a step."""
        dev = self.store_device
        self.fill_rows(plan.tensor("init_rows", rows, dev), plan.tensor("init_ids", block_ids, dev))

    def _decode_int4_reference(self, q, k, v, meta, scale, plan, assigned):
        """The gather path for the rare steps the kernel does not take (K/V already written)."""
        ids = plan.ids_on(self.store_device)
        kc, vc = self._blocks("k", ids, self.device), self._blocks("v", ids, self.device)
        return self._attend_recent(q, k, v, kc, vc, plan, meta, scale, self.device, assigned)

    # -- the recent-block pool ---------------------------------------------------------------------
    def _attend_recent(self, q, k, v, kc, vc, plan: "_StepPlan", meta, scale, where, assigned=None):
        """Attention where each query reads its own block in fp and earlier blocks 4-bit; the pool
        keeps each sequence's last block (module docstring). Same shapes as ``attend``; ``kc``/``vc``
        are the gathered, dequantized blocks ``[len(plan.ids), block_size, kvh, d]`` (this call's
        own copy: own blocks are overwritten in place in decode).

        Pool invariant: a row holds, for every slot of its block written so far, the fp value, or
        the 4-bit one where the row was (re)made after the slot was written (eviction, prefix
        cache), so a row is read whole, with no per-slot mask. ``assigned``: this step's
        ``_assign_rows`` result when the caller already made it (it must run once a step)."""
        if plan.decode is None:
            out = self._attend_recent_general(q, k, v, kc, vc, plan, meta, scale, where)
            self._keep_recent(plan, meta, k, v)
            return out
        offs = plan.decode[1]
        rows, init = assigned or self._assign_rows(plan, meta)
        dev = self.store_device
        if init:
            self._fill_new_rows(plan, [rows[i] for i in init], [plan.decode[0][i] for i in init])
        have = [i for i, r in enumerate(rows) if r >= 0]
        if len(have) == len(rows):  # the usual case: this step's token into the pool, the rows out
            r_t = plan.tensor("rows", rows, dev)
            self._pool_put(plan.tensor("pool_slots", self._pool_slots(rows, offs), dev), k, v)
            li = plan.tensor("own_local", plan.decode_local, where)
            self._settle_host()
            kc[li], vc[li] = self.pool_k[r_t].to(where), self.pool_v[r_t].to(where)
        else:  # more sequences than pool rows: those without one read only this token in fp
            d_t = plan.tensor("dst", plan.decode_dst, where)
            kc.view(-1, *kc.shape[2:]).index_copy_(0, d_t, k.to(where, self.dtype))
            vc.view(-1, *vc.shape[2:]).index_copy_(0, d_t, v.to(where, self.dtype))
            if have:
                r_have = [rows[i] for i in have]
                r_t = plan.tensor("rows", r_have, dev)
                slots = self._pool_slots(r_have, [offs[i] for i in have])
                t_t = plan.tensor("have", have, k.device)
                self._pool_put(plan.tensor("pool_slots", slots, dev), k[t_t], v[t_t])
                li = plan.tensor("own_local", [plan.decode_local[i] for i in have], where)
                self._settle_host()
                kc[li], vc[li] = self.pool_k[r_t].to(where), self.pool_v[r_t].to(where)
        return ref.paged_decode_attention(q, kc, vc, plan.local_on(where), meta.context_lens.to(where), scale)

    def _own_region(self, i: int, r: int | None, row: list[int], ctx: int, ql: int, start: int, kc,
                    vc, local, k: torch.Tensor, v: torch.Tensor, where: torch.device):
        """Sequence ``i``'s own-block region in fp: positions ``bs * (a // bs) .. ctx-1`` (a = its
        first query position) as ``[n, kv_heads, head_dim]`` K and V on ``where``: the first own
        block's slots written before this step from its pool row ``r`` (as the step found it) if it
        has one (else their 4-bit values), then this step's new tokens ``k/v[start:start+ql]``."""
        bs, a = self.block_size, ctx - ql
        j0 = a // bs
        new_k, new_v = k[start:start + ql].to(where, self.dtype), v[start:start + ql].to(where, self.dtype)
        n0 = a - j0 * bs  # earlier slots of the first own block
        if n0 == 0:
            return new_k, new_v
        if r is not None:
            pk, pv = self.pool_k[r, :n0].to(where), self.pool_v[r, :n0].to(where)
        else:
            pk, pv = kc[local[i][j0], :n0], vc[local[i][j0], :n0]
        return torch.cat([pk, new_k]), torch.cat([pv, new_v])

    def _attend_recent_fresh(self, q, k, v, k4, v4, meta, scale, mask_for):
        """Whole prompts (nothing cached before them): ``_attend_recent_general``'s masked
        attention with no pool row to read, over ``k4``/``v4`` (the 4-bit values just stored,
        token for token like k/v), each run of equal-length prompts in one SDPA call (a prefill
        of 4 x 512 tokens is one call per layer, not one per sequence); ``mask_for(L)`` is the
        ``[L, 2L]`` ``recent_mask`` of an L-token prompt."""
        num_heads = q.shape[1]
        out, start = torch.empty_like(q), 0
        for i, j in equal_runs(list(meta.query_lens)):
            n, L = j - i, meta.query_lens[i]
            end = start + n * L
            shape = (n, L, *k.shape[1:])
            fk, fv = (x[start:end].to(self.dtype).view(shape) for x in (k, v))
            keys = torch.cat([k4[start:end].view(shape), fk], 1)
            vals = torch.cat([v4[start:end].view(shape), fv], 1)
            # [n, kvh, 2L, d]
            keys, vals = keys.transpose(1, 2).to(q.dtype), vals.transpose(1, 2).to(q.dtype)
            o = torch.nn.functional.scaled_dot_product_attention(
                q[start:end].view(n, L, num_heads, -1).transpose(1, 2), keys, vals, attn_mask=mask_for(L),
                scale=scale, enable_gqa=self.kv_heads != num_heads)
            out[start:end] = o.transpose(1, 2).reshape(n * L, num_heads, -1)
            start = end
        return out

    def _attend_recent_general(self, q, k, v, kc, vc, plan, meta, scale, where):
        """Any batch (prefill, several queries per sequence, shared own blocks): per sequence, one
        SDPA over its 4-bit context followed by its own-block region in fp, masked so that a query
        at position p sees 4-bit keys before its block and fp keys of its block up to p."""
        bs, num_heads = self.block_size, q.shape[1]
        if plan.prior is None:  # the rows as the step found them: later layers see the same
            assert plan.assigned is None, "pool rows read after the step assigned them"
            plan.prior = [self.pool_rows.get(row[(ctx - ql) // bs]) for row, ctx, ql
                          in zip(plan.tables, meta.context_lens_list, meta.query_lens)]
        prior = plan.prior
        outs, start = [], 0
        for i, (row, ctx, ql) in enumerate(zip(plan.tables, meta.context_lens_list, meta.query_lens)):
            a = ctx - ql
            fk, fv = self._own_region(i, prior[i], row, ctx, ql, start, kc, vc, plan.local, k, v, where)
            ids = plan.tensor(f"ctx{i}", plan.local[i][:-(-ctx // bs)], where)
            keys = torch.cat([kc[ids].flatten(0, 1)[:ctx], fk]).transpose(0, 1)  # [kvh, 2ctx - s0, d], s0 = the own region's first slot
            vals = torch.cat([vc[ids].flatten(0, 1)[:ctx], fv]).transpose(0, 1)
            mask = plan.recent_mask(a, ctx, bs, where)
            o = torch.nn.functional.scaled_dot_product_attention(
                q[start:start + ql].transpose(0, 1), keys.to(q.dtype), vals.to(q.dtype),
                attn_mask=mask, scale=scale, enable_gqa=self.kv_heads != num_heads)
            outs.append(o.transpose(0, 1))
            start += ql
        return torch.cat(outs)

    def _keep_recent(self, plan: "_StepPlan", meta, k: torch.Tensor, v: torch.Tensor) -> None:
        """After a general step: pool this step's tokens of each sequence's last block."""
        bs, dev = self.block_size, self.store_device
        rows, init = self._assign_rows(plan, meta)
        if init:
            self._fill_new_rows(plan, [rows[i] for i in init],
                                [plan.tables[i][(meta.context_lens_list[i] - 1) // bs] for i in init])
        slots, t_l = kept_tokens(rows, meta.context_lens_list, meta.query_lens, bs)
        if slots:
            t_t = plan.tensor("keep_toks", t_l, k.device)
            self._pool_put(plan.tensor("keep_slots", slots, dev), k[t_t], v[t_t])

    def _pool_slots(self, rows: list[int], offs: list[int]) -> list[int]:
        """Flat pool slots (``attention.pool_slot``) of ``rows`` at ``offs``."""
        return [pool_slot(r, o, self.block_size) for r, o in zip(rows, offs)]

    def _pool_put(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write fp K/V ``[n, kv_heads, head_dim]`` into the pool at flat slots ``slots``."""
        if self._host_mapped():  # the pinned pool, written by the kernel like the mapped fp cache
            _triton_kernels()[2].write_kv(self.pool_k, self.pool_v, k, v, slots.to(self.device))
            return
        for pool, x in ((self.pool_k, k), (self.pool_v, v)):
            pool.view(-1, *pool.shape[2:])[slots] = x.to(self.store_device, self.dtype)

    def _assign_rows(self, plan: "_StepPlan", meta) -> tuple[list[int], list[int]]:
        """This step's pool rows (``RecentIndex.assign``), decided once by the first layer that
        asks and kept on the step's plan for the others."""
        if plan.assigned is None:
            plan.assigned = self.recent.assign(plan.tables, meta.context_lens_list, meta.query_lens,
                                               self.block_size)
        return plan.assigned

    def _plan(self, meta: AttentionMetadata) -> "_StepPlan":
        """The step's plan, built by the first layer that asks and kept on ``meta``."""
        if meta.tier_plan is None:
            meta.tier_plan = _StepPlan(meta, self.block_size)
        return meta.tier_plan


_STORE_STREAMS: dict = {}
_LAST_STORE: dict = {}  # device -> event of the latest side-stream store


def prefill_temp_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes per prompt token that the rest of a layer allocates after its attention, all counted
    as alive at once (an upper bound): the attention output and the o-projection (q_size +
    hidden), the MLP's up/gate output, its activation and the down projection (3 intermediate +
    hidden). Llama-2-7B: 90 KB a token, 0.69 GiB for a 16 x 512 GPU batch."""
    return (cfg.q_size + 3 * cfg.intermediate_size + 2 * cfg.hidden_size) * dtype.itemsize


def _whole_prompts(meta: AttentionMetadata) -> bool:
    """A prefill step with nothing cached before any of its prompts (context = query)."""
    return meta.is_prefill and meta.context_lens_list == list(meta.query_lens)


def _room_for(k: torch.Tensor, v: torch.Tensor, device: torch.device, later: int = 0) -> bool:
    """Whether a side-stream store fits: it keeps k's and v's storage (views of the fused qkv
    output) alive until it ends, on top of the ``later`` bytes the layer allocates next; the
    limit is 90% of the GPU's memory times this process's allocator fraction (``build_offload``'s
    ``gpu_memory`` cap). On an H100 Llama-2-7B 16x8 at 6 GiB peaked at 5.76 GiB without the
    store; counting only twice the held K/V let the store run there and ran out of the cap."""
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


def _triton_kernels():
    """(paged_decode, paged_prefill, kv_write) when the Triton kernels import, else None."""
    from localgen.kv import attention

    mods = attention._triton()
    return mods if mods else None


def _dequantize_blocks(p: torch.Tensor, s: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gathered 4-bit K or V blocks (``[..., head_dim // 2]`` codes, ``[..., groups]`` scale/min)
    dequantized in one Triton launch (``kernels.dequant``; groups along the last dim are its
    ``dim`` 1 layout) instead of ``dequantize_int4``'s six torch passes over a float32 copy."""
    from localgen.kernels.dequant import dequantize_weight
    from localgen.kernels.quant_ref import QuantizedWeight

    flat = QuantizedWeight(p.reshape(-1, p.shape[-1]), s.reshape(-1, s.shape[-1]),
                           z.reshape(-1, z.shape[-1]), GROUP_SIZE, dim=1)
    return dequantize_weight(flat, dtype).view(*p.shape[:-1], 2 * p.shape[-1])


def _rotate(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """``x @ r`` in ``r``'s dtype (the compute dtype); the result in that dtype."""
    return (x if x.dtype == r.dtype else x.to(r.dtype)) @ r


class _StepPlan:
    """What every layer of one step reads, built once per step from its ``AttentionMetadata``:
    the blocks to gather (``ids``, sorted, CPU int64), each sequence's table remapped onto them
    (``local``), and for a decode step whose own (last) blocks are not shared, ``decode`` =
    (own block id, offset of the new token in it) per sequence, with ``decode_local`` (the own
    blocks' local indices) and ``decode_dst`` (the new tokens' flat local slots); ``assigned``:
    the step's pool rows once the first layer has asked (``TierKV._assign_rows``), and ``prior``
    the rows the step found (read by every layer of a general step)."""

    def __init__(self, meta: AttentionMetadata, bs: int):
        self.tables = meta.block_tables.tolist()
        used = used_blocks(self.tables, meta.context_lens_list, bs)
        uniq = sorted(set(used))
        pos = {b: i for i, b in enumerate(uniq)}
        self.ids = torch.tensor(uniq, dtype=torch.long)
        self.block_range = (uniq[0], uniq[-1] + 1) if uniq else (0, 0)  # [first, last] block read
        self.local = [[pos.get(b, 0) for b in row] for row in self.tables]
        self._on: dict = {}  # device-side copies made once a step, by device (and key)
        self._tensors: dict = {}
        self.decode = None
        self.assigned: tuple[list[int], list[int]] | None = None
        self.prior: list[int | None] | None = None  # pool rows before ``assigned`` (general steps)
        if not meta.is_prefill and all(ql == 1 for ql in meta.query_lens):
            own = own_blocks(self.tables, meta.context_lens_list, bs, used)
            if own is not None:
                offs = [(c - 1) % bs for c in meta.context_lens_list]
                self.decode = (own, offs)
                self.decode_local = [pos[b] for b in own]
                self.decode_dst = [li * bs + o for li, o in zip(self.decode_local, offs)]

    def tensor(self, key: str, values: list[int], device: torch.device) -> torch.Tensor:
        """``values`` as an int64 tensor on ``device``, reused while the same values are asked
        for under ``key`` (the layers of a step ask for the same ones: one host->device copy)."""
        hit = self._tensors.get((key, device))
        if hit is not None and hit[0] == values:
            return hit[1]
        t = torch.tensor(values, dtype=torch.long, device=device)
        self._tensors[(key, device)] = (values, t)
        return t

    def _once(self, key: tuple, make):
        """``make()`` the first time a layer of the step asks for ``key``, then the same tensor."""
        if key not in self._on:
            self._on[key] = make()
        return self._on[key]

    def ids_on(self, device: torch.device) -> torch.Tensor:
        """``ids`` on ``device`` (each layer's gather reads them)."""
        return self._once(("ids", device), lambda: self.ids.to(device))

    def local_on(self, device: torch.device) -> torch.Tensor:
        return self._once(("local", device),
                          lambda: torch.tensor(self.local, dtype=torch.long, device=device))

    def tables_from(self, lo: int, block_tables: torch.Tensor) -> torch.Tensor:
        """The step's block tables (``meta.block_tables``) shifted onto a copy of blocks ``lo``
        onward (``TierKV._staged``; entries past a context, unread, clamped to 0), made once a step."""
        return self._once(("tables_from", lo, block_tables.device),
                          lambda: (block_tables - lo).clamp_(min=0))

    def recent_mask(self, a: int, ctx: int, bs: int, device: torch.device) -> torch.Tensor:
        """``recent_mask``, made once a step."""
        return self._once(("recent_mask", a, ctx, device), lambda: recent_mask(a, ctx, bs, device))


def recent_mask(a: int, ctx: int, bs: int, device: torch.device) -> torch.Tensor:
    """Mask of queries at positions ``a .. ctx-1`` over a sequence's 4-bit keys ``0 .. ctx-1``
    followed by its fp keys ``s0 .. ctx-1`` (``s0`` the first slot of the first query's block):
    query p sees 4-bit keys before its own block and fp keys of its block up to p
    (``TierKV._attend_recent_*``). A whole prompt of L tokens: ``[L, 2L]`` bool."""
    qpos = torch.arange(a, ctx, device=device)[:, None]
    own = (qpos // bs) * bs  # first position of each query's own block
    jq = torch.arange(ctx, device=device)[None, :]
    jf = torch.arange((a // bs) * bs, ctx, device=device)[None, :]
    return torch.cat([jq < own, (jf >= own) & (jf <= qpos)], dim=1)


def kept_tokens(rows: list[int], context_lens: list[int], query_lens: list[int],
                bs: int) -> tuple[list[int], list[int]]:
    """What a step puts into the recent-block pool: the flat pool slots (``pool_slot``) and the
    step's packed token indices of each sequence's new tokens in its last block, for the
    sequences with a pool row (``rows[i] >= 0``)."""
    slots, toks, start = [], [], 0
    for r, ctx, ql in zip(rows, context_lens, query_lens):
        j = (ctx - 1) // bs
        first = max(ctx - ql, j * bs)
        if r >= 0:
            slots += range(pool_slot(r, first - j * bs, bs), pool_slot(r, ctx - j * bs, bs))
            toks += range(start + first - (ctx - ql), start + ql)
        start += ql
    return slots, toks


@dataclass
class StaticPrefill:
    """A whole-prompt prefill batch replayed as a CUDA graph (``runtime.offload.prefill_graphs``):
    its pool writes settled on the host before the replay, so no layer plans on the host.

    keep_slots: ``[n_keep]`` int64 flat pool slots (``kept_tokens``; sequences without a row
    write the scratch row), on the store device. keep_tokens: ``[n_keep]`` int64 packed token
    indices of this batch. mask: ``[L, 2L]`` bool ``recent_mask`` of the batch's prompt length."""

    keep_slots: torch.Tensor
    keep_tokens: torch.Tensor
    mask: torch.Tensor


class TieredKVCache:
    """K/V of every layer on the tier ``tiers[i]`` gives; ``views[i]`` is what layer i attends with.

    ``num_blocks``/``block_size`` describe the block manager's pool (shared by all layers).
    With ``compress``: ``rotate`` (default on) stores K/V rotated by ``kv_rotation`` (QuaRot), which
    cuts the 4-bit error on outlier channels (without compression it would change nothing but
    float rounding, so it is off there unless asked for); ``recent_blocks`` (default
    ``DEFAULT_RECENT_BLOCKS``; 0 = off) is the per-layer capacity of the fp pool of each sequence's
    last block, one block per concurrently running sequence (the runner passes ``max_num_seqs``).
    ``nbytes``/``bytes_on`` count the pools at full capacity. Raises ValueError when a layer goes
    to disk and no ``offload_dir`` is given.
    """

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, tiers: list[str], compress: bool, cpu_compute: bool,
                 offload_dir: str | os.PathLike | None, timers: Timers, rotate: bool | None = None,
                 recent_blocks: int | None = None):
        self.num_blocks, self.block_size, self.tiers = num_blocks, block_size, list(tiers)
        self.device = resolve_device(device)
        # one block past the allocator's range: padded rows of a CUDA-graph batch write there
        lay = Layout(_kv_items(cfg, num_blocks + 1, block_size, dtype, compress))
        self.scratch_block = num_blocks
        if recent_blocks is None:
            recent_blocks = DEFAULT_RECENT_BLOCKS
        self.recent_blocks = min(recent_blocks, num_blocks) if compress else 0
        self.recent = RecentIndex(self.recent_blocks) if self.recent_blocks else None
        # the pool of a disk layer lives in host memory; its rows plus the scratch row
        self.pool_bytes = ((self.recent_blocks + 1) * block_size * cfg.num_kv_heads * cfg.head_dim * 2
                           * dtype.itemsize if self.recent_blocks else 0)
        self.layer_bytes = lay.nbytes
        self.views: list = []
        self.maps: list = []
        if "disk" in self.tiers and offload_dir is None:
            raise ValueError("the policy puts KV cache on disk (cd > 0): give an offload dir")
        self.rotate = compress if rotate is None else rotate
        rot = kv_rotation(cfg.head_dim) if self.rotate else None
        temp = prefill_temp_bytes_per_token(cfg, dtype)
        for i, tier in enumerate(self.tiers):
            if tier == "gpu":
                buf = torch.zeros(lay.nbytes, dtype=torch.uint8, device=self.device)
            elif tier == "cpu":
                buf = host_empty(lay.nbytes, pin=self.device.type == "cuda")
                buf.zero_()
            else:
                path = Path(offload_dir) / f"kv_{i:03d}.bin"
                path.parent.mkdir(parents=True, exist_ok=True)
                mm = np.memmap(path, dtype=np.uint8, mode="w+", shape=(lay.nbytes,))
                self.maps.append(mm)
                buf = torch.from_numpy(mm)
            t = lay.views(buf)
            if tier == "gpu" and not compress and rot is None:
                self.views.append(LayerKV(t["k"], t["v"]))
            else:
                self.views.append(TierKV(t, tier, compress, self.device, dtype, cpu_compute, timers, rot,
                                         self.recent, temp))

    def graphable(self) -> bool:
        """Whether a decode step can be replayed as a CUDA graph: every layer on the GPU tier and,
        for a 4-bit cache, written and read by the Triton kernels (no host work per layer)."""
        return (self.device.type == "cuda" and all(t == "gpu" for t in self.tiers)
                and all(isinstance(v, LayerKV) or v._int4_kernels() for v in self.views))

    def decodes_in_place(self) -> bool:
        """Whether every layer's decode attention reads the cache where it is stored, through the
        compute device's kernels: plain layers on the compute device, 4-bit layers there through
        the Triton kernels, a pinned host cache mapped into them. A decode batch of any size then
        needs no copy of its blocks (the gather path and CPU attention make one per call)."""
        return all(isinstance(v, LayerKV) or v._int4_kernels() or v._zero_copy() for v in self.views)

    def graph_pool_rows(self, tables: list[list[int]], context_lens: list[int]) -> list[int] | None:
        """The pool row of each sequence of a decode step about to be replayed as a CUDA graph
        (``runtime.cuda_graphs``), assigned on the host once for all layers; rows made while their
        block already holds earlier slots are filled in every layer first, from the 4-bit values
        (eagerly, before the replay). Rows are unused (0) without a pool. None when the step must
        run eagerly: an own block another sequence also reads, or more sequences than rows."""
        if self.recent is None:
            return [0] * len(tables)
        bs = self.block_size
        if own_blocks(tables, context_lens, bs) is None:
            return None
        rows, init = self.recent.assign(tables, context_lens, [1] * len(tables), bs)
        if init:  # before any fallback: the eager path will find these rows made
            r = [rows[i] for i in init]
            ids = [tables[i][(context_lens[i] - 1) // bs] for i in init]
            on: dict = {}  # the index tensors once per device, not once per layer
            for view in self.views:
                dev = view.store_device
                if dev not in on:
                    on[dev] = (torch.tensor(r, device=dev), torch.tensor(ids, device=dev))
                view.fill_rows(*on[dev])
        return rows if min(rows) >= 0 else None

    def bytes_on(self, tier: str) -> int:
        """Bytes held on ``tier``: the stored K/V, plus the recent-block pools at full capacity
        (a disk layer's pool is in host memory, "cpu")."""
        pools = sum((t if t != "disk" else "cpu") == tier for t in self.tiers)
        return self.layer_bytes * sum(t == tier for t in self.tiers) + self.pool_bytes * pools

    @property
    def nbytes(self) -> int:
        return (self.layer_bytes + self.pool_bytes) * len(self.tiers)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of K and V, all layers, of one block (the layers' pools hold num_blocks + 1)."""
        return self.layer_bytes * len(self.tiers) // (self.num_blocks + 1)
