"""One GGUF tensor's data as a torch tensor: the host buffer a tensor's blocks are read into
(its pages faulted in first), the read itself, llama.cpp's Q/K row permutation undone in place,
and the map's pages given back once a tensor is copied out of it.

A tensor here is a `gguf.ReaderTensor` (its ``data`` a view into the reader's memory map). Float
types are copied as they are stored; every quantized type that ``gguf.quants`` dequantizes is
expanded to float32.
"""

from __future__ import annotations

import mmap
import threading
from functools import lru_cache

import numpy as np
import torch

from localgen.quant.gguf_blocks import unpermuted_heads


POPULATE_MIN_BYTES = 1 << 20  # smaller buffers come from the allocator's pool
POPULATE_CHUNK_BYTES = 16 << 20  # the least one thread faults in (thread start-up stays small)
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14 (madvise(2))
HUGE_PAGE_BYTES = 2 << 20  # x86-64's and arm64's (4 KiB granule) transparent huge page
HUGE_PAGES_ENV = "LOCALGEN_HUGE_PAGES"  # "1": weight buffers ask for transparent huge pages


def empty_rows(rows: int, width: int) -> torch.Tensor:
    """Uninitialised ``[rows, width]`` uint8 host memory for a tensor's file bytes. From
    ``POPULATE_MIN_BYTES`` up it is an anonymous private map whose pages are faulted in before
    the ``preadv`` that fills it, split across the machine's cores (``populate``): first-touch
    faults, not the copy, are what a load spends its time on, and one thread faulting a page at
    a time inside the copy leaves the other cores idle. The tensor keeps the map alive.
    Elsewhere (no anonymous maps) a plain ``torch.empty``.

    With ``LOCALGEN_HUGE_PAGES=1`` a buffer of at least ``HUGE_PAGE_BYTES`` starts on a
    huge-page boundary and asks for transparent huge pages (``madvise(MADV_HUGEPAGE)``, the
    kernel's admin-guide/mm/transhuge): a decode step streams every weight once, and with 4 KiB
    pages each page costs a TLB miss and stops the hardware prefetcher at its edge. Only whole
    2 MiB spans inside the buffer become huge pages, so it holds no memory beyond its bytes; the
    alignment slack in front is never touched. It is off by default: where the kernel hands
    freed 2 MiB blocks back to a hypervisor (free page reporting), every huge page is a fresh
    host allocation and faulting them in costs more load time than the decode gains."""
    n = rows * width
    if n < POPULATE_MIN_BYTES or not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.empty(rows, width, dtype=torch.uint8)
    huge = _huge_pages_wanted(n)
    slack = HUGE_PAGE_BYTES - mmap.PAGESIZE if huge else 0
    mm = mmap.mmap(-1, n + slack, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = _huge_aligned_start(mm, n) if huge else 0
    if not populate(mm, n, start) and hasattr(mmap, "MAP_POPULATE"):  # a kernel before 5.14
        mm = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
        start = 0
    return torch.frombuffer(mm, dtype=torch.uint8, offset=start, count=n).view(rows, width)


def _huge_pages_wanted(n: int) -> bool:
    """Whether a buffer of n bytes asks for transparent huge pages: one fits in it, the platform
    has the advice and ``LOCALGEN_HUGE_PAGES`` is 1."""
    import os

    return (n >= HUGE_PAGE_BYTES and hasattr(mmap, "MADV_HUGEPAGE")
            and os.environ.get(HUGE_PAGES_ENV, "0") == "1")


def _huge_aligned_start(mm: mmap.mmap, n: int) -> int:
    """The offset in ``mm`` of its first huge-page boundary, the n bytes from there advised
    ``MADV_HUGEPAGE`` (a kernel without transparent huge pages refuses the advice: the bytes
    then stay in base pages)."""
    import ctypes

    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    start = -base % HUGE_PAGE_BYTES
    try:
        mm.madvise(mmap.MADV_HUGEPAGE, start, n)
    except OSError:
        pass
    return start


def populate(mm: mmap.mmap, n: int, start: int = 0) -> bool:
    """Fault in the ``n`` bytes of writable map ``mm`` from offset ``start`` (page-aligned) with
    ``madvise(MADV_POPULATE_WRITE)`` in page-aligned chunks of at least ``POPULATE_CHUNK_BYTES``,
    one thread a core (ctypes drops the GIL for the call). False, with nothing done, where the
    kernel or libc lacks the advice."""
    libc = _libc_madvise()
    if libc is None:
        return False
    import ctypes
    import os

    base = ctypes.addressof(ctypes.c_char.from_buffer(mm)) + start
    page = mmap.PAGESIZE
    parts = max(1, min(os.cpu_count() or 1, n // POPULATE_CHUNK_BYTES))
    step = -(-n // parts // page) * page
    spans = [(base + lo, min(step, n - lo)) for lo in range(0, n, step)]
    errs: list[int] = []

    def advise(addr: int, length: int) -> None:
        if libc(addr, length, MADV_POPULATE_WRITE) != 0:
            errs.append(ctypes.get_errno())

    helpers = [threading.Thread(target=advise, args=span) for span in spans[1:]]
    for t in helpers:
        t.start()
    advise(*spans[0])
    for t in helpers:
        t.join()
    return not errs  # EINVAL: no such advice here (the pages a failed call touched stay usable)


@lru_cache(maxsize=1)
def _libc_madvise():
    """libc's ``madvise`` through ctypes (it releases the GIL), or None off Linux."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def read_tensor_rows(t, out: torch.Tensor) -> bool:
    """Read GGUF tensor ``t``'s rows, in file order, into ``out`` (``[rows, row_bytes]`` uint8,
    contiguous) with ``preadv``: the kernel copies from the page cache straight into place, with
    none of the page faults that copying out of the memory map takes. False where ``t.data``
    names no file.

    Raises ValueError when ``out`` does not hold ``t.n_bytes`` bytes in whole rows,
    CorruptModelError naming the file, the tensor and the missing bytes when the file ends
    before the tensor does."""
    import os

    path = getattr(t.data, "filename", None)
    if path is None:
        return False
    n = int(t.n_bytes)
    if out.dtype != torch.uint8 or out.numel() != n or out.dim() != 2 or not out.is_contiguous():
        raise ValueError(f"tensor {t.name}: out must be {n} contiguous uint8 bytes in rows")
    fd = os.open(path, os.O_RDONLY)
    try:
        _preadv_all(fd, memoryview(out.numpy().reshape(-1)), int(t.data_offset), path, t.name)
    finally:
        os.close(fd)
    return True


def _preadv_all(fd: int, view: memoryview, offset: int, path, name: str) -> None:
    """Fill ``view`` from ``offset`` (one read returns at most about 2 GiB on Linux, so a short
    read resumes where it stopped)."""
    import os

    from localgen.models.config import CorruptModelError

    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise CorruptModelError(f"{path}: tensor {name} ends {len(view) - done} bytes past "
                                    f"the end of the file")
        done += got


UNPERMUTE_CHUNK_BYTES = 1 << 20  # a chunk's copy stays in cache; a big one costs fresh pages
_scratch_local = threading.local()


def _scratch(nbytes: int) -> torch.Tensor:
    """This thread's reusable uint8 scratch of at least ``nbytes`` (8-byte aligned), kept
    between calls: a fresh buffer a tensor would fault its pages in every time."""
    buf = getattr(_scratch_local, "buf", None)
    if buf is None or buf.numel() < nbytes:
        buf = _scratch_local.buf = torch.empty(-(-nbytes // 8), dtype=torch.int64)
    return buf.view(torch.uint8)[:nbytes]


def unpermute_qk_(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """``gguf_blocks.unpermute_qk`` (llama.cpp's Q/K row permutation undone) in place on
    contiguous ``w`` (``[rows, ...]``), a few heads at a time through one scratch copy of at most
    about ``UNPERMUTE_CHUNK_BYTES``, so it needs no second buffer of the tensor's size.
    Returns ``w``."""
    rows = w.shape[0]
    per_head = rows // n_head
    flat = w.view(rows, -1)
    if (flat.shape[1] * w.element_size()) % 8 == 0:  # whole rows move: copy them 8 bytes a step
        flat = flat.view(torch.uint8).view(torch.int64)
    step = max(1, UNPERMUTE_CHUNK_BYTES // max(1, per_head * flat[0].nbytes))
    scratch = _scratch(min(step, n_head) * per_head * flat[0].nbytes).view(flat.dtype)
    scratch = scratch.view(-1, flat.shape[1])
    for h in range(0, n_head, step):
        part = flat[h * per_head:min(n_head, h + step) * per_head]
        tmp = scratch[:part.shape[0]].copy_(part)
        g = part.shape[0] // per_head
        part.view(g, 2, per_head // 2, -1).copy_(unpermuted_heads(tmp, g))
    return w


def release_mapped(reader, offset: int, nbytes: int) -> None:
    """Drop this process's mapping of a tensor's bytes once they are copied out (madvise
    DONTNEED on the read-only file map: the pages stay in the page cache, and a later read faults
    them back in), so loading holds the copies and not the mapped file besides them. A reader
    without a plain memory map (a split set) is left as it is."""
    mm = getattr(getattr(reader, "data", None), "_mmap", None)
    if mm is None or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = offset // mmap.PAGESIZE * mmap.PAGESIZE
    try:
        mm.madvise(mmap.MADV_DONTNEED, start, offset + nbytes - start)
    except (OSError, ValueError):  # a map that refuses advice keeps its pages: only memory
        pass


def dequantize_tensor(t) -> torch.Tensor:
    """One GGUF tensor as a CPU torch tensor (copied out of the memory map)."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize

    if t.tensor_type == Q.F32:
        return torch.from_numpy(np.array(t.data, dtype=np.float32))
    if t.tensor_type == Q.F16:
        return torch.from_numpy(np.array(t.data, dtype=np.float16))
    if t.tensor_type == Q.BF16:
        # Keep bf16 bit-exact instead of widening: reinterpret the raw 16-bit words.
        raw = np.array(t.data).view(np.int16)
        return torch.from_numpy(raw).view(torch.bfloat16)
    return torch.from_numpy(np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32))


@lru_cache(maxsize=None)
def loadable(qtype) -> bool:
    """Whether `dequantize_tensor` reads `qtype`: the float types, and each type `gguf.quants`
    dequantizes (probed on one zero block)."""
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize

    if qtype in (Q.F32, Q.F16, Q.BF16):
        return True
    try:
        dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True
