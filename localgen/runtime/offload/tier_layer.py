"""One layer of the tiered KV cache: its K/V on one tier, 4-bit or not (``TierLayer``), and the
attention backend that reads it by gathering the blocks a step names onto the compute device.

The other ways of attending to a tiered layer are subclasses chosen once per layer when the cache is
built (``localgen.runtime.offload.tier_backends``; ``kv.build_tier_layer`` picks): CPU-computed
decode, the Triton int4 kernels, and GPU kernels over mapped host memory. A tiered layer is its own
KV view: the models call its ``attend``.
"""

from __future__ import annotations

import numpy as np
import torch

from localgen.attention.base import AttentionBackend, unsupported
from localgen.attention.metadata import AttentionMetadata
from localgen.attention.prefill import fresh_prefill_attention
from localgen.attention.reference import per_sequence_attention
from localgen.attention.spec import AttentionSpec
from localgen.attention.triton import triton_kernels
from localgen.kernels import paged_attention_ref as ref
from localgen.kernels.quant_ref import GROUP_SIZE, QuantizedKV, dequantize_int4, quantize_int4
from localgen.runtime.offload.memory import host_empty
from localgen.runtime.offload.recent import RecentIndex
from localgen.runtime.offload.tier_plan import TierStepPlan, whole_prompts
from localgen.runtime.offload.tier_recent import RecentPoolAttention
from localgen.runtime.offload.timers import Timers


