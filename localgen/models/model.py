"""CausalLM: a family's layer functions plus the weights they read, run layer by layer.

Weights are read from a WeightStore one layer at a time (so a runtime can place each layer on a
tier); this class keeps them all resident on one device, the plain path.
"""

from __future__ import annotations

from types import ModuleType
from typing import Protocol

import torch

from localgen.kv.attention import AttentionMetadata, LayerKV
from localgen.models import llama, opt
from localgen.models.config import ModelConfig, UnsupportedModelError, supported_list
from localgen.models.rope import RotaryPositions, inv_frequencies, rope_cos_sin

FAMILIES: dict[str, ModuleType] = {"llama": llama, "opt": opt}


class WeightSource(Protocol):
    def names(self) -> list[str]:
        """Hugging Face parameter names the source holds."""

    def get(self, name: str) -> torch.Tensor:
        """The tensor ``name`` (CPU, read on demand)."""


def fuse_weights(family, cfg: ModelConfig, w: dict) -> dict:
    """``w`` with the family's matrices fused for its GEMMs (Llama: q/k/v, gate/up; others as
    they are)."""
    fuse = getattr(family, "fuse_weights", None)
    return fuse(cfg, w) if fuse else w


def family_of(cfg: ModelConfig) -> ModuleType:
    try:
        return FAMILIES[cfg.family]
    except KeyError:
        raise UnsupportedModelError(
            f"no layer math for family {cfg.family!r}; localgen runs: {supported_list()}") from None


def read_weights(store: WeightSource, names: dict[str, str], optional: set[str],
                 dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Load ``short -> hf_name`` tensors; missing optional ones are skipped.

    Raises KeyError naming the missing tensor.
    """
    have = set(store.names())
    out = {}
    for short, name in names.items():
        if name not in have:
            if short in optional:
                continue
            raise KeyError(f"weight {name!r} missing from the checkpoint")
        out[short] = store.get(name).to(device=device, dtype=dtype)
    return out


def _use_cpu_int4(cfg: ModelConfig, store, dtype: torch.dtype, device: torch.device) -> bool:
    """bf16 on the CPU with a GGUF source: run its Q4_1 matrices through the int4 kernel."""
    if device.type != "cpu" or dtype != torch.bfloat16 or cfg.family != "llama":
        return False
    if not hasattr(store, "reader"):  # only GGUF stores hold raw Q4_1 blocks
        return False
    from localgen.quant import cpu_int4

    return cpu_int4.available()


class CausalLM:
    """A decoder-only model resident on ``device`` in ``dtype``.

    ``forward`` maps packed ``token_ids``/``positions`` ``[num_tokens]`` to hidden states
    ``[num_tokens, hidden_size]``, writing each layer's new K/V into ``kv_caches[layer]``.
    """

    def __init__(self, cfg: ModelConfig, store: WeightSource, dtype: torch.dtype,
                 device: torch.device):
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.family = family_of(cfg)
        # on the device once: a host-to-device copy per step would break CUDA-graph capture
        self.inv_freq = inv_frequencies(cfg).to(self.device) if cfg.family == "llama" else None
        gopt = getattr(self.family, "GLOBAL_OPTIONAL", set())
        gnames = self.family.global_weight_names(cfg)
        self.global_w = read_weights(store, gnames, gopt, dtype, self.device)
        if _use_cpu_int4(cfg, store, dtype, self.device):
            # the output matrix (tied: the embedding) through the int4 kernel at small M: the
            # largest single read of a decode step (vocab x hidden), a quarter of bf16's bytes
            from localgen.quant.cpu_int4 import int4_output_weight

            key = "lm_head" if "lm_head" in self.global_w else "embed"
            lm = int4_output_weight(store, gnames[key], dense=self.global_w[key])
            if lm is not None:
                self.global_w["lm_head"] = lm
        self.layers = [self._read_layer(store, i) for i in range(cfg.num_layers)]

    def _read_layer(self, store: WeightSource, i: int) -> dict:
        """Layer ``i``'s weights; on the CPU int4 path its Q4_1 matrices are read once, as
        Int4Linear, and not also dequantized."""
        names = self.family.layer_weight_names(self.cfg, i)
        packed = {}
        if _use_cpu_int4(self.cfg, store, self.dtype, self.device):
            from localgen.quant.cpu_int4 import int4_layer_weights, replaced_names

            packed = int4_layer_weights(store, names)
            names = {k: v for k, v in names.items() if k not in replaced_names(packed)}
        w = read_weights(store, names, self.family.OPTIONAL, self.dtype, self.device)
        return {**fuse_weights(self.family, self.cfg, w), **packed}

    def weight_bytes(self) -> int:
        """Bytes of weights a forward pass reads (4-bit matrices: codes and scales)."""
        packed_head = not isinstance(self.global_w.get("lm_head", torch.empty(0)), torch.Tensor)
        # with a packed output matrix a decode step reads it, not the dense embedding (a row)
        tensors = [t for k, t in self.global_w.items() if not (packed_head and k == "embed")]
        tensors += [t for w in self.layers for t in w.values()]
        return sum(t.numel() * t.element_size() if isinstance(t, torch.Tensor) else t.decode_nbytes
                   for t in tensors)

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[LayerKV], meta: AttentionMetadata) -> torch.Tensor:
        h = self.family.embed(self.cfg, self.global_w, token_ids, positions).to(self.dtype)
        if self.family is llama and self.inv_freq is not None and llama.fused_enabled(h):
            # CUDA + triton: the rope kernel forms cos/sin from positions; residual carried
            rope = RotaryPositions(positions, self.inv_freq)
            return llama.forward_layers(self.cfg, self.layers, h, rope, kv_caches, meta)
        rope = rope_cos_sin(self.inv_freq, positions, self.dtype) if self.inv_freq is not None else None
        for w, kv in zip(self.layers, kv_caches):
            h = self.family.layer(self.cfg, w, h, rope, kv, meta)
        return h

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden_size]`` -> float32 ``[n, vocab_size]``."""
        return self.family.logits(self.cfg, self.global_w, hidden)
