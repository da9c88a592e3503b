"""Fused SiLU-and-multiply (Triton), with a pure-torch reference twin.

``silu_mul(gate, up) -> silu(gate) * up`` in one launch, float32 in registers, one rounding to the
output dtype (the torch path rounds twice: after silu and after the multiply). ``gate`` and ``up``
may be the two halves of a fused ``gate_up`` output ``[n, 2*I]`` (``.chunk(2, -1)`` views): any row
stride, unit last-dim stride. ``silu_mul_fused(gate_up)`` takes the fused tensor directly. The
output is a new contiguous ``[n, I]`` tensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, o_ptr, I, stride_g, stride_u, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(o_ptr + row * stride_o + cols, y.to(o_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if gate.shape != up.shape or gate.dim() != 2:
        raise ValueError(f"gate {tuple(gate.shape)} / up {tuple(up.shape)}: want equal [n, I]")
    if gate.stride(1) != 1:
        gate = gate.contiguous()
    if up.stride(1) != 1:
        up = up.contiguous()
    n, inter = gate.shape
    out = torch.empty((n, inter), dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)
    if n == 0 or inter == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _silu_mul_kernel[(n, triton.cdiv(inter, block))](
        gate, up, out, inter, gate.stride(0), up.stride(0), out.stride(0), BLOCK=block,
        num_warps=4)
    return out


def silu_mul_fused(gate_up: torch.Tensor) -> torch.Tensor:
    """``[n, 2*I]`` (gate then up) -> ``[n, I]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return silu_mul(gate, up)
