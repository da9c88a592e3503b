"""Opening a GGUF file, and one sentence naming the file and its fault when it cannot be read.

`gguf.GGUFReader` indexes raw bytes, so a damaged file fails with a bare ValueError or IndexError
somewhere inside it. `open_gguf` walks the header again itself and says what is wrong: not GGUF,
a header cut short, a tensor type id gguf does not know, rows that are not whole blocks of their
type, or tensor data past the end of the file. Format: ggml's docs/gguf.md.
"""

from __future__ import annotations

import math
import mmap
import struct
from pathlib import Path

from localgen.models.config import CorruptModelError, UnsupportedModelError

def open_gguf(path: str | Path):
    """A `gguf.GGUFReader` over `path` (memory-mapped; tensor data is not read).

    Raises OSError as the file opens (FileNotFoundError…), CorruptModelError for a file that is
    not GGUF, a header cut short or tensor data past the end of the file, UnsupportedModelError
    for a GGUF version or tensor type id gguf does not know: each one sentence naming the file
    and what is wrong, in place of the reader's own ValueError/IndexError.
    """
    from localgen.models.gguf_reader import FastGGUFReader

    path = Path(path)
    try:
        return FastGGUFReader(str(path))
    except OSError:
        raise
    except Exception as e:  # the reader indexes raw bytes: bad files fail in many ways
        raise _diagnose(path, e) from e


class _Cut(Exception):
    """The file ended while reading `what`: `n` bytes wanted at `offset`."""

    def __init__(self, what: str, offset: int, n: int):
        super().__init__(what)
        self.what, self.offset, self.n = what, offset, n


class _Walk:
    """A cursor over a GGUF header (ggml docs/gguf.md) that names what it reads."""

    # GGUF metadata value type -> struct format; 8 is a string, 9 an array
    SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
               12: "d"}

    def __init__(self, buf, size: int, order: str):
        self.buf, self.size, self.order, self.pos = buf, size, order, 0

    def take(self, n: int, what: str) -> bytes:
        if self.pos + n > self.size:
            raise _Cut(what, self.pos, n)
        self.pos += n
        return self.buf[self.pos - n:self.pos]

    def num(self, fmt: str, what: str):
        return struct.unpack(self.order + fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        return self.take(self.num("Q", what), what).decode("utf-8", "replace")

    def skip_value(self, vtype: int, what: str) -> None:
        if vtype == 8:
            self.string(what)
        elif vtype == 9:
            itype, n = self.num("I", what), self.num("Q", what)
            if itype in self.SCALARS:
                self.take(n * struct.calcsize(self.SCALARS[itype]), what)
            else:
                for _ in range(n):
                    self.skip_value(itype, what)
        elif vtype in self.SCALARS:
            self.take(struct.calcsize(self.SCALARS[vtype]), what)
        else:
            raise ValueError(f"{what} has value type {vtype}, which is no GGUF type")


def _diagnose(path: Path, err: Exception) -> ValueError:
    """What is wrong with a file GGUFReader failed on, as one error naming it."""
    size = path.stat().st_size
    if size == 0:
        return CorruptModelError(f"{path}: not a GGUF file: it is empty")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            return CorruptModelError(f"{path}: not a GGUF file: it starts with {buf[:8]!r}, "
                                     f"not with b'GGUF'")
        try:
            infos, data_start = _read_header(path, buf, size)
        except _Cut as c:
            return CorruptModelError(
                f"{path}: the file ends inside its header: {c.what} needs {c.n:,} bytes at offset "
                f"{c.offset:,}, the file ends {c.offset + c.n - size:,} bytes short")
        except ValueError as e:
            return e if isinstance(e, UnsupportedModelError) else CorruptModelError(f"{path}: {e}")
    problem = _tensor_problem(path, infos, data_start, size)
    return problem or CorruptModelError(
        f"{path}: not a readable GGUF file ({type(err).__name__}: {err})")


def _read_header(path: Path, buf, size: int) -> tuple[list[tuple[str, int, list[int], int]], int]:
    """(name, type id, dims, offset) of each tensor and where tensor data starts. Raises _Cut,
    ValueError for a value type that is none, UnsupportedModelError for GGUF versions but 2, 3."""
    version = struct.unpack("<I", buf[4:8])[0] if size >= 8 else 0
    order = ">" if version and not version & 0xFFFF else "<"  # a big-endian file (as the reader)
    w = _Walk(buf, size, order)
    w.take(4, "the magic")
    version = w.num("I", "the version")
    if version not in (2, 3):
        raise UnsupportedModelError(f"{path}: GGUF version {version} is not supported; localgen "
                                    f"reads versions 2 and 3")
    n_tensors, n_kv = w.num("Q", "the tensor count"), w.num("Q", "the metadata count")
    alignment = 32
    for i in range(n_kv):
        key = w.string(f"metadata entry {i + 1} of {n_kv}")
        what = f"metadata key {key}"
        vtype = w.num("I", what)
        if key == "general.alignment" and vtype == 4:
            alignment = w.num("I", what) or 32
        else:
            w.skip_value(vtype, what)
    infos = []
    for i in range(n_tensors):
        name = w.string(f"tensor info {i + 1} of {n_tensors}")
        what = f"the info of tensor {name}"
        n_dims = w.num("I", what)
        dims = list(struct.unpack(f"{order}{n_dims}Q", w.take(8 * n_dims, what)))
        infos.append((name, w.num("I", what), dims, w.num("Q", what)))
    return infos, -(-w.pos // alignment) * alignment


def _tensor_problem(path: Path, infos, data_start: int, size: int) -> ValueError | None:
    """An unknown type id, rows not whole blocks, or the first tensor whose data the file lacks."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    short = []
    for name, type_id, dims, offset in infos:
        try:
            qtype = GGMLQuantizationType(type_id)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            return UnsupportedModelError(
                f"{path}: tensor {name} has type id {type_id}, which the installed gguf package "
                f"does not know (a newer GGML type, or a corrupt file)")
        if dims and dims[0] % block:
            return CorruptModelError(f"{path}: tensor {name}: rows of {dims[0]} values are not "
                                     f"whole {qtype.name} blocks of {block}")
        start, nbytes = data_start + offset, math.prod(dims) // block * type_size
        if start + nbytes > size:
            short.append((start, name, nbytes))
    if not short:
        return None
    start, name, nbytes = min(short)
    more = f" ({len(short) - 1} more tensors lie past the end)" if len(short) > 1 else ""
    return CorruptModelError(
        f"{path}: tensor {name} needs {nbytes:,} bytes at offset {start:,}, the file ends "
        f"{start + nbytes - size:,} bytes short{more}; the file is truncated (an interrupted "
        f"download or copy?)")
