"""Device helpers of the M = 1 GGUF decode kernels (``gguf_gemv``'s float-code gemv and
``gguf_q8``'s 8-bit-activation gemv): block fields, the program's row and slot grid, and the
output store. Block layouts: ggml-common.h, as ``gguf.quants`` reads them."""

from __future__ import annotations

import triton
import triton.language as tl

# Shape arguments are not specialized (no recompiling per shape: the alignment the loads need
# comes from the row stride's factor in the kernel, not from the argument's value).
GEMV_ARGS = ["N", "num_tiles", "tiles_per_split"]


@triton.jit
def f16_at(ptr):
    """float32 of the fp16 stored at ``ptr`` (any integer pointer tensor, 2-byte aligned)."""
    return tl.load(ptr.to(tl.pointer_type(tl.float16))).to(tl.float32)


@triton.jit
def k4_scale_min(blk8, g):
    """6-bit scale and min of 32-weight groups ``g`` (int tensor, 0..7) of Q4_K blocks
    (``blk8``: uint8 pointers to each block, broadcast against ``g``; bytes 4..15 as in
    ggml's ``get_scale_min_k4``), float32 of the broadcast shape."""
    lane = g % 4
    sc_byte = tl.load(blk8 + 4 + lane).to(tl.int32)
    mn_byte = tl.load(blk8 + 8 + lane).to(tl.int32)
    hi_byte = tl.load(blk8 + 12 + lane).to(tl.int32)
    sc = tl.where(g < 4, sc_byte & 63, (hi_byte & 15) | ((sc_byte >> 6) << 4))
    mn = tl.where(g < 4, mn_byte & 63, (hi_byte >> 4) | ((mn_byte >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def finish(out, y_ptr, offs_n, N, ATOMIC: tl.constexpr):
    """Store ``out`` ``[BLOCK_N]`` of one activation row, or add it atomically (split K)."""
    mask = offs_n < N
    if not ATOMIC:
        tl.store(y_ptr + offs_n, out.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(y_ptr + offs_n, out, mask=mask)


@triton.jit
def slots(pid_n, pid_k, num_tiles, tiles_per_split, BLOCK_N: tl.constexpr, KB: tl.constexpr):
    """Output rows of the program, and its loop bounds and slot grid: a loop step reads ``KB``
    consecutive blocks of every row, as ``4·KB`` slots ``j`` of 8 words (block ``j // 4`` of the
    step, part ``j % 4`` of it), so that ``KB`` blocks' loads are in flight at once."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kt0 = pid_k * tiles_per_split
    end = tl.minimum(kt0 + tiles_per_split, num_tiles)
    j2 = tl.arange(0, 4 * KB)[None, :]
    return offs_n, kt0, end, j2
