"""Device helpers of the GGUF decode kernels (``gguf_gemv``'s float-code gemv, ``gguf_q8``'s
8-bit-activation kernels and, for block fields, ``gguf_mma``'s tensor-core kernel): block fields,
the program's row and slot grid, and the output store. Block layouts: ggml-common.h, as ``gguf.quants`` reads them."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import tickets

# Shape arguments and the split count are not specialized (no recompiling per shape: the
# alignment the loads need comes from the row stride's factor in the kernel, not from the
# argument's value).
GEMV_ARGS = ["N", "num_tiles", "tiles_per_split", "splits"]


@triton.jit
def small_int_float(p):
    """float32 of int32 ``|p| < 2**22``, exactly: added under the exponent of 1.5·2**23, with no
    int-to-float conversion instruction."""
    return (p + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0


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
def finish(out, y_ptr, part_ptr, cnt_ptr, offs_n, N, splits, SPLIT: tl.constexpr):
    """:func:`finish_at` of ``out`` ``[BLOCK_N]``, one activation row: ``y`` and each slice's
    partials ``[N]`` at ``offs_n``."""
    finish_at(out, y_ptr, offs_n, part_ptr, offs_n, N, offs_n < N, cnt_ptr, splits, SPLIT)


@triton.jit
def finish_at(out, y_ptr, y_offs, part_ptr, part_offs, part_size, mask, cnt_ptr, splits,
              SPLIT: tl.constexpr):
    """Store ``out`` (any shape) at ``y_ptr + y_offs`` where ``mask``. With ``SPLIT`` (program
    ``(n, s)`` of ``splits`` K slices): store this slice's partial at ``part_offs`` of slice
    ``s``'s ``part_size`` float32 values in ``part``, take a ticket (``cnt``: a zero counter
    per row tile, ``triton_common.tickets``), and the row tile's last slice sums the partials
    in slice order, read through L2 since other programs wrote them in this launch, stores
    ``y`` and zeros its counter again: a split costs no zero-fill or cast launch
    (``flat_gemm``'s pattern), and its sum is deterministic."""
    if not SPLIT:
        tl.store(y_ptr + y_offs, out.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptr + tl.program_id(1) * part_size + part_offs, out, mask=mask)
        tl.debug_barrier()
        cnt = cnt_ptr + tl.program_id(0)
        if tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == splits - 1:
            total = tl.zeros_like(out)
            for s in range(splits):
                total += tl.load(part_ptr + s * part_size + part_offs, mask=mask, other=0.0,
                                 cache_modifier=".cg")
            tl.store(y_ptr + y_offs, total.to(y_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")  # zero for the next launch


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


# ticket counters asked for at once: enough for every row tile of the matrices decoded, so the
# shared counter buffer grows once, before any CUDA graph captures its address
_MIN_TICKETS = 1 << 15


def split_buffers(y: torch.Tensor, splits: int, n_programs: int):
    """(``part``, ``cnt``) for :func:`finish_at`: float32 partials ``[splits, M·N]`` of ``y``
    ``[M, N]`` (contiguous) and the per-device zero counters, or ``y`` twice (unused) for one
    slice."""
    if splits == 1:
        return y, y
    part = torch.empty(splits, y.numel(), dtype=torch.float32, device=y.device)
    return part, tickets(y.device, max(n_programs, _MIN_TICKETS))
