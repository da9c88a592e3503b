"""A Llama decode layer's elementwise steps on the CPU, one C call each
(``csrc/layer_ops_cpu.c``): RMSNorm (Zhang & Sennrich 2019) with float32 statistics,
residual add + RMSNorm, and rotary embedding (Su et al. 2021, rotate-half layout) of q and k in
place followed by the K/V cache write, for float32 or bf16 rows. The C follows torch's float32
and bf16 roundings op by op: the
rotary embedding, the K/V write and the residual sum equal the torch ops bit for bit; the norms
sum their squares in another order than torch, so a rare element lands one or two bf16 steps
from torch's (tests/test_cpu_kernels.py). On a decode step's single row one C call replaces the
several torch ops (and their dispatch overheads) of each step.

Reference twins: ``weight * F.rms_norm(x.float(), ...).to(x.dtype)`` for the norms;
``torch.addcmul(x * cos, rotate_half(x), sin)`` and ``index_copy_`` for ``rope_store``.
"""

from __future__ import annotations

import ctypes

import torch

from . import cpu_build

_i64, _int, _p, _f = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
_SIGNATURES = {
    "lg_rms_norm": [_p, _i64, _p, _p, _int, _int, _f, _int, _int],
    "lg_add_rms_norm": [_p, _p, _p, _p, _p, _int, _int, _f, _int],
    "lg_rope_store": [_p, _i64, _p, _p, _p, _p, _p, _int, _int, _int, _int, _int],
    "lg_decode_qkv": [_p, _p, _f, _int, _int, _p, _p, _p, _p, _p, _p, _p, _p, _int, _int, _int],
    "lg_decode_o_gate_up": [_p, _int, _p, _p, _p, _p, _p, _f, _p, _p],
    "lg_decode_down": [_p, _int, _p, _p, _p, _p],
    "lg_decode_layer_attention": [_p, _p],
    "lg_decode_layer_mlp": [_p, _p],
}


class MatArgs(ctypes.Structure):
    """One GGUF matrix for the decode drivers (``lg_mat`` in the C): ``w`` the address of its
    raw rows, ``n`` rows of ``k`` values, ``w_stride`` bytes from row to row, the kernel's work
    split (``m_tile``, ``n_chunk``, ``threads``: ``gguf_cpu``'s plan for the step's rows) and
    the ggml type id ``qtype``."""

    _fields_ = [("w", _p), ("n", _i64), ("k", _i64), ("w_stride", _i64), ("m_tile", _i64),
                ("n_chunk", _i64), ("qtype", _int), ("threads", _int)]


class LayerArgs(ctypes.Structure):
    """One decode layer for ``layer_calls`` (``lg_layer`` in the C): the addresses of its four
    ``MatArgs`` (qkv, o, gate_up, down) and of its float32 norm weights, the cache halves the
    rotary step writes k and v into (``[slots, num_kv_heads, head_dim]`` each), and the K/V
    views attention reads with their element strides per block, token and head."""

    _fields_ = [("qkv", _p), ("o", _p), ("gate_up", _p), ("down", _p), ("input_norm", _p),
                ("post_norm", _p), ("store_k", _p), ("store_v", _p), ("k", _p), ("v", _p),
                ("blk_stride", _i64), ("tok_stride", _i64), ("head_stride", _i64)]


class StepArgs(ctypes.Structure):
    """One decode step of ``m`` float32 rows for ``layer_calls`` (``lg_step`` in the C): the
    matmul's and the attention kernel's addresses (``gguf_cpu.entry_address``,
    ``paged_decode_cpu.entry_address``), the rotary tables ``[m, d]``, int64 slots, block
    tables (row stride ``bt_stride``) and context lengths, the residual rows ``h``
    ``[m, hidden]`` (updated in place layer by layer), the scratch rows (``h_mid``, ``y``,
    ``attn``, ``gu``, ``act``), the attention's split and thread counts, the norms' eps and the
    attention scale."""

    _fields_ = [("matmul", _p), ("attention", _p), ("cos", _p), ("sin", _p), ("slots", _p),
                ("block_tables", _p), ("context_lens", _p), ("h", _p), ("h_mid", _p), ("y", _p),
                ("attn", _p), ("gu", _p), ("act", _p), ("bt_stride", _i64), ("m", _int),
                ("hidden", _int), ("hq", _int), ("hk", _int), ("d", _int), ("block_size", _int),
                ("splits", _int), ("threads", _int), ("eps", _f), ("scale", _f)]


