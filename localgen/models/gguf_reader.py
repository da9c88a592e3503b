"""A `gguf.GGUFReader` that reads large metadata arrays in one pass.

`gguf.GGUFReader` builds its fields element by element through memory-map slices: a 49k-entry
vocabulary and its merges become a few hundred thousand `numpy.memmap` views, which takes many
seconds on a small CPU — longer than loading the weights. `FastGGUFReader` builds the same
`ReaderField` objects (same ``parts``, ``data`` indices and ``types``, so ``contents()`` and every
caller see what the stock reader gives) for arrays of scalars and of strings, walking the string
lengths with `struct` and slicing a plain ndarray view of the map. A string array's parts (two
views a string) are built when a caller first reads them: opening the file only walks the lengths,
so a load whose tokenizer comes from the cache never slices the vocabulary. Anything else (nested
arrays, a file in the other byte order) goes through the stock code.
"""

from __future__ import annotations

import contextlib
import struct
import threading
from collections.abc import Collection, Sequence
from typing import Any, Callable, Iterator

import numpy as np
from gguf import GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderField

_U64 = struct.Struct("<Q")


def gguf_field(reader, key: str, default: Any = None) -> Any:
    """The value of metadata key `key` (``contents()`` of its field), or `default` when absent."""
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


class _LazyParts(Sequence):
    """A field's parts: ``head`` as given, then ``count`` parts that ``build()`` makes on the
    first read of any part past the head."""

    def __init__(self, head: list, count: int, build: Callable[[], list], strings_at: int = -1):
        self._head, self._count, self._build = head, count, build
        self._all: list | None = None
        self.strings_at = strings_at  # file offset of the first length-prefixed string

    def _parts(self) -> list:
        if self._all is None:
            self._all = self._head + self._build()
            self._build = None
        return self._all

    def __len__(self) -> int:
        return len(self._head) + self._count

    def __getitem__(self, i):
        if isinstance(i, int) and 0 <= i < len(self._head):
            return self._head[i]
        return self._parts()[i]


