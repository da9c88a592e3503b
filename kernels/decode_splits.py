"""Launch parameters of the paged decode kernel (``paged_decode``): FlashDecoding's split count
(how many programs share one sequence's context) and the tile configuration by shape.

Chosen offline from sweeps of tile size, warps, pipeline depth and split count on the GPU, with
no runtime autotuning, so the kernels stay capturable in CUDA graphs.
"""

from __future__ import annotations

import functools

import torch

from .triton_common import num_sms

# SMs modelled off CUDA (the interpreter): few, so that small test shapes still split
INTERPRETER_SMS = 4


def wave_span(programs: int, saturate: int, slots: int) -> int:
    """How many programs' worth of bandwidth-time a launch of ``programs`` equal, memory-bound
    programs takes when ``slots`` of them are resident at once and ``saturate`` resident programs
    saturate HBM: full waves run at full rate; a partial last wave (or a single one) of ``n``
    programs takes as long as ``max(n, saturate)`` would."""
    full, tail = divmod(programs, slots)
    return full * slots + (max(tail, saturate) if tail else 0)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context_len: int, device: torch.device,
                      block_n: int = 64, programs_per_sm: int = 4, min_tiles_per_split: int = 1,
                      max_splits: int = 128, resident_per_sm: int | None = None,
                      margin: float = 0.05, min_tiles_when_full: int = 8) -> int:
    """FlashDecoding's split count, at least ``min_tiles_per_split`` tiles of ``block_n`` tokens
    per split.

    Without ``resident_per_sm``: enough programs (``SMs * programs_per_sm``) to fill the GPU
    when ``num_seqs * num_kv_heads`` alone would not, else 1. With it: the fewest splits whose
    modelled time (``wave_span`` with ``programs_per_sm`` per SM saturating and
    ``resident_per_sm`` per SM resident, times the busiest split's whole tiles) is within
    ``margin`` of the best count's. The margin stands for what the model leaves out (the partials
    written and combined), and lets a launch just short of the saturating count count as full.
    The model splits a launch that would end in a thin last wave. When the (sequence, KV head)
    programs alone saturate HBM, a split keeps at least ``min_tiles_when_full`` tiles: a short
    program's fixed costs (the partials, the combine) outweigh the thin wave."""
    base = max(1, num_seqs * num_kv_heads)
    tiles = -(-max(1, max_context_len) // block_n)
    most = max(1, min(tiles // min_tiles_per_split, max_splits))
    sms = num_sms(device, INTERPRETER_SMS)
    if resident_per_sm is None:
        return int(min(-(-sms * programs_per_sm // base), most))
    saturate = sms * programs_per_sm
    if base >= saturate:
        most = max(1, min(most, tiles // min_tiles_when_full))
    return _wave_splits(base, tiles, most, saturate, sms * resident_per_sm, margin)


@functools.lru_cache(maxsize=4096)
def _wave_splits(base: int, tiles: int, most: int, saturate: int, slots: int,
                 margin: float) -> int:
    """``choose_num_splits``' wave-model search over 1..``most`` splits (cached: decode calls
    repeat a handful of shapes, and the search is up to 128 steps of Python)."""
    cost = {}
    for s in range(1, most + 1):
        per_split = -(-tiles // s)  # the kernel's whole-tile chunks: s may leave splits empty
        if -(-tiles // per_split) == s:
            cost[s] = per_split * wave_span(base * s, saturate, slots)
    best = min(cost.values())
    return min(s for s, c in cost.items() if c * (1 - margin) <= best)


def config_splits(cfg: dict, num_seqs: int, num_kv_heads: int, max_context_len: int,
                  device: torch.device, block_n: int | None = None) -> int:
    """``choose_num_splits`` with a ``decode_config`` result's split parameters."""
    return choose_num_splits(num_seqs, num_kv_heads, max_context_len, device,
                             block_n or cfg["block_n"], programs_per_sm=cfg["programs_per_sm"],
                             resident_per_sm=cfg.get("resident_per_sm"))


def decode_config(num_seqs: int, num_kv_heads: int, max_context_len: int, head_dim: int,
                  device: torch.device, quant: bool = False, gqa: int = 0) -> dict:
    """Launch parameters by shape: ``block_n`` (tokens per tile), ``num_warps``, ``num_stages``,
    ``programs_per_sm`` and ``resident_per_sm`` (split-KV, ``choose_num_splits``), ``fused``
    (the last split combines the partials in-kernel: one launch) and ``min_block_h`` (query rows
    a program at least holds: 16 puts the dots on the tensor cores).

    Plain caches: 128-token tiles with 4 warps and a 2-deep pipeline; about two programs per SM
    (one K+V tile pair each in flight) saturate HBM and the registers and shared memory of a
    program leave room for three resident. The 4-bit cache reads a quarter of the bytes per
    token and holds more registers (two resident): it wants about four programs per SM below
    256 (sequence, KV head) programs and no split above. Under MHA (``gqa`` 1: one query head a
    program) the 4-bit cache runs its dots on the CUDA cores in 64-token tiles with 2 warps,
    where padding one query row to a 16-row tensor-core tile would waste the dot; with GQA the
    tensor cores win."""
    del head_dim, device  # one table for every head_dim and GPU so far
    if not quant:
        return dict(block_n=128, num_warps=4, num_stages=2, programs_per_sm=2, resident_per_sm=3,
                    fused=True, min_block_h=16)
    base = num_seqs * num_kv_heads
    if base >= 256:  # enough (sequence, KV head) programs without splitting
        pps = 1
    else:
        pps = 2 if (base <= 8 and max_context_len > 4096) else 4
    if gqa == 1:
        return dict(block_n=64, num_warps=2, num_stages=2, programs_per_sm=pps, fused=True,
                    min_block_h=1)
    return dict(block_n=128, num_warps=4, num_stages=2, programs_per_sm=pps, fused=True,
                min_block_h=16)


__all__ = ["wave_span", "choose_num_splits", "config_splits", "decode_config"]
