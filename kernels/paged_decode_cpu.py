"""Paged decode attention on the CPU (``csrc/paged_decode_cpu.c``): one query token per sequence
over its blocks, read in place through the block table (no gather), GQA without repeating K/V,
split-KV across threads (FlashDecoding, Dao et al. 2023) so batch 1 uses every core, the online
softmax of FlashAttention within a split. Float32 arithmetic for bf16 and fp32 caches.

A decode step plans once (``plan``: block tables, lengths, split count) and every layer runs
the kernel on that plan (``run``). The reference twin is
``paged_attention_ref.paged_decode_attention`` (``paged_decode`` takes the same arguments).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from . import cpu_build

# Context tokens below which a split costs more in its partial and combine than it saves.
MIN_SPLIT_TOKENS = 128
# K rows (tokens x KV heads, all sequences) below which one thread is faster than a parallel
# region, whose fork and join cost more than the work and, on a loaded machine, a wait for a
# time slice.
MIN_PARALLEL_ROWS = 512
MAX_GROUP, MAX_DIM = 16, 256  # the C kernel's stack buffers

_i64, _int, _p = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_ARGTYPES = [_p, _i64, _p, _p, _i64, _i64, _i64, _p, _i64, _p, _p, _int, _int, _int, _int, _int,
             ctypes.c_float, _int, _int, _int]


def _lib():
    return cpu_build.library("paged_decode_cpu", {"lg_paged_decode": _ARGTYPES})


def available() -> bool:
    """True when the C kernel could be built and loaded on this machine."""
    return _lib() is not None


def entry_address() -> int | None:
    """The address of ``lg_paged_decode`` (``run``'s C entry), for C code that attends without
    returning to Python (``layer_ops_cpu.layer_calls``); None where the kernel is not built."""
    lib = _lib()
    return None if lib is None else ctypes.cast(lib.lg_paged_decode, ctypes.c_void_p).value


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the kernel takes these tensors: CPU, fp32 or bf16 alike, head_dim <= 256, at
    most 16 query heads per KV head, q's heads and head_dim contiguous, K and V with equal
    strides and unit stride along head_dim."""
    return (q.device.type == "cpu" and q.dtype in cpu_build.DTYPE_CODES and k_cache.dtype == q.dtype
            and v_cache.dtype == q.dtype and k_cache.stride() == v_cache.stride()
            and k_cache.stride(-1) == 1 and q.stride(-1) == 1 and q.stride(1) == q.shape[-1]
            and q.shape[-1] <= MAX_DIM and q.shape[1] % k_cache.shape[2] == 0
            and q.shape[1] // k_cache.shape[2] <= MAX_GROUP)


def choose_splits(num_seqs: int, kv_heads: int, max_len: int, threads: int) -> int:
    """Context splits per (sequence, KV head): enough work items for two per thread, no split
    shorter than ``MIN_SPLIT_TOKENS``."""
    want = -(-2 * threads // (num_seqs * kv_heads))
    return max(1, min(want, max_len // MIN_SPLIT_TOKENS))


@dataclass
class Launch:
    """What every layer of one decode step passes the kernel: ``block_tables`` ``[num_seqs,
    max_blocks]`` and ``context_lens`` ``[num_seqs]`` as contiguous int64, the split count and
    the thread count."""

    block_tables: torch.Tensor
    context_lens: torch.Tensor
    splits: int
    threads: int


def plan(block_tables: torch.Tensor, context_lens: torch.Tensor, kv_heads: int,
         max_len: int) -> Launch:
    """The step's ``Launch``; ``max_len`` is the longest context (tokens)."""
    rows = int(context_lens.sum()) * kv_heads
    threads = torch.get_num_threads() if rows >= MIN_PARALLEL_ROWS else 1
    return Launch(block_tables.to(torch.int64).contiguous(),
                  context_lens.to(torch.int64).contiguous(),
                  choose_splits(len(context_lens), kv_heads, max_len, threads), threads)


def run(launch: Launch, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        scale: float) -> torch.Tensor:
    """Attention of q ``[num_seqs, num_heads, head_dim]`` over k_cache, v_cache ``[num_blocks,
    block_size, num_kv_heads, head_dim]`` as ``launch`` says; ``[num_seqs, num_heads,
    head_dim]`` in q's dtype. The caller has checked ``supports``."""
    num_seqs, num_heads, d = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    out = torch.empty((num_seqs, num_heads, d), dtype=q.dtype)
    bt, lens = launch.block_tables, launch.context_lens
    stride = k_cache.stride()
    rc = _lib().lg_paged_decode(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                                stride[0], stride[1], stride[2], bt.data_ptr(), bt.stride(0),
                                lens.data_ptr(), out.data_ptr(), num_seqs, num_heads, kv_heads,
                                d, block_size, scale, cpu_build.DTYPE_CODES[q.dtype], launch.splits,
                                launch.threads)
    if rc:
        raise ValueError(f"paged_decode_cpu: the kernel rejected q {tuple(q.shape)}")
    return out


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """Decode attention, in place over the paged cache.

    q: ``[num_seqs, num_heads, head_dim]``; k_cache, v_cache: ``[num_blocks, block_size,
    num_kv_heads, head_dim]`` (views of one tensor are fine); block_tables: ``[num_seqs,
    max_blocks]`` int (padded entries ignored); context_lens: ``[num_seqs]``, each >= 1, tokens
    in the cache including the current one. Returns ``[num_seqs, num_heads, head_dim]`` in q's
    dtype.

    Raises ValueError for tensors ``supports`` rejects, RuntimeError if the kernel is not built.
    """
    if _lib() is None:
        raise RuntimeError("the CPU decode kernel is not built (see kernels/cpu_build.py)")
    if not supports(q, k_cache, v_cache):
        raise ValueError(f"paged_decode_cpu: unsupported q {tuple(q.shape)} {q.dtype} strides "
                         f"{q.stride()}, cache {tuple(k_cache.shape)} {k_cache.dtype} strides "
                         f"{k_cache.stride()}")
    if int(context_lens.min()) < 1:
        raise ValueError("paged_decode_cpu: every context length must be >= 1")
    launch = plan(block_tables, context_lens, k_cache.shape[2], int(context_lens.max()))
    return run(launch, q, k_cache, v_cache, scale)
