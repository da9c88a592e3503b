"""GGUF files (llama.cpp format) as a `ModelConfig` plus a lazily dequantizing `WeightStore`.

The file is memory-mapped by `gguf.GGUFReader` (`gguf_open.open_gguf`); a tensor is dequantized
only when `get` asks for it. Names are mapped to Hugging Face parameter names (`gguf_names`), and
for archs whose converter permuted Q/K rows (`gguf_config.GGUF_ARCHITECTURES`) that permutation is
undone, so the same layer math runs GGUF and safetensors checkpoints. What the metadata may hold
and what is refused: `gguf_config`; bad files: `gguf_open`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from localgen.models.config import ModelConfig
from localgen.models.gguf_config import GGUF_ARCHITECTURES, gguf_hf_config
from localgen.models.gguf_experts import moe_tensors
from localgen.models.gguf_dense import transformers_reads_arch
from localgen.models.gguf_names import gguf_to_hf_name
from localgen.models.gguf_open import open_gguf
from localgen.models.gguf_reader import gguf_field
from localgen.models.gguf_tensors import (dequantize_tensor, empty_rows, read_tensor_rows,
                                          release_mapped, unpermute_qk_)
from localgen.models.weights import WeightStore
from localgen.quant.gguf_blocks import unpermute_qk


class GGUFStore(WeightStore):
    """Tensors of one GGUF file, by HF name, dequantized on `get` or kept in blocks by `get_packed`.

    `get` returns F32 tensors as float32, F16 as float16, BF16 as bfloat16 and every quantized type
    (Q8_0, Q4_0, Q4_1, K-quants… whatever `gguf.quants` can dequantize) as float32, in HF
    orientation ``[out_features, in_features]``. `get_packed` returns a 2-D tensor stored in one of
    ``gguf_blocks.PACKED_TYPES`` as a ``PackedGGUFWeight`` (the file's bytes, rows unpermuted like
    `get`'s); `packs` says which without reading data. `nbytes` is the stored (quantized) size.
    Raises UnsupportedModelError for GGUF archs other than llama/qwen2.
    """

    def __init__(self, path: str | Path, reader=None):
        self.path = Path(path)
        self.reader = reader if reader is not None else open_gguf(self.path)
        self.arch = str(gguf_field(self.reader, "general.architecture"))
        self.hf_config = gguf_hf_config(self.reader)  # raises UnsupportedModelError first
        self._tensors = {}
        for t in self.reader.tensors:
            hf = gguf_to_hf_name(t.name, self.arch)
            if hf is not None:
                self._tensors[hf] = t
        self._tensors.update(moe_tensors(self.reader, self.hf_config))  # experts: one per slice
        n_head, n_kv = self.hf_config["num_attention_heads"], self.hf_config["num_key_value_heads"]
        self._permute_heads = ({".self_attn.q_proj.": n_head, ".self_attn.k_proj.": n_kv}
                               if GGUF_ARCHITECTURES[self.arch].qk_permuted else {})
        self.dtype = self._dominant_dtype()

    def _dominant_dtype(self) -> torch.dtype:
        from gguf import GGMLQuantizationType as Q

        kinds = [t.tensor_type for t in self._tensors.values() if len(t.shape) > 1]
        if kinds and all(k == Q.F16 for k in kinds):
            return torch.float16
        if kinds and all(k == Q.BF16 for k in kinds):
            return torch.bfloat16
        return torch.float32

    def names(self) -> list[str]:
        return list(self._tensors)

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def tensor(self, name: str):
        """The file's `gguf.ReaderTensor` behind HF name `name` (raw type and data, GGUF dim
        order). KeyError naming the store when there is none."""
        try:
            return self._tensors[name]
        except KeyError:
            raise KeyError(f"no tensor named {name!r} in {self!r}") from None

    def qk_heads(self, name: str) -> int | None:
        """The heads whose rows llama.cpp's converter permuted in `name` (a Q or K projection of
        a `GGUFArch.qk_permuted` arch), else None: `unpermute_qk` takes it."""
        return next((heads for key, heads in self._permute_heads.items() if key in name), None)

    def shape(self, name: str) -> tuple[int, ...]:
        # GGUF lists dims fastest-first (ne0 = columns); HF lists rows first.
        return tuple(int(d) for d in reversed(self.tensor(name).shape.tolist()))

    def nbytes(self, name: str) -> int:
        return int(self.tensor(name).n_bytes)

    def get(self, name: str) -> torch.Tensor:
        t = self.tensor(name)
        return self._unpermuted(name, dequantize_tensor(t).reshape(self.shape(name)))

    def stored_type(self, name: str) -> str:
        """The GGUF type `name` is stored in (``"Q4_K"``, ``"F32"``…)."""
        return self.tensor(name).tensor_type.name

    def packs(self, name: str) -> bool:
        """Whether `get_packed` keeps `name` in blocks (a 2-D tensor of a packed type)."""
        from localgen.quant.gguf_blocks import PACKED_TYPES

        t = self.tensor(name)
        return len(t.shape) == 2 and t.tensor_type in PACKED_TYPES

    def get_packed(self, name: str):
        """`name` as a ``PackedGGUFWeight`` (raw blocks read from the file, CPU) when
        `packs` holds, else None (`get` serves float types as they are and expands the rest).
        llama.cpp's Q/K permutation moves whole rows, so it is undone on the raw rows."""
        from localgen.quant.gguf_blocks import PackedGGUFWeight

        if not self.packs(name):
            return None
        t = self.tensor(name)
        rows, cols = self.shape(name)
        raw = empty_rows(rows, int(t.n_bytes) // rows)
        if not self._read_rows(name, t, raw):
            raw = torch.from_numpy(np.array(t.data, dtype=np.uint8, copy=True)).reshape(rows, -1)
            release_mapped(self.reader, int(t.data_offset), int(t.n_bytes))
            raw = self._unpermuted(name, raw)
        return PackedGGUFWeight(raw, t.tensor_type, (rows, cols))

    def get_packed_rows(self, names: list[str]):
        """The matrices `names` stacked along rows (fused q/k/v, gate/up) as one
        ``PackedGGUFWeight``, each read from the file straight into its rows, so stacking costs
        no copy; Q/K rows land unpermuted. None unless every one is packed, all of one type
        and one in_features, with file-backed data (`get_packed` them one by one then)."""
        from localgen.quant.gguf_blocks import PackedGGUFWeight

        if not all(self.packs(n) for n in names):
            return None
        ts, shapes = [self.tensor(n) for n in names], [self.shape(n) for n in names]
        if len({t.tensor_type for t in ts}) != 1 or len({s[1] for s in shapes}) != 1:
            return None
        raw = empty_rows(sum(s[0] for s in shapes), int(ts[0].n_bytes) // shapes[0][0])
        row = 0
        for name, t, (rows, _) in zip(names, ts, shapes):
            if not self._read_rows(name, t, raw[row:row + rows]):
                return None
            row += rows
        return PackedGGUFWeight(raw, ts[0].tensor_type, (raw.shape[0], shapes[0][1]))

    def _read_rows(self, name: str, t, out: torch.Tensor) -> bool:
        """`name`'s rows read from the file into ``out`` in HF order (llama.cpp's Q/K
        permutation undone in place once they land); False where the tensor has no file
        behind it."""
        if not read_tensor_rows(t, out):
            return False
        heads = self.qk_heads(name)
        if heads is not None:
            unpermute_qk_(out, heads)
        return True

    def _unpermuted(self, name: str, w: torch.Tensor) -> torch.Tensor:
        heads = self.qk_heads(name)
        return w if heads is None else unpermute_qk(w, heads).contiguous()

    def __repr__(self) -> str:
        return f"GGUFStore({str(self.path)!r}, arch={self.arch!r})"


def load_gguf(path: str | Path) -> tuple[ModelConfig, GGUFStore]:
    """Open a GGUF file: its `ModelConfig` (dtype = the dequantized dtype) and lazy weights.

    Raises FileNotFoundError, CorruptModelError (not GGUF, cut short) and UnsupportedModelError
    (archs other than llama/qwen2; keys, tensors and types localgen does not implement), each
    naming the file and what is wrong.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    store = GGUFStore(path)
    return store_config(store), store


def store_config(store: GGUFStore) -> ModelConfig:
    """The `ModelConfig` of an opened store: its HF config, dtype = the dequantized dtype."""
    d = dict(store.hf_config)
    d["torch_dtype"] = str(store.dtype).removeprefix("torch.")
    return ModelConfig.from_hf_dict(d)


def load_gguf_tokenizer(path: str | Path):
    """The tokenizer stored in the GGUF: converted by transformers on the first load (slow for a
    49k vocab), then read from localgen's cache (`localgen.models.tokenizer_cache`)."""
    from localgen.models.tokenizer_cache import cached_gguf_tokenizer

    return cached_gguf_tokenizer(path, lambda: convert_gguf_tokenizer(path))


def convert_gguf_tokenizer(path: str | Path):
    """The tokenizer stored in the GGUF, via transformers' GGUF loader (no cache).

    Sets `chat_template` from the GGUF metadata when transformers did not.
    """
    from transformers import AutoTokenizer

    from localgen.models.gguf_reader import stock_reader_replaced

    path = Path(path)
    arch = str(gguf_field(open_gguf(path), "general.architecture"))
    with stock_reader_replaced(), transformers_reads_arch(arch):  # it parses the metadata again
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if not getattr(tok, "chat_template", None):
        template = gguf_field(open_gguf(path), "tokenizer.chat_template")
        if template:
            tok.chat_template = template
    return tok
