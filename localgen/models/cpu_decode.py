"""A CPU decode step of a float32 Llama-family model whose every layer takes the GGUF decode
drivers (``llama._cpu_decode_driven``), run as two C calls a layer with torch's SiLU between
them (``layer_ops_cpu.layer_calls``).

``llama.layer`` decides per layer and step which path runs, looks up the drivers' arguments,
dispatches attention through the layer's backend and makes each call's tensors; on a decode
step's single row that Python costs as much as the norms, rotary and attention it drives. Here
the decision and the arguments are made once per model and step shape (``LayerArgs``) and
checked each step by identity (the layer's weights, cache and backend), and each step fills one
``StepArgs``. The operations, their order and the kernels' work splits are those of
``llama._cpu_decode_driven`` with the ``CpuKernelBackend``'s decode, so the output is the same
bit for bit (tests/test_cpu_decode_gguf.py).
"""

from __future__ import annotations

import ctypes
import operator
import os
import weakref

import torch

from localgen.attention.cpu import CpuKernelBackend
from localgen.attention.spec import default_spec
from localgen.kernels import layer_ops_cpu as cpu_ops
from localgen.kernels import paged_decode_cpu as attn_kernel
from localgen.kv.attention import AttentionMetadata, LayerKV
from localgen.models import llama
from localgen.models.config import ModelConfig
from localgen.quant import gguf_blocks

# the entries of a layer's weights that its bound arguments address
_ADDRESSED = ("qkv", "q", "k", "v", "o", "gate_up", "down", "input_norm", "post_norm")
_silu_ = torch._C._nn.silu_  # F.silu(x, inplace=True) without its Python wrapper


# step shapes (rows, threads, kernel environment) whose bindings a loop keeps: a served batch
# that grows and shrinks finds its earlier sizes bound
MAX_BINDINGS = 16


class CpuDecodeLoop:
    """A model's decode steps through ``layer_calls`` where every layer takes them. It keeps
    the layers' C arguments from one step to the next, one binding per step shape (rows,
    threads, the GGUF kernel's environment), and binds them again when a layer's weights, cache
    or backend change."""

    def __init__(self):
        self._bound: dict[tuple, _Bound] = {}

    def run(self, cfg: ModelConfig, layers: list[dict], h: torch.Tensor, rope,
            views: list, meta: AttentionMetadata) -> torch.Tensor | None:
        """The rows after every layer, ``[m, hidden]`` float32 (h itself is left as it was),
        for a decode step of float32 rows ``h`` ``[m, hidden]`` with rope tables ``(cos, sin)``
        ``[m, head_dim]``; None where the step or a layer does not take this path (the caller
        then runs the layers one by one). Raises as ``layer_ops_cpu.check`` when a kernel
        rejects its arguments."""
        if not _step_takes(h, rope, meta):
            return None
        key = (h.shape[0], torch.get_num_threads(),
               os.environ.get(gguf_blocks.CPU_KERNEL_ENV, "1"), gguf_blocks.cpu_activations())
        bound = self._bound.get(key)
        if bound is None or not bound.current(layers, views):
            if bound is not None or len(self._bound) >= MAX_BINDINGS:
                self._bound.clear()  # a changed layer outdates every shape's binding
            bound = self._bound[key] = _Bound(layers, views)
            bound.bind(cfg, h, rope, meta)
        return None if bound.layer_ptrs is None else bound.step(h, rope, meta)


def _step_takes(h: torch.Tensor, rope, meta: AttentionMetadata) -> bool:
    """A decode step of contiguous float32 rows with float32 rope tables and int64 slots in
    one KV group, and both C libraries built."""
    if meta.is_prefill or meta.groups or h.dtype != torch.float32 or not h.is_contiguous():
        return False
    if not isinstance(rope, tuple) or len(rope) != 2:
        return False
    slots, (cos, sin) = meta.slot_mapping, rope
    return (slots.dtype == torch.int64 and slots.is_contiguous() and cos.dtype == torch.float32
            and sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
            and cpu_ops.layer_calls() is not None and attn_kernel.entry_address() is not None)


def _snapshot(w: dict, kv) -> tuple:
    """What a bound layer's arguments address: the layer's weights, its view, the view's
    backend and cache (the view and cache weakly: a binding must not keep a replaced cache's
    memory alive)."""
    return (w, _ref(kv), getattr(kv, "backend", None), _ref(getattr(kv, "pair", None)),
            tuple(w.get(k) for k in _ADDRESSED))


def _ref(obj):
    """A weak reference to obj where it takes one, else a function returning obj."""
    try:
        return weakref.ref(obj)
    except TypeError:  # None, or a type without weak references
        return lambda: obj


