"""Split GGUF files (``NAME-00001-of-0000N.gguf``) read as one model.

llama.cpp's ``llama-gguf-split`` (and gguf-py's writer with ``split_max_*``) cut a model into
parts: part 1 holds all metadata and some tensors, every part repeats ``split.no``,
``split.count`` and ``split.tensors.count`` and holds the next tensors. `SplitGGUFReader` opens
each part with gguf's reader (memory-mapped) and presents the union with the interface
`GGUFStore` uses (``fields``, ``tensors``, ``data``), so the weights load as from one file.
"""

from __future__ import annotations

import re
from pathlib import Path

from localgen.models.config import CorruptModelError

_SPLIT_NAME = re.compile(r"^(?P<prefix>.*)-(?P<part>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
_SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")


def split_parts(path: str | Path) -> list[Path] | None:
    """The parts of the split set `path` (any part) names, in order; None if not split-named."""
    path = Path(path)
    m = _SPLIT_NAME.match(path.name)
    if m is None or int(m.group("count")) < 2:
        return None
    count = int(m.group("count"))
    return [path.with_name(f"{m.group('prefix')}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def is_split_gguf(path: str | Path) -> bool:
    return split_parts(path) is not None


class SplitGGUFReader:
    """The parts of one split GGUF as a single reader: part 1's metadata without the ``split.*``
    keys, every part's tensors in order, part 1's memory map as ``data`` (its file name shows
    in messages).

    Raises FileNotFoundError naming a missing part, CorruptModelError when a part's ``split.*``
    keys disagree with its name or the tensor count differs from ``split.tensors.count``.
    """

    def __init__(self, path: str | Path):
        from localgen.models.gguf_open import open_gguf
        from localgen.models.gguf_reader import gguf_field

        parts = split_parts(path)
        if parts is None:
            raise ValueError(f"{path} is not named as a split GGUF part (NAME-00001-of-0000N.gguf)")
        missing = [p.name for p in parts if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"split GGUF {parts[0].name} lacks part(s) {', '.join(missing)} "
                                    f"in {parts[0].parent}")
        readers = [open_gguf(p) for p in parts]
        for i, (p, r) in enumerate(zip(parts, readers)):
            no, count = gguf_field(r, "split.no"), gguf_field(r, "split.count")
            if no is None or int(no) != i or count is None or int(count) != len(parts):
                raise CorruptModelError(f"{p}: split.no = {no}, split.count = {count}, where its "
                                        f"name says part {i + 1} of {len(parts)}")
        self.parts = parts
        self.fields = {k: v for k, v in readers[0].fields.items() if k not in _SPLIT_KEYS}
        self.tensors = [t for r in readers for t in r.tensors]
        self.data = readers[0].data
        want = gguf_field(readers[0], "split.tensors.count")
        if want is not None and int(want) != len(self.tensors):
            raise CorruptModelError(f"{parts[0]}: split.tensors.count = {want}, but the {len(parts)} "
                                    f"parts hold {len(self.tensors)} tensors")


def load_split_gguf(path: str | Path):
    """``(ModelConfig, GGUFStore)`` of the split GGUF whose part `path` names (as `load_gguf`).

    Raises what `SplitGGUFReader` and `GGUFStore` raise."""
    from localgen.models.gguf_source import GGUFStore, store_config

    reader = SplitGGUFReader(path)
    store = GGUFStore(reader.parts[0], reader=reader)
    return store_config(store), store
