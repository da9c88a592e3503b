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


def read_tensor_bytes(t, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """The raw bytes of GGUF tensor ``t`` as a ``[t.n_bytes]`` uint8 tensor (``out``, a
    contiguous uint8 tensor of that many elements, when given; else a fresh one), read from its
    file with ``preadv`` at ``t.data_offset``: the kernel copies from the page cache straight into
    the buffer, where copying out of the memory map takes a page fault per page first. None where
    ``t.data`` names no file (the caller copies from the map).

    Raises CorruptModelError naming the file, the tensor and the missing bytes when the file
    ends before the tensor does."""
    import os

    from localgen.models.config import CorruptModelError

    path = getattr(t.data, "filename", None)
    if path is None:
        return None
    n, offset = int(t.n_bytes), int(t.data_offset)
    buf = torch.empty(n, dtype=torch.uint8) if out is None else out
    if buf.numel() != n or buf.dtype != torch.uint8 or not buf.is_contiguous():
        raise ValueError(f"tensor {t.name}: out must be {n} contiguous uint8 bytes")
    view = memoryview(buf.numpy())
    fd = os.open(path, os.O_RDONLY)
    try:
        got = 0
        while got < n:  # one read returns at most about 2 GiB on Linux
            k = os.preadv(fd, [view[got:]], offset + got)
            if k == 0:
                raise CorruptModelError(f"{path}: tensor {t.name} ends {n - got} bytes past the "
                                        f"end of the file")
            got += k
    finally:
        os.close(fd)
    return buf


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
