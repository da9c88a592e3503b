"""Host buffers (pinned when a GPU is the compute device, pageable otherwise or when pinning fails),
and flat byte buffers that hold several tensors.

Pinning can fail or be capped (WSL, small ``ulimit -l``, containers): ``host_empty`` then warns
once and returns pageable memory, so a policy still runs (copies become synchronous and slower).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch

TIERS = ("gpu", "cpu", "disk")
ALIGN = 64  # byte alignment of every tensor inside a flat buffer

_pin_failed = False


# buffers from this size are pinned at their exact size (_pinned_exact); the variable lets a
# self-test send small buffers that way too
EXACT_PIN_MIN = int(os.environ.get("LOCALGEN_EXACT_PIN_MIN", 64 << 20))
_CUDA_HOST_REGISTER_PORTABLE_MAPPED = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped


def _pinned_exact(nbytes: int) -> torch.Tensor | None:
    """``nbytes`` of page-locked memory at exactly that size: an anonymous mapping registered
    with ``cudaHostRegister`` (mapped, so kernels can address it), unregistered when the last
    tensor viewing it is gone. torch's pinned allocator rounds every request up to a power of
    two (a 1.2 GB layer takes 2 GiB, a 48 GB KV pool 64 GiB), which does not fit a host whose
    RAM the policy already fills. None when registration is refused or torch has no cudart."""
    import mmap
    import weakref

    try:
        cudart = torch.cuda.cudart()
        mm = mmap.mmap(-1, nbytes)
        buf = torch.frombuffer(mm, dtype=torch.uint8)
        ptr = buf.data_ptr()
        rc = int(cudart.cudaHostRegister(ptr, nbytes, _CUDA_HOST_REGISTER_PORTABLE_MAPPED))
    except Exception:  # noqa: BLE001  (no cudart binding, no memory: torch's allocator next)
        return None
    if rc != 0:
        return None
    weakref.finalize(mm, cudart.cudaHostUnregister, ptr)  # mm lives as long as any view of buf
    return buf


def host_empty(nbytes: int, pin: bool) -> torch.Tensor:
    """``nbytes`` of uint8 host memory; pinned if ``pin`` and the OS allows it, else pageable
    (with one warning per process). Large buffers are pinned at their exact size."""
    global _pin_failed
    if pin and not _pin_failed:
        buf = _pinned_exact(nbytes) if nbytes >= EXACT_PIN_MIN else None
        if buf is not None:
            return buf
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        except (RuntimeError, MemoryError) as e:  # cudaHostAlloc refused (locked-memory limit, WSL)
            _pin_failed = True
            warnings.warn(f"pinning {nbytes} bytes of host memory failed ({e}); falling back to "
                          "pageable buffers: CPU<->GPU copies will be synchronous and slower",
                          RuntimeWarning, stacklevel=2)
    return torch.empty(nbytes, dtype=torch.uint8)


def pinning_failed() -> bool:
    return _pin_failed


def _reset_pin_state() -> None:  # tests
    global _pin_failed
    _pin_failed = False


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class Entry:
    """One tensor inside a flat byte buffer."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.tensor([], dtype=self.dtype).element_size()


class Layout:
    """Where each named tensor sits in one flat uint8 buffer (64-byte aligned)."""

    def __init__(self, items: list[tuple[str, torch.dtype, tuple[int, ...]]]):
        self.entries: list[Entry] = []
        off = 0
        for key, dtype, shape in items:
            e = Entry(key, dtype, tuple(shape), off)
            self.entries.append(e)
            off = aligned(off + e.nbytes)
        self.nbytes = max(off, ALIGN)

    @classmethod
    def of(cls, tensors: dict[str, torch.Tensor]) -> "Layout":
        return cls([(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()])

    def fill(self, buf: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
        """Copy ``tensors`` into ``buf`` (uint8, >= nbytes) at their offsets."""
        for e in self.entries:
            self.view(buf, e).copy_(tensors[e.key])

    @staticmethod
    def view(buf: torch.Tensor, e: Entry) -> torch.Tensor:
        return buf[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape)

    def views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        return {e.key: self.view(buf, e) for e in self.entries}
