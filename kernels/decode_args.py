"""Host-side arguments of the paged decode kernel (``paged_decode``): its compile-time switches
(``DecodeModes``), its runtime arguments packed in the kernels' order (``DecodeArgs``), and the
checks and buffers a launch needs (inputs, recompute flags, split partials, the 4-bit tiles'
geometry, the fp pool of own KV blocks).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from .quant_ref import QuantizedKV
from .score_features import ScoreFeatures
from .triton_common import LOG2E, pow2


@dataclass(frozen=True)
class DecodeModes:
    """The decode kernel's compile-time switches (each combination compiles its own kernel).

    ``async_softmax``: one unified max phi (FlashDecoding++ §3) instead of the online softmax;
    ``int4``: the 4-bit cache (FlexGen §5); ``own_fp``: each sequence's last KV block read from
    the full-precision pool (KIVI); ``one_split``: one program per (sequence, KV head) writes
    ``out`` itself, no partials; ``fused``: the split programs combine their partials in the
    same launch (the last ticket), else a second launch (``_decode_stage2``) does;
    ``features``: the sliding window, logit soft-cap and sinks (``score_features``), off by
    default."""

    async_softmax: bool
    int4: bool = False
    own_fp: bool = False
    one_split: bool = True
    fused: bool = False
    features: ScoreFeatures = field(default_factory=ScoreFeatures)

    @classmethod
    def plain(cls, async_softmax: bool, features: ScoreFeatures | None = None) -> DecodeModes:
        """A plain (bf16/fp16/fp32) cache."""
        return cls(async_softmax, features=features or ScoreFeatures())

    @classmethod
    def int4_cache(cls, async_softmax: bool, own_fp: bool,
                   features: ScoreFeatures | None = None) -> DecodeModes:
        """A 4-bit cache, its own KV blocks in the fp pool when ``own_fp``."""
        return cls(async_softmax, int4=True, own_fp=own_fp, features=features or ScoreFeatures())

    def single_pass(self) -> DecodeModes:
        """One program per (sequence, KV head) over its whole context."""
        return replace(self, one_split=True, fused=False)

    def split(self, fused: bool) -> DecodeModes:
        """Split-KV: partials per split, combined in-launch (``fused``) or by stage 2."""
        return replace(self, one_split=False, fused=fused)

    @property
    def combine_launch(self) -> bool:
        """Whether the partials need the second launch."""
        return not self.one_split and not self.fused

    def constexprs(self) -> dict:
        """The switches both stages take."""
        return dict(ASYNC=self.async_softmax, QUANT=self.int4, OWN_FP=self.own_fp,
                    **self.features.constexprs())

    def stage1_constexprs(self) -> dict:
        return dict(self.constexprs(), ONE_SPLIT=self.one_split, FUSED=self.fused)


@dataclass(frozen=True)
class DecodeArgs:
    """The runtime arguments of both stages, in the kernels' order. ``cache``: K, K-scale,
    K-min, V, V-scale, V-min (plain caches pass K and V for the unused ones); ``pool``: the fp
    pool's K and V; ``parts``: partial outputs, denominators and maxima; ``strides``: (q, cache,
    per-KV-head, pool, partials, out, block table row, flags row); ``softmax``: (qk_scale, phi,
    safe-range low, high) in log2 units, and the sink logits (``[num_heads]``; None without
    sinks)."""

    q: torch.Tensor
    cache: tuple
    pool: tuple
    own_rows: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    parts: tuple
    out: torch.Tensor
    flags: torch.Tensor
    strides: tuple
    softmax: tuple
    num_splits: int

    def stage2(self) -> tuple:
        return (self.q, self.cache, self.pool, self.own_rows, self.block_tables,
                self.context_lens, self.parts, self.out, self.flags, self.strides, self.softmax,
                self.num_splits)

    def stage1(self, tickets_: torch.Tensor, num_kv_heads: int) -> tuple:
        return (*self.stage2(), tickets_, num_kv_heads)


def flags_buffer(flags, num_seqs: int, num_heads: int, device, is_async: bool, wanted: bool):
    """The int32 ``[num_seqs, num_heads]`` recompute flags, or None when nobody needs them.
    The async kernels store every row's flag, so their buffer needs no clearing (a memset would
    be a second launch on every call); the sync kernels store none, so their returned flags are
    zeros."""
    if not wanted:
        return None
    if flags is None:
        alloc = torch.empty if is_async else torch.zeros
        return alloc(num_seqs, num_heads, dtype=torch.int32, device=device)
    if flags.shape != (num_seqs, num_heads) or flags.dtype != torch.int32 \
            or flags.stride(-1) != 1:
        raise ValueError(f"flags must be contiguous int32 [{num_seqs}, {num_heads}], got "
                         f"{flags.dtype} {tuple(flags.shape)}")
    if not is_async:
        flags.zero_()
    return flags


def checked_inputs(q, kc, vc, block_tables):
    """q, the block tables in an int dtype with a contiguous last dim; ValueError on shapes or
    strides the kernel cannot take."""
    if q.dim() != 3:
        raise ValueError(f"q must be [num_seqs, num_heads, head_dim], got {tuple(q.shape)}")
    kv_heads = kc.shape[2]
    if q.shape[1] % kv_heads:
        raise ValueError(f"num_heads {q.shape[1]} is not a multiple of num_kv_heads {kv_heads}")
    if kc.stride(-1) != 1 or vc.stride(-1) != 1 or kc.stride() != vc.stride():
        raise ValueError("K and V caches need the same strides and a contiguous last dim")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if block_tables.dtype not in (torch.int32, torch.int64):
        block_tables = block_tables.long()
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    return q, block_tables


def int4_geometry(quant_group, head_dim: int) -> dict:
    """The 4-bit tiles' constexprs: bytes per row, groups per row (and its power of two), bytes
    per group; placeholders for plain caches."""
    if quant_group is None:
        return dict(HALF_D=1, NG=1, NG_P=1, HG=1)
    group = int(quant_group)
    if group % 2 or group & (group - 1):
        raise ValueError(f"int4 group size must be an even power of two, got {group}")
    ng = -(-head_dim // group)
    geo = dict(HALF_D=head_dim // 2, NG=ng, NG_P=pow2(ng, 1), HG=group // 2)
    if geo["NG_P"] * geo["HG"] < 16:
        raise ValueError("int4 decode needs head_dim / 2 >= 16 (tensor-core dot width)")
    return geo


def _pool_args(own, kc, num_seqs: int, head_dim: int):
    """(pool K, pool V, rows, pool strides (row, slot, KV head)) for the own KV blocks, or
    placeholders when there is no pool."""
    if own is None:
        return kc, kc, kc, (0, 0, 0)
    pk, pv, own_rows = own
    bs, kv_heads = kc.shape[1:3]
    if pk.shape[1:] != (bs, kv_heads, head_dim) or pv.shape != pk.shape \
            or pk.stride() != pv.stride() or pk.stride(-1) != 1 or own_rows.shape != (num_seqs,):
        raise ValueError(f"own-block pool: K {tuple(pk.shape)}, V {tuple(pv.shape)}, rows "
                         f"{tuple(own_rows.shape)} do not match an int4 cache of block size "
                         f"{bs}, {kv_heads} KV heads, head_dim {head_dim}, {num_seqs} sequences")
    return pk, pv, own_rows, (pk.stride(0), pk.stride(1), pk.stride(2))


def _partials(q, num_splits: int):
    """The split partials (outputs, denominators, maxima) and their strides; tiny placeholders
    for a single pass."""
    num_seqs, num_heads, head_dim = q.shape
    if num_splits == 1:
        mid = torch.empty(1, 1, 1, dtype=torch.float32, device=q.device)
        return (mid, mid, mid), (0, 0, 0)
    mid_o = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32,
                        device=q.device)
    mid_l = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    mid_m = torch.empty_like(mid_l)
    return (mid_o, mid_l, mid_m), (mid_l.stride(0), mid_l.stride(1), mid_l.stride(2))


def pack_args(q, k, v, kc, vc, own, block_tables, context_lens, out, flags, scale, phi, bounds,
              num_splits, sinks) -> DecodeArgs:
    """``DecodeArgs`` for one launch (``k``/``v`` plain caches or QuantizedKV, ``kc``/``vc``
    their code tensors; ``sinks`` the sink logits or None)."""
    if isinstance(k, QuantizedKV):
        ks, kz, vs, vz = k.scale, k.min, v.scale, v.min
        s_strides = (ks.stride(0), ks.stride(1))
        s_head = ks.stride(2)
    else:
        ks = kz = vs = vz = kc  # unused
        s_strides, s_head = (0, 0), 0
    pk, pv, own_rows, p_strides = _pool_args(own, kc, q.shape[0], q.shape[2])
    parts, part_strides = _partials(q, num_splits)
    is_async = phi is not None
    softmax = (float(scale) * LOG2E, float(phi) * LOG2E if is_async else 0.0,
               float(bounds[0]) * LOG2E if is_async else 0.0,
               float(bounds[1]) * LOG2E if is_async else 0.0, sinks)
    strides = ((q.stride(0), q.stride(1)), (kc.stride(0), kc.stride(1), *s_strides),
               (kc.stride(2), s_head, p_strides[2]), p_strides[:2], part_strides,
               (out.stride(0), out.stride(1)), block_tables.stride(0),
               flags.stride(0) if flags is not out else 0)
    return DecodeArgs(q, (kc, ks, kz, vc, vs, vz), (pk, pv), own_rows, block_tables,
                      context_lens, parts, out, flags, strides, softmax, num_splits)


__all__ = ["DecodeModes", "DecodeArgs", "flags_buffer", "checked_inputs", "int4_geometry",
           "pack_args"]
