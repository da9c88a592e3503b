"""Lazily read model weights, always addressed by Hugging Face parameter names.

A `WeightStore` hides where weights come from (one or many safetensors files, a GGUF file) so the
policy can ask for sizes without reading data, and the runtime can read one tensor at a time
(FlexGen §4.2: weights stream layer by layer from CPU or disk, so nothing here loads everything).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Iterator

import torch


class WeightStore:
    """Read-only map from HF parameter name to a CPU tensor, read on demand.

    Subclasses implement `names`, `get`, `shape`, `nbytes` and set `dtype`.
    """

    dtype: torch.dtype = torch.float32  # dtype `get` returns (the checkpoint's float dtype)

    def names(self) -> list[str]:
        """All tensor names (HF parameter names, e.g. ``model.layers.0.self_attn.q_proj.weight``)."""
        raise NotImplementedError

    def get(self, name: str) -> torch.Tensor:
        """The tensor `name` as a CPU tensor of `dtype`. Raises KeyError if absent."""
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        """Logical shape (HF orientation, e.g. ``[out_features, in_features]``) without reading data."""
        raise NotImplementedError

    def nbytes(self, name: str) -> int:
        """Bytes `name` occupies as stored (quantized size for GGUF blocks)."""
        raise NotImplementedError

    # Conveniences shared by all stores.
    def __contains__(self, name: object) -> bool:
        return name in set(self.names())

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def total_nbytes(self) -> int:
        """Bytes of all tensors as stored."""
        return sum(self.nbytes(n) for n in self.names())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor read into memory (tests and small models only)."""
        return {n: self.get(n) for n in self.names()}

    def close(self) -> None:
        """Release file handles (optional)."""


def _missing(name: str, store: WeightStore) -> KeyError:
    return KeyError(f"no tensor named {name!r} in {store!r}")


# OPT checkpoints differ in their root: OPTForCausalLM saves "model.decoder.*", some older files
# (and OPTModel) save "decoder.*". We always expose what OPTForCausalLM.state_dict() uses.
def normalize_hf_name(name: str) -> str:
    """Map a stored parameter name to the `*ForCausalLM.state_dict()` name."""
    if name.startswith("decoder."):
        return "model." + name
    return name


class SafetensorsStore(WeightStore):
    """Weights from one or several (sharded) ``*.safetensors`` files, memory-mapped by safetensors.

    `path` is a model directory or a single ``.safetensors`` file. Shards are listed by
    ``model.safetensors.index.json`` when present, else found by globbing ``*.safetensors``.
    Raises FileNotFoundError if no safetensors file is found.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        files = _safetensors_files(self.path)
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {self.path}")
        self._files = files
        self._handles: dict[Path, object] = {}
        self._where: dict[str, tuple[Path, str]] = {}  # our name -> (file, stored name)
        dtypes: set[torch.dtype] = set()
        for f in files:
            h = self._open(f)
            for stored in h.keys():
                self._where[normalize_hf_name(stored)] = (f, stored)
                dtypes.add(_st_dtype(h.get_slice(stored).get_dtype()))
        float_dtypes = [d for d in dtypes if d.is_floating_point]
        # Most checkpoints hold a single float dtype; mixed ones report the widest.
        self.dtype = max(float_dtypes, key=lambda d: torch.finfo(d).bits) if float_dtypes else torch.float32

    def _open(self, f: Path):
        from safetensors import safe_open

        h = self._handles.get(f)
        if h is None:
            h = self._handles[f] = safe_open(str(f), framework="pt", device="cpu")
        return h

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def _slice(self, name: str):
        try:
            f, stored = self._where[name]
        except KeyError:
            raise _missing(name, self) from None
        return self._open(f).get_slice(stored)

    def get(self, name: str) -> torch.Tensor:
        try:
            f, stored = self._where[name]
        except KeyError:
            raise _missing(name, self) from None
        return self._open(f).get_tensor(stored)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def nbytes(self, name: str) -> int:
        sl = self._slice(name)
        n = 1
        for s in sl.get_shape():
            n *= s
        return n * _st_dtype(sl.get_dtype()).itemsize

    def close(self) -> None:
        self._handles.clear()

    def __repr__(self) -> str:
        return f"SafetensorsStore({str(self.path)!r}, {len(self._files)} file(s))"


def _safetensors_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    return sorted(path.glob("*.safetensors"))


_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _st_dtype(name: str) -> torch.dtype:
    try:
        return _ST_DTYPES[name]
    except KeyError:  # e.g. F8 types: only their size matters here
        return getattr(torch, {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}.get(name, "uint8"))


def dir_has_weights(path: Path) -> bool:
    """True if `path` holds safetensors weights (single or sharded)."""
    return bool(_safetensors_files(Path(path)))


def iter_names_by_layer(store: WeightStore, num_layers: int) -> Iterable[list[str]]:
    """Names grouped per decoder layer ``i`` (``*.layers.{i}.*``), in layer order."""
    for i in range(num_layers):
        key = f".layers.{i}."
        yield [n for n in store.names() if key in n]
