"""Fused rotary position embedding (Triton), Hugging Face rotate-half layout, with a pure-torch
reference twin.

``rope_qk(q, k, positions, inv_freq) -> (q_rot, k_rot)`` rotates q ``[n, heads, d]`` and k
``[n, kv_heads, d]`` in ONE launch (one program per token, all its q and k heads):

    ang_j = float32(positions[t]) * inv_freq[j]                 j < d/2   (float32, as rope_cos_sin)
    out[..., j]       = x[..., j] * cos(ang_j) - x[..., j + d/2] * sin(ang_j)
    out[..., j + d/2] = x[..., j + d/2] * cos(ang_j) + x[..., j] * sin(ang_j)

cos/sin are computed in the kernel in float32 (CUDA libdevice ``cosf``/``sinf``, which reduce large
arguments exactly; positions of 10^5+ radians stay accurate) and NOT rounded to the model dtype, so
results are slightly more accurate than the torch path, which rounds cos/sin to bf16/fp16 and
rounds after every op. ``rope_qk_cos_sin(q, k, cos, sin)`` is the same kernel fed precomputed
``[n, d]`` cos/sin tables (``localgen.models.rope.rope_cos_sin``).

Outputs are NEW contiguous tensors by default; pass ``inplace=True`` to write into q and k
(any strides with a unit last dim, e.g. views of a fused qkv projection).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import interpreting

try:  # accurate float32 sin/cos on CUDA (tl.sin/tl.cos may lower to approximate instructions)
    from triton.language.extra import libdevice as _libdevice
except Exception:  # pragma: no cover
    _libdevice = None


def rope_qk_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference twin in the inputs' dtype (pass float64 tensors for a float64 reference; the
    angle is formed in float32 like the kernel, then widened to q's dtype)."""
    ang = positions.float()[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((ang, ang), dim=-1).to(q.dtype)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]

    def rot(x):
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    return rot(q), rot(k)


@triton.jit
def _rotate_heads(x_ptr, o_ptr, t, sx_t, sx_h, so_t, so_h, H, c, s, HALF: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    h = tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_HALF)
    mask = (h < H)[:, None] & (j < HALF)[None, :]
    xo = x_ptr + t * sx_t + h[:, None].to(tl.int64) * sx_h + j[None, :]
    x1 = tl.load(xo, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(xo + HALF, mask=mask, other=0.0).to(tl.float32)
    c2, s2 = c[None, :], s[None, :]
    oo = o_ptr + t * so_t + h[:, None].to(tl.int64) * so_h + j[None, :]
    tl.store(oo, (x1 * c2 - x2 * s2).to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(oo + HALF, (x2 * c2 + x1 * s2).to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, pos_ptr, inv_ptr, cos_ptr, sin_ptr,
                 sq_t, sq_h, sk_t, sk_h, sqo_t, sqo_h, sko_t, sko_h, sc_t, HQ, HK,
                 HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                 BLOCK_HALF: tl.constexpr, FROM_POS: tl.constexpr, LIBDEVICE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    jm = j < HALF
    if FROM_POS:
        pos = tl.load(pos_ptr + t).to(tl.float32)
        ang = pos * tl.load(inv_ptr + j, mask=jm, other=0.0).to(tl.float32)
        if LIBDEVICE:
            c = _libdevice.cos(ang)
            s = _libdevice.sin(ang)
        else:
            c = tl.cos(ang)
            s = tl.sin(ang)
    else:
        c = tl.load(cos_ptr + t * sc_t + j, mask=jm, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + t * sc_t + j, mask=jm, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, qo_ptr, t, sq_t, sq_h, sqo_t, sqo_h, HQ, c, s, HALF, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr, ko_ptr, t, sk_t, sk_h, sko_t, sko_h, HK, c, s, HALF, BLOCK_HK, BLOCK_HALF)


def _check(q, k):
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} / k {tuple(k.shape)}: want [n, heads, d] / [n, kv_heads, d]")
    if q.shape[2] % 2:
        raise ValueError("head_dim must be even")
    if q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError("q and k need a unit stride on head_dim")


def _launch(q, k, pos, inv, cos, sin, inplace, from_pos):
    _check(q, k)
    n, hq, d = q.shape
    hk = k.shape[1]
    qo = q if inplace else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    ko = k if inplace else torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if n == 0:
        return qo, ko
    half = d // 2
    sc_t = 0 if from_pos else cos.stride(0)
    libdev = from_pos and _libdevice is not None and not interpreting() and q.is_cuda
    work = (hq + hk) * d
    num_warps = 1 if work <= 1024 else 2 if work <= 4096 else 4
    _rope_kernel[(n,)](
        q, k, qo, ko, pos, inv, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        qo.stride(0), qo.stride(1), ko.stride(0), ko.stride(1), sc_t, hq, hk, HALF=half,
        BLOCK_HQ=triton.next_power_of_2(hq), BLOCK_HK=triton.next_power_of_2(hk),
        BLOCK_HALF=triton.next_power_of_2(half), FROM_POS=from_pos, LIBDEVICE=libdev,
        num_warps=num_warps)
    return qo, ko


def rope_qk(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
            inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k at int ``positions`` ``[n]`` with float32 ``inv_freq`` ``[d/2]``: one launch."""
    if positions.shape != (q.shape[0],) or inv_freq.shape != (q.shape[-1] // 2,):
        raise ValueError(f"positions {tuple(positions.shape)} / inv_freq {tuple(inv_freq.shape)} "
                         f"do not fit q {tuple(q.shape)}")
    inv = inv_freq.to(device=q.device, dtype=torch.float32).contiguous()
    return _launch(q, k, positions.contiguous(), inv, inv, inv, inplace, True)


def rope_qk_cos_sin(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Same kernel with precomputed ``[n, d]`` cos/sin (rotate-half tables: halves equal)."""
    if cos.shape != (q.shape[0], q.shape[-1]) or sin.shape != cos.shape:
        raise ValueError(f"cos/sin {tuple(cos.shape)} do not fit q {tuple(q.shape)}")
    cos, sin = cos.contiguous(), sin.contiguous()
    return _launch(q, k, cos, cos, cos, sin, inplace, False)
