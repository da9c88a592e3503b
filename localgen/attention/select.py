"""Which attention backend a runner uses: chosen once, from the device, the KV cache's dtype and
every layer's ``AttentionSpec``.

Rules, in order: CUDA with triton importing -> ``TritonPagedBackend``; CUDA without it ->
``TorchReferenceBackend``; CPU with the C decode kernel built for the cache's dtype ->
``CpuKernelBackend``; other CPU -> ``CpuBackend``; other devices -> the reference. The Triton
and reference backends compute every spec feature (sliding window, logit soft-cap, sinks); the
CPU backends only plain causal attention. When a layer's spec uses a feature the chosen backend
does not compute, ``fallback=True`` takes the reference backend and ``fallback=False`` raises
``UnsupportedAttention`` naming the feature and the device. The offload runtime picks its tiered
backends per layer (``localgen.runtime.offload.tier_backends``).
"""

from __future__ import annotations

import torch

from localgen.attention.base import AttentionBackend, ScoreObserver, unsupported
from localgen.attention.cpu import CpuBackend, CpuKernelBackend, kernel_takes
from localgen.attention.reference import TorchReferenceBackend
from localgen.attention.spec import AttentionSpec
from localgen.attention.triton import TritonPagedBackend, triton_kernels


def device_backend(device: torch.device | str, dtype: torch.dtype,
                   observer: ScoreObserver | None = None) -> AttentionBackend:
    """The fastest backend for plain paged attention on ``device`` over a cache of ``dtype``."""
    kind = torch.device(device).type
    if kind == "cuda":
        return TritonPagedBackend(observer) if triton_kernels() else TorchReferenceBackend(observer)
    if kind == "cpu":
        return CpuKernelBackend(observer) if kernel_takes(dtype) else CpuBackend(observer)
    return TorchReferenceBackend(observer)


def select_backend(device: torch.device | str, dtype: torch.dtype,
                   specs: list[AttentionSpec] = (), observer: ScoreObserver | None = None,
                   fallback: bool = True) -> AttentionBackend:
    """``device_backend``, or the reference where a spec needs it (module docstring). Raises
    ``UnsupportedAttention`` when ``fallback`` is off and the device's backend lacks a feature."""
    backend = device_backend(device, dtype, observer)
    for spec in specs:
        if not backend.supports(spec):
            if not fallback:
                raise unsupported(backend, spec, device)
            return TorchReferenceBackend(observer)
    return backend


_defaults: dict = {}


def default_backend(device: torch.device) -> AttentionBackend:
    """One shared default backend per device type, for KV views no runner bound."""
    kind = torch.device(device).type
    if kind not in _defaults:
        # a bare view's dtype is not known here; the CPU kernel backend checks each call's tensors
        _defaults[kind] = device_backend(device, torch.float32)
    return _defaults[kind]
