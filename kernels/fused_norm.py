"""Fused residual-add + RMSNorm (Triton), with a pure-torch reference twin.

``add_rms_norm(x, residual, weight, eps) -> (normed, new_residual)``:

    new_residual = x + residual            (x itself when residual is None; rounded to x.dtype)
    normed       = weight * (new_residual.float() * rsqrt(mean(new_residual.float()**2) + eps)).to(x.dtype)

i.e. Hugging Face ``LlamaRMSNorm`` on the residual sum: float32 statistics, cast back to the input
dtype before the weight multiply. One program per row, one launch for the whole ``[num_tokens,
hidden]``; replaces ~8 torch kernels per norm (upcast, pow, mean, add, rsqrt, mul, cast, mul) plus
the residual add. Outputs are new tensors (nothing is written in place) unless ``out`` /
``residual_out`` are given; ``residual_out`` may alias ``residual`` or ``x`` (each element is read
before it is written, by the same program).

All arithmetic is float32 in registers (values are upcast right after their loads, which also
keeps the Triton interpreter, whose bf16 arithmetic is broken, correct).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference twin: exactly the torch ops of ``localgen.models.llama`` (bit-identical there)."""
    h = x if residual is None else residual + x
    hf = h.float()
    hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hf.to(h.dtype), h


@triton.jit
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, o_ptr, nr_ptr, N, stride_x, stride_r, stride_o,
                         stride_nr, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        hs = (h + r).to(nr_ptr.dtype.element_ty)  # the residual stream lives in the model dtype
        tl.store(nr_ptr + row * stride_nr + cols, hs, mask=mask)
        h = hs.to(tl.float32)
    var = tl.sum(h * h, axis=0) / N
    rstd = 1.0 / tl.sqrt(var + eps)
    y = (h * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)  # HF: cast back before the weight
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_ptr + row * stride_o + cols, (w * y).to(o_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    t2 = t.reshape(-1, n)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton fused residual add + RMSNorm over the last dim of ``x`` (any leading shape)."""
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"weight shape {tuple(weight.shape)} != ({n},)")
    x2 = _rows(x, n)
    rows = x2.shape[0]
    if out is None:
        out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    o2 = out.view(-1, n)
    if residual is None:
        r2, nr2, new_res = x2, x2, x
    else:
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        r2 = _rows(residual, n)
        new_res = torch.empty_like(x) if residual_out is None else residual_out
        nr2 = new_res.view(-1, n)
    if rows == 0:
        return out, new_res
    block = triton.next_power_of_2(n)
    num_warps = 4 if block <= 1024 else 8 if block <= 4096 else 16
    _add_rms_norm_kernel[(rows,)](
        x2, r2, weight.contiguous(), o2, nr2, n, x2.stride(0), r2.stride(0), o2.stride(0),
        nr2.stride(0), float(eps), HAS_RES=residual is not None, BLOCK=block, num_warps=num_warps)
    return out, new_res
