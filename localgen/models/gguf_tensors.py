"""One GGUF tensor's data as a torch tensor, and the map's pages given back once it is copied.

A tensor here is a `gguf.ReaderTensor` (its ``data`` a view into the reader's memory map). Float
types are copied as they are stored; every quantized type that ``gguf.quants`` dequantizes is
expanded to float32.
"""

from __future__ import annotations

import mmap
from functools import lru_cache

import numpy as np
import torch


POPULATE_MIN_BYTES = 1 << 20  # smaller buffers come from the allocator's pool


def empty_rows(rows: int, width: int) -> torch.Tensor:
    """Uninitialised ``[rows, width]`` uint8 host memory for a tensor's file bytes. From
    ``POPULATE_MIN_BYTES`` up it is an anonymous private map made with ``MAP_POPULATE``, so the
    kernel faults all of its pages in at once instead of one page fault a 4 KiB page inside the
    ``preadv`` that then fills it (the copy into fresh pages is what a load spends its time on);
    the tensor keeps the map alive. Elsewhere (no ``MAP_POPULATE``) a plain ``torch.empty``."""
    n = rows * width
    flags = getattr(mmap, "MAP_POPULATE", None)
    if n < POPULATE_MIN_BYTES or flags is None:
        return torch.empty(rows, width, dtype=torch.uint8)
    mm = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | flags)
    return torch.frombuffer(mm, dtype=torch.uint8).view(rows, width)


def read_tensor_rows(t, out: torch.Tensor, dest_rows: list[int] | None = None) -> bool:
    """Read GGUF tensor ``t``'s rows, in file order, into the rows of ``out`` (``[rows,
    row_bytes]`` uint8, contiguous): file row ``i`` into ``out[dest_rows[i]]``, or all
    of them in order when ``dest_rows`` is None. One ``preadv`` takes many rows, so the kernel
    copies from the page cache straight into place: no page fault a page as copying out of the
    memory map takes, and a row permutation (llama.cpp's Q/K) costs no second copy. False where
    ``t.data`` names no file.

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
    flat, width = memoryview(out.numpy().reshape(-1)), out.shape[-1]
    views = [flat] if dest_rows is None else [flat[r * width:(r + 1) * width] for r in dest_rows]
    fd = os.open(path, os.O_RDONLY)
    try:
        _preadv_all(fd, views, int(t.data_offset), path, t.name, n)
    finally:
        os.close(fd)
    return True


def _preadv_all(fd: int, views: list, offset: int, path, name: str, n: int) -> None:
    """Fill ``views`` in order from ``offset``, at most ``IOV_MAX`` buffers a call (one read
    returns at most about 2 GiB on Linux, so a short read resumes where it stopped)."""
    import os

    from localgen.models.config import CorruptModelError

    most = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
    done, i = 0, 0
    while i < len(views):
        got = os.preadv(fd, views[i:i + most], offset + done)
        if got == 0:
            raise CorruptModelError(f"{path}: tensor {name} ends {n - done} bytes past the end "
                                    f"of the file")
        done += got
        while i < len(views) and got >= len(views[i]):  # skip the buffers filled whole
            got -= len(views[i])
            i += 1
        if got:
            views[i] = views[i][got:]


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