class _Bound:
    """Every layer's ``LayerArgs`` for steps of one shape (rows, threads, kernel environment),
    or none (``layer_ptrs`` None) where some layer does not take the path."""

    def __init__(self, layers: list[dict], views: list):
        self.snapshots = [_snapshot(w, kv) for w, kv in zip(layers, views)]
        self.layer_ptrs: list[int] | None = None

    def current(self, layers: list[dict], views: list) -> bool:
        """Whether the layers, their views and what the bound arguments address are the same
        objects as at binding, and no score observer has been installed since."""
        if len(layers) != len(self.snapshots) or len(views) != len(self.snapshots):
            return False
        for (w, kv, backend, pair, vals), w1, kv1 in zip(self.snapshots, layers, views):
            if (w1 is not w or kv1 is not kv() or getattr(kv1, "backend", None) is not backend
                    or getattr(kv1, "pair", None) is not pair()
                    or getattr(backend, "observer", None) is not None):
                return False
            if not all(map(operator.is_, map(w.get, _ADDRESSED), vals)):
                return False
        return True

    def bind(self, cfg: ModelConfig, h: torch.Tensor, rope, meta: AttentionMetadata) -> None:
        """Build each layer's ``LayerArgs``; leaves ``layer_ptrs`` None where a layer would not
        take ``llama._cpu_decode_driven`` with the C attention kernel, or the layers differ in
        shape."""
        m, d = h.shape[0], cfg.head_dim
        args, sizes = [], set()
        for w, kv_ref, *_ in self.snapshots:
            kv = kv_ref()
            drivers = _layer_drivers(cfg, w, kv, h, rope, meta)
            if drivers is None:
                return
            mat_args = drivers.args(m)
            sizes.add(tuple((a.n, a.k) for a in mat_args) + (kv.k_cache.shape[1:], drivers.matmul))
            args.append(_layer_args(w, kv, mat_args, cfg.num_kv_heads, d))
        qkv_n = (cfg.num_heads + 2 * cfg.num_kv_heads) * d
        if len(sizes) != 1 or next(iter(sizes))[0][0] != qkv_n or tuple(
                next(iter(sizes))[4][1:]) != (cfg.num_kv_heads, d):
            return
        self.sizes = next(iter(sizes))
        self.layers_args = args  # the structs the pointers address, and the MatArgs they point at
        self.step_args = s = cpu_ops.StepArgs()  # the fields every step shares; a step fills a copy
        s.matmul, s.attention = drivers.matmul, attn_kernel.entry_address()
        s.m, s.hidden, s.hq, s.hk, s.d = m, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, d
        s.block_size, s.eps = kv.k_cache.shape[1], cfg.norm_eps
        s.scale = default_spec(d).scale
        self.calls = cpu_ops.layer_calls()
        self.layer_ptrs = [ctypes.addressof(a[0]) for a in args]

    def step(self, h: torch.Tensor, rope, meta: AttentionMetadata) -> torch.Tensor:
        """One decode step's layers over a copy of ``h``."""
        # a copy a step: two threads stepping one model (two engines) share no arguments
        s = cpu_ops.StepArgs.from_buffer_copy(self.step_args)
        out, gate = self._fill(s, h, rope, meta)
        attention_half, mlp_half = self.calls
        step_ptr = ctypes.addressof(s)
        for layer_ptr in self.layer_ptrs:
            rc = attention_half(step_ptr, layer_ptr)
            if rc:
                cpu_ops.check(rc, "attention")
            _silu_(gate)
            rc = mlp_half(step_ptr, layer_ptr)
            if rc:
                cpu_ops.check(rc, "down")
        return out

    def _fill(self, s, h: torch.Tensor, rope, meta: AttentionMetadata):
        """Set the step's fields of ``s``: the output rows (a copy of h), the scratch rows, the
        rotary tables, slots and the attention launch (the backend's plan for this step).
        Returns the output rows and the gate half of the gate/up rows."""
        m = h.shape[0]
        (qkv_n, _), (o_n, o_k), (gu_n, _), _ = self.sizes[:4]
        launch = meta.plan(attn_kernel.Launch, lambda: attn_kernel.plan(
            meta.block_tables, meta.context_lens, s.hk, max(meta.context_lens_list)))
        out = h.clone()
        sizes = (o_n, qkv_n, o_k, gu_n, gu_n // 2)  # h_mid, y, attn, gu, act
        scratch = torch.empty(m * sum(sizes), dtype=torch.float32)
        ptr = scratch.data_ptr()
        s.h_mid, s.y, s.attn, s.gu, s.act = (ptr + 4 * m * sum(sizes[:i]) for i in range(5))
        gu_at = m * sum(sizes[:3])
        gate = scratch[gu_at:gu_at + m * gu_n].view(m, gu_n)[:, :gu_n // 2]
        cos, sin = rope
        s.h, s.cos, s.sin = out.data_ptr(), cos.data_ptr(), sin.data_ptr()
        s.slots, s.block_tables = meta.slot_mapping.data_ptr(), launch.block_tables.data_ptr()
        s.bt_stride, s.context_lens = launch.block_tables.stride(0), launch.context_lens.data_ptr()
        s.splits, s.threads = launch.splits, launch.threads
        return out, gate


def _layer_drivers(cfg: ModelConfig, w: dict, kv, h: torch.Tensor, rope,
                   meta: AttentionMetadata):
    """The layer's ``GGUFDecodeDrivers`` where ``llama.layer`` would run it through
    ``_cpu_decode_driven`` and attend through the C kernel (``CpuKernelBackend``), else None."""
    mats = llama._cpu_decode_mats(cfg, w, h, kv) if isinstance(kv, LayerKV) else None
    drivers = getattr(mats, "drivers", None)
    if (drivers is None or not llama._drivers_take(w, h, rope, meta)
            or type(kv.bound()) is not CpuKernelBackend):
        return None
    q = torch.empty((h.shape[0], cfg.num_heads, cfg.head_dim))
    return drivers if attn_kernel.supports(q, kv.k_cache, kv.v_cache) else None


def _layer_args(w: dict, kv: LayerKV, mat_args: tuple, kv_heads: int, d: int) -> tuple:
    """``(LayerArgs, mat_args)`` of one layer: the struct and the ``MatArgs`` it points at."""
    pair, k = kv.pair, kv.k_cache
    half_planes = pair.shape[1] * pair.shape[2] * kv_heads * d
    a = cpu_ops.LayerArgs(*(ctypes.addressof(x) for x in mat_args), w["input_norm"].data_ptr(),
                          w["post_norm"].data_ptr(), pair.data_ptr(),
                          pair.data_ptr() + pair.element_size() * half_planes, k.data_ptr(),
                          kv.v_cache.data_ptr(), *k.stride()[:3])
    return a, mat_args