def resolve_device(device: torch.device | str) -> torch.device:
    """``device`` with a bare "cuda" made "cuda:<current>": tensors report an index, and
    ``torch.device("cuda") != torch.device("cuda:0")``, so comparing a bare compute device with a
    cache tensor's device silently took the gather path for a GPU-tier 4-bit cache."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return d


class TierLayer(RecentPoolAttention, AttentionBackend):
    """One layer's K/V on an offload tier and/or 4-bit, attended by gathering (dequantizing) the
    step's blocks onto the compute device (``localgen.runtime.offload.kv``, step 3).

    ``tensors``: the layer's views of ``kv._kv_items`` (``k``/``v``, or ``k#packed``, ``k#scale``,
    ``k#min`` and the same for v). ``rotation``: an orthogonal ``[head_dim, head_dim]`` matrix
    (``kv_rotation``) or None. When given, ``write`` stores ``kR``/``vR`` and ``forward`` rotates
    q by R and its output by ``R^T``, so results equal attention over the unrotated cache up to the
    (smaller) quantization error. ``recent`` (compressed only; None = off): the cache's
    ``RecentIndex``, which assigns this layer's rows of the fp pool of recently written blocks
    through which each query reads its own block in full precision; ``recent_blocks`` (0 turns the
    pool off) is its capacity.
    """

    name = "tiered (gathered blocks)"
    int4_kernels = False  # quantized writes and block dequantization through the Triton kernels
    graph_safe = False  # a decode step runs no host work per layer (CUDA-graph capture)

    def __init__(self, tensors: dict[str, torch.Tensor], tier: str, compress: bool,
                 compute_device: torch.device, dtype: torch.dtype, cpu_compute: bool, timers: Timers,
                 rotation: torch.Tensor | None = None, recent: RecentIndex | None = None,
                 prefill_temp_per_token: int = 0):
        super().__init__()
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
        self.prefill_temp_per_token = prefill_temp_per_token  # ``prefill_temp_bytes_per_token``

    def _pool_tensor(self, shape: tuple[int, ...]) -> torch.Tensor:
        """One zeroed pool tensor on the store device; pinned for a host tier under a GPU, so
        that the kernels can read and write it in place with the 4-bit cache (``Int4KernelTierLayer``)."""
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

    # -- the backend interface ------------------------------------------------------------------
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
               spec: AttentionSpec) -> torch.Tensor:
        """The models' call (a tiered layer is its own KV view): ``forward`` over this layer."""
        return self.forward(self, q, k, v, meta, spec)

    def supports(self, spec: AttentionSpec) -> bool:
        """Every spec: a window, softcap or sinks run through the reference backend's
        ``per_sequence_attention`` over the gathered blocks (``_gathered``); subclasses whose
        kernels read the cache in place compute plain attention only."""
        return True

    def fuses_cpu_decode(self, dtype: torch.dtype) -> bool:
        """Never: the fused CPU decode layer writes a plain paged cache."""
        return False

    def reads_in_place(self) -> bool:
        """Whether decode reads the cache where it is stored (no copy of its blocks a step)."""
        return False

    def forward(self, kv, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                spec: AttentionSpec) -> torch.Tensor:
        """Write k/v, then attention of q ``[num_tokens, num_heads, head_dim]`` over the cache;
        returns ``[num_tokens, num_heads, head_dim]`` on the compute device. ``prefill`` and
        ``decode`` store the step's K/V themselves (how depends on the path). A spec beyond plain
        causal attention stores them and attends over the gathered blocks. Raises
        ``UnsupportedAttention`` for a spec this layer's class does not compute (``supports``)."""
        if not self.supports(spec):
            raise unsupported(self, spec, self.device)
        if self.rot is not None:
            k, v = _rotate(k, self.rot), _rotate(v, self.rot)
            q = _rotate(q, self.rot).to(q.dtype)  # (qR)(kR)^T = qk^T: windows and caps unchanged
        if not spec.plain:
            # the fresh-prefill shortcuts and the recent-block pool compute plain attention only;
            # a windowed layer reads every block from the cache (4-bit ones included)
            self._store(k, v, meta.slot_mapping)
            out = self._gathered(q, k, v, meta, spec,
                                 self.device if meta.is_prefill else self._decode_device())
        elif meta.is_prefill:
            out = self.prefill(self, q, k, v, meta, spec)
        else:
            out = self.decode(self, q, k, v, meta, spec)
        with self.timers.section("compute"):
            return self._unrotate(out)

    def write_kv(self, kv, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        self.write(k, v, meta.slot_mapping)

    def prefill(self, kv, q, k, v, meta: AttentionMetadata, spec: AttentionSpec) -> torch.Tensor:
        if self.compress and whole_prompts(meta):
            return self._fresh_int4_prefill(q, k, v, meta, spec.scale)
        self._store(k, v, meta.slot_mapping)
        if self._fresh_prefill(meta):
            # no cached prefix and no 4-bit rounding: the cache would return exactly the k/v just
            # computed, so attend over those where they are instead of reading them back
            # (FlexGen's prefill attends on the GPU before storing the cache off it)
            with self.timers.section("compute"):
                return fresh_prefill_attention(q, k, v, meta.query_lens, spec.scale)
        return self._gathered(q, k, v, meta, spec, self.device)

    def decode(self, kv, q, k, v, meta: AttentionMetadata, spec: AttentionSpec) -> torch.Tensor:
        self._store(k, v, meta.slot_mapping)
        return self._gathered(q, k, v, meta, spec, self._decode_device())

    def _decode_device(self) -> torch.device:
        """Where decode attends over the gathered blocks: the compute device."""
        return self.device

    def _gathered(self, q, k, v, meta: AttentionMetadata, spec: AttentionSpec,
                  where: torch.device) -> torch.Tensor:
        """Attention over the step's blocks gathered (dequantized) onto ``where``; the output on
        the compute device. A spec beyond plain attention goes through the reference backend's
        ``per_sequence_attention`` (one implementation of window, softcap and sinks)."""
        scale = spec.scale
        plan = self._plan(meta)
        ids = plan.ids_on(self.store_device)
        kc, vc = self._blocks("k", ids, where), self._blocks("v", ids, where)
        moved = where != self.device
        if moved:
            with self.timers.section("gtoc"):
                q = q.to(where)
        with self.timers.section("compute"):
            if not spec.plain:
                out = per_sequence_attention(q, kc, vc, plan.local_on(where),
                                             meta.context_lens_list, meta.query_lens, spec)
            elif self.recent_blocks:
                out = self._attend_recent(q, k, v, kc, vc, plan, meta, scale, where)
            elif meta.is_prefill:
                out = ref.paged_prefill_attention(q, kc, vc, plan.local_on(where),
                                                  meta.context_lens_list, meta.query_lens, scale)
            else:
                out = ref.paged_decode_attention(q, kc, vc, plan.local_on(where),
                                                 meta.context_lens.to(where), scale)
        if moved:
            with self.timers.section("ctog"):
                out = out.to(self.device)
        return out

    # -- storage -------------------------------------------------------------------------------

    def write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store new ``[num_tokens, num_kv_heads, head_dim]`` keys/values at flat slots (as
        ``kR``/``vR`` when this layer has a rotation). The recent-block pool is kept by ``forward``."""
        if self.rot is not None:
            k, v = _rotate(k, self.rot), _rotate(v, self.rot)
        self._store(k, v, slots)

    def _store(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, echo: bool = False):
        """Write k/v at ``slots``. ``echo`` (4-bit caches): also return what was stored,
        dequantized, as ``(k4, v4)`` like k/v in the compute dtype on the compute device."""
        if self.int4_kernels:  # quantize and write in one Triton launch
            with self.timers.section("compute"):
                out = tuple(torch.empty(k.shape, dtype=self.dtype, device=k.device)
                            for _ in range(2)) if echo else None
                triton_kernels()[2].write_kv_int4(self._packed("k"), self._packed("v"), k, v, slots,
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

    def _host_mapped(self) -> bool:
        """A 4-bit host cache that the kernels use in place (``Int4KernelTierLayer``)."""
        return False

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
                if self.int4_kernels and device == self.store_device == self.device:
                    return _dequantize_blocks(p, s, z, self.dtype)
                return dequantize_int4(p, s, z, GROUP_SIZE, dim=-1, dtype=self.dtype)
        with self.timers.section(term):
            x = self.t[name][ids]
        if device != self.store_device:
            with self.timers.section("ctog"):
                x = x.to(device, non_blocking=True)
        return x

    def _unrotate(self, out: torch.Tensor) -> torch.Tensor:
        """Attention output over the rotated cache back to the model's basis: P(VR) R^T = PV."""
        return out if self.rot is None else _rotate(out, self.rot_t).to(out.dtype)

    def _fresh_prefill(self, meta: AttentionMetadata) -> bool:
        """A prefill of whole prompts (context = query for every sequence) on an uncompressed
        tier off the compute device."""
        return not self.compress and self.store_device != self.device and whole_prompts(meta)

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

    def _plan(self, meta: AttentionMetadata) -> TierStepPlan:
        """The step's plan, built by the first layer that asks and kept on ``meta``."""
        return meta.plan(TierStepPlan, lambda: TierStepPlan(meta, self.block_size))


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
