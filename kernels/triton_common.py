"""Helpers shared by the Triton kernels (paged decode and prefill attention, the flat int4 GEMM):
the dot with float32 accumulation, the paged cache's row offsets, launch-time dtype and device
queries, and the per-device ticket counters that let a launch's last program combine the
others' partial results.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # the kernels use exp2: scores are scaled by log2(e) up front


def interpreting() -> bool:
    """Whether Triton runs under its interpreter (``TRITON_INTERPRET=1``, CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def num_sms(device: torch.device, off_cuda: int) -> int:
    """Streaming multiprocessors of a CUDA ``device``; ``off_cuda`` elsewhere (the interpreter has
    none: the caller names the count its launch heuristics should model there)."""
    if device.type != "cuda":
        return off_cuda
    return _cuda_sms(torch.device(device).index or torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def pow2(n: int, lo: int = 16) -> int:
    """The next power of two of ``n``, at least ``lo`` (Triton block shapes are powers of two;
    16 is the least M/N/K of a tensor-core dot)."""
    return max(lo, triton.next_power_of_2(int(n)))


def dot_dtype(dtype: torch.dtype):
    """The Triton dtype a kernel's dots take for activations of ``dtype`` (16-bit floats stay,
    anything else is float32)."""
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}.get(dtype, tl.float32)


def ieee_dots(dtype: torch.dtype) -> bool:
    """Whether the dots run as IEEE float32: for float32 inputs (no TF32 rounding), and for bf16
    under the interpreter, whose numpy dots have no bf16."""
    return dtype == torch.float32 or (interpreting() and dtype == torch.bfloat16)


_TICKETS: dict = {}


def tickets(device: torch.device, n: int) -> torch.Tensor:
    """At least ``n`` per-device int32 counters, all zero between launches: a kernel's programs
    that share an output take a ticket (``atomic_add``) after writing their partials, the last
    one combines them and sets the counter back to zero. Two such launches must not run
    concurrently on one device."""
    key = (device.type, device.index)
    buf = _TICKETS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        _TICKETS[key] = buf
    return buf


@triton.jit
def dot(a, b, DOT_DTYPE: tl.constexpr, IEEE: tl.constexpr):
    """``a @ b`` with float32 accumulation; operands cast to DOT_DTYPE (the model dtype). Under
    16 rows (tensor cores' least M; a decode program of one query head, MHA) as float32
    multiply-adds on the CUDA cores, operands uncast: nothing padded, no tensor-core layout
    shuffles."""
    if a.shape[-2] < 16:  # the M of a (batched) matmul; 3-D operands always have 16+
        r = tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], 1)
    elif IEEE:
        r = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        r = tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE), out_dtype=tl.float32)
    return r


@triton.jit
def token_rows(bt_row_ptr, tok, tok_mask, BS: tl.constexpr, stride_b, stride_t):
    """int64 offset of each token's row (KV block, slot) in a paged cache, through the sequence's
    block table row ``bt_row_ptr``; masked tokens read KV block 0."""
    blk = tl.load(bt_row_ptr + tok // BS, mask=tok_mask, other=0).to(tl.int64)
    return blk * stride_b + (tok % BS).to(tl.int64) * stride_t


__all__ = ["LOG2E", "interpreting", "num_sms", "pow2", "dot_dtype", "ieee_dots", "tickets",
           "dot", "token_rows"]