def _lib():
    return cpu_build.library("layer_ops_cpu", _SIGNATURES)


def available() -> bool:
    """True when the C library could be built and loaded on this machine."""
    return _lib() is not None


def supports_norm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """CPU fp32/bf16 ``x`` ``[rows, n]`` with unit stride along n, ``weight`` ``[n]`` contiguous
    of x's dtype, and the library built."""
    return (x.device.type == "cpu" and x.dtype in cpu_build.DTYPE_CODES and weight.dtype == x.dtype
            and x.dim() == 2 and x.stride(-1) == 1 and weight.is_contiguous()
            and weight.shape == x.shape[-1:] and _lib() is not None)


def supports_rope(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pair: torch.Tensor,
                  slots: torch.Tensor) -> bool:
    """What ``rope_store`` takes: fp32 or bf16 ``y`` rows with unit stride, contiguous tables
    and cache of y's dtype, contiguous int64 slots, and the library built."""
    dt = y.dtype
    return (dt in cpu_build.DTYPE_CODES and cos.dtype == dt and sin.dtype == dt
            and pair.dtype == dt and y.stride(-1) == 1 and cos.is_contiguous() and sin.is_contiguous()
            and pair.is_contiguous() and slots.dtype == torch.int64 and slots.is_contiguous()
            and _lib() is not None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` row by row: x ``[rows, n]``, weight ``[n]`` ->
    ``[rows, n]`` in x's dtype. The caller has checked ``supports_norm``."""
    rows, n = x.shape
    y = torch.empty((rows, n), dtype=x.dtype)
    _lib().lg_rms_norm(x.data_ptr(), x.stride(0), weight.data_ptr(), y.data_ptr(), rows, n, eps,
                       cpu_build.DTYPE_CODES[x.dtype], torch.get_num_threads())
    return y


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h + delta, rms_norm(h + delta) * weight)``; all of one dtype, fp32 or bf16
    (``supports_norm``), h and delta contiguous ``[rows, n]``, weight ``[n]``. The sum is
    written over ``delta``, which is returned."""
    rows, n = h.shape
    y = torch.empty((rows, n), dtype=h.dtype)
    _lib().lg_add_rms_norm(h.data_ptr(), delta.data_ptr(), weight.data_ptr(), delta.data_ptr(),
                           y.data_ptr(), rows, n, eps, cpu_build.DTYPE_CODES[h.dtype])
    return delta, y


def rope_store(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pair: torch.Tensor,
               slots: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    """Rotate the q and k parts of ``y`` ``[rows, (num_heads + 2 num_kv_heads) head_dim]`` (fp32
    or bf16, unit stride along a row) in place by ``cos``, ``sin`` ``[rows, head_dim]`` (y's
    dtype, contiguous; ``supports_rope``), then
    write each row's k and v to flat cache slot ``slots[row]`` (int64) of ``pair``
    ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (contiguous)."""
    half_planes = pair.shape[1] * pair.shape[2] * num_kv_heads * head_dim
    k_ptr = pair.data_ptr()
    _lib().lg_rope_store(y.data_ptr(), y.stride(0), cos.data_ptr(), sin.data_ptr(), k_ptr,
                         k_ptr + pair.element_size() * half_planes, slots.data_ptr(), y.shape[0],
                         num_heads, num_kv_heads, head_dim, cpu_build.DTYPE_CODES[y.dtype])


# ---- float32 decode-layer drivers: norm, GGUF product and elementwise step in one call ------
# ``matmul`` is the address of gguf_cpu's C entry (``gguf_cpu.entry_address``); each MatArgs
# holds a weight's address, so the caller keeps the weight alive across the call.


def decode_qkv(h: torch.Tensor, norm_w: torch.Tensor, eps: float, matmul: int, qkv: MatArgs,
               cos: torch.Tensor, sin: torch.Tensor, pair: torch.Tensor, slots: torch.Tensor,
               num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """``y = rms_norm(h) @ W_qkv.T`` rotated and stored as ``rope_store`` does; returns y
    ``[rows, qkv.n]``. All float32: h ``[rows, hidden]`` contiguous, norm_w ``[hidden]``,
    cos/sin ``[rows, head_dim]`` contiguous, ``pair`` as ``rope_store`` takes it, slots int64.
    Raises ValueError with the kernel's code when it rejects the matrix, MemoryError when the
    normed or quantized activation rows cannot be allocated."""
    rows, hidden = h.shape
    y = torch.empty((rows, qkv.n), dtype=torch.float32)
    half_planes = pair.shape[1] * pair.shape[2] * num_kv_heads * head_dim
    k_ptr = pair.data_ptr()
    _check(_lib().lg_decode_qkv(h.data_ptr(), norm_w.data_ptr(), eps, rows, hidden, matmul,
                                ctypes.byref(qkv), y.data_ptr(), cos.data_ptr(),
                                sin.data_ptr(), k_ptr, k_ptr + 4 * half_planes, slots.data_ptr(),
                                num_heads, num_kv_heads, head_dim), "qkv")
    return y


def decode_o_gate_up(attn: torch.Tensor, matmul: int, o: MatArgs, h: torch.Tensor,
                     post_w: torch.Tensor, eps: float,
                     gate_up: MatArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """``h' = h + attn @ W_o.T`` and ``gu = rms_norm(h') * post_w @ W_gate_up.T``; returns
    ``(h', gu)``. float32, attn ``[rows, o.k]`` and h ``[rows, o.n]`` contiguous. Raises
    ValueError or MemoryError as ``decode_qkv``."""
    rows = attn.shape[0]
    h_out = torch.empty((rows, o.n), dtype=torch.float32)
    gu = torch.empty((rows, gate_up.n), dtype=torch.float32)
    _check(_lib().lg_decode_o_gate_up(attn.data_ptr(), rows, matmul, ctypes.byref(o),
                                      h.data_ptr(), h_out.data_ptr(), post_w.data_ptr(), eps,
                                      ctypes.byref(gate_up), gu.data_ptr()), "o")
    return h_out, gu


def decode_down(act: torch.Tensor, matmul: int, down: MatArgs, h: torch.Tensor) -> torch.Tensor:
    """``h + act @ W_down.T`` (float32, act ``[rows, down.k]`` and h ``[rows, down.n]``
    contiguous). Raises ValueError as ``decode_qkv``."""
    out = torch.empty((act.shape[0], down.n), dtype=torch.float32)
    _check(_lib().lg_decode_down(act.data_ptr(), act.shape[0], matmul, ctypes.byref(down),
                                 h.data_ptr(), out.data_ptr()), "down")
    return out


def layer_calls():
    """``(attention_half, mlp_half)``: the C entries that run one float32 decode layer, each
    called with the addresses of a ``StepArgs`` and a ``LayerArgs`` and returning a code for
    ``check``. ``attention_half`` turns ``h`` into ``h_mid`` (= h + attention) and ``gu`` (the
    gate/up product of its norm); the caller then applies SiLU to gu's gate half in place;
    ``mlp_half`` writes ``h_mid + (SiLU(gate) * up) @ W_down.T`` over ``h``. The operations and
    work splits of ``decode_qkv``, the attention kernel, ``decode_o_gate_up`` and ``decode_down``
    in that order, so the same bits. None where the library is not built."""
    lib = _lib()
    return None if lib is None else (lib.lg_decode_layer_attention, lib.lg_decode_layer_mlp)


def check(rc: int, what: str) -> None:
    """Raise for a nonzero code of a driver or ``layer_calls`` entry: MemoryError (-3, no
    memory for the activation rows), ValueError naming ``what`` otherwise (-4: the attention
    kernel rejected the shapes; else the GGUF kernel's code)."""
    if rc == -4:
        raise ValueError(f"layer_ops_cpu: the attention kernel rejected the {what} step's shapes")
    _check(rc, what)


def _check(rc: int, what: str) -> None:
    if rc == -3:
        raise MemoryError(f"layer_ops_cpu: no memory for the activation rows of the {what} step")
    if rc:
        raise ValueError(f"layer_ops_cpu: the GGUF kernel rejected the {what} matrix (code {rc})")