class FastGGUFReader(GGUFReader):
    """`GGUFReader` with one-pass parsing of scalar and string arrays (same results).

    Raises what `GGUFReader` raises (ValueError, IndexError… on a damaged file; callers use
    ``localgen.models.gguf_open.open_gguf``, which turns them into one sentence)."""

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list, list[int], list]:
        if GGUFValueType(raw_type) != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        itype, count = GGUFValueType(int(raw_itype[0])), int(alen[0])
        head: list[Any] = [raw_itype, alen]
        offs = orig_offs + 12
        if itype == GGUFValueType.STRING:
            end = self._strings_end(offs, count)
            start = offs
            parts = _LazyParts(head, 2 * count, lambda: self._string_parts(start, count)[0], start)
            data = [len(head) + 2 * i + 1 for i in range(count)]
            return end - orig_offs, parts, data, [GGUFValueType.ARRAY, itype]
        if itype in self.gguf_scalar_to_np:
            parts, end = self._scalar_parts(offs, count, self.gguf_scalar_to_np[itype])
        else:  # arrays of arrays: rare and small
            return super()._get_field_parts(orig_offs, raw_type)
        stride = len(parts) // count if count else 1
        # the stock reader points `data` at each element's last part (a string's bytes)
        data = [len(head) + i * stride + stride - 1 for i in range(count)]
        return end - orig_offs, head + parts, data, [GGUFValueType.ARRAY, itype]

    def _build_fields(self, offs: int, count: int) -> int:
        """The stock walk over the key-value fields, keeping a string array's parts lazy (the
        stock code concatenates every field's parts into one list)."""
        for _ in range(count):
            orig_offs = offs
            klen, kdata = self._get_str(offs)
            offs += int(klen.nbytes + kdata.nbytes)
            raw_type = self._get(offs, np.uint32)
            offs += int(raw_type.nbytes)
            head = [klen, kdata, raw_type]
            size, parts, data, types = self._get_field_parts(offs, raw_type[0])
            if isinstance(parts, _LazyParts):
                parts = _LazyParts(head + parts._head, parts._count, parts._build, parts.strings_at)
            else:
                parts = head + parts
            field = ReaderField(orig_offs, str(bytes(kdata), encoding="utf-8"), parts,
                                [i + len(head) for i in data], types)
            self._push_field(field, skip_sum=True)
            offs += size
        return offs

    def string_indices(self, key: str, wanted: Collection[str]) -> dict[str, int] | None:
        """The index of each string of ``wanted`` in the string array ``key`` (its last
        occurrence, as a dict built over the whole array keeps; strings it lacks are left out),
        found by walking the array's lengths without making its parts. None when ``key`` is not
        a string array this reader keeps lazy (read ``contents()`` instead)."""
        field = self.fields.get(key)
        parts = field.parts if field is not None else None
        if not isinstance(parts, _LazyParts) or parts.strings_at < 0:
            return None
        needles = {w.encode("utf-8"): w for w in wanted}
        lengths = {len(b) for b in needles}
        buf, unpack, offs = memoryview(self._plain()), _U64.unpack_from, parts.strings_at
        found: dict[str, int] = {}
        for i in range(len(field.data)):  # the lengths were checked against the file at open
            (n,) = unpack(buf, offs)
            if n in lengths and (text := needles.get(bytes(buf[offs + 8:offs + 8 + n]))) is not None:
                found[text] = i
            offs += 8 + n
        return found

    def _strings_end(self, offs: int, count: int) -> int:
        """The offset past ``count`` length-prefixed strings from ``offs``, checked against the
        file's size (ValueError for a string that runs past the end)."""
        size, buf, unpack = len(self.data), memoryview(self._plain()), _U64.unpack_from
        for _ in range(count):
            if offs + 8 > size:
                raise ValueError(f"string length at offset {offs} runs past the end of the file")
            offs += 8 + unpack(buf, offs)[0]
            if offs > size:
                raise ValueError(f"a string before offset {offs} runs past the end of the file")
        return offs

    def _plain(self) -> np.ndarray:
        """The map as a plain ndarray: its slices skip `numpy.memmap`'s per-view bookkeeping."""
        plain = getattr(self, "_plain_view", None)
        if plain is None:
            plain = self._plain_view = self.data.view(np.ndarray)
        return plain

    def _scalar_parts(self, offs: int, count: int, nptype) -> tuple[list, int]:
        itemsize = np.dtype(nptype).itemsize
        end = offs + itemsize * count
        if end > len(self.data):
            raise ValueError(f"array of {count} values at offset {offs} runs past the end of the file")
        values = self._plain()[offs:end].view(nptype)
        return list(values.reshape(count, 1)), end

    def _string_parts(self, offs: int, count: int) -> tuple[list, int]:
        plain, size = self._plain(), len(self.data)
        buf = memoryview(plain)
        parts: list[np.ndarray] = []
        for _ in range(count):
            if offs + 8 > size:
                raise ValueError(f"string length at offset {offs} runs past the end of the file")
            (n,) = _U64.unpack_from(buf, offs)
            if offs + 8 + n > size:
                raise ValueError(f"string of {n} bytes at offset {offs} runs past the end of the file")
            parts.append(plain[offs:offs + 8].view(np.uint64))
            parts.append(plain[offs + 8:offs + 8 + n])
            offs += 8 + n
        return parts, offs


_swap_lock = threading.Lock()


@contextlib.contextmanager
def stock_reader_replaced() -> Iterator[None]:
    """Within the block, ``gguf.GGUFReader`` is `FastGGUFReader`: for libraries that import the
    reader from ``gguf`` when they run (transformers' GGUF loader does), so they get the same
    fields sooner. Restored on exit; one block at a time."""
    import gguf

    with _swap_lock:
        stock = gguf.GGUFReader
        gguf.GGUFReader = FastGGUFReader
        try:
            yield
        finally:
            gguf.GGUFReader = stock
