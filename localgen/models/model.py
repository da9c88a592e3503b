"""CausalLM: a family's layer functions plus the weights they read, run layer by layer.

Weights are read from a WeightStore one layer at a time (so a runtime can place each layer on a
tier); this class keeps them all resident on one device, the plain path.
"""

from __future__ import annotations

import os
import warnings
from types import ModuleType
from typing import Callable, Iterable, Protocol

import torch

from localgen.kv.attention import AttentionMetadata, LayerKV
from localgen.models import dense, llama, opt
from localgen.models.cpu_decode import CpuDecodeLoop
from localgen.models.config import ModelConfig, UnsupportedModelError, supported_list
from localgen.models.rope import RotaryPositions, layer_rope, model_rope, step_rope

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
    """The module whose layer math runs ``cfg``: ``dense`` for a Llama-family config with the
    departures of ``DenseOptions``, else the family's own."""
    if cfg.family == "llama" and not cfg.dense.plain:
        return dense
    try:
        return FAMILIES[cfg.family]
    except KeyError:
        raise UnsupportedModelError(
            f"no layer math for family {cfg.family!r}; localgen runs: {supported_list()}") from None


def read_weights(store: WeightSource, names: dict[str, str], optional: set[str],
                 dtype: torch.dtype, device: torch.device,
                 packed: Iterable[str] = (),
                 row_groups: Callable[[dict[str, str]], Iterable[tuple[str, tuple[str, ...]]]]
                 | None = None) -> dict[str, torch.Tensor]:
    """Load ``short -> hf_name`` tensors; missing optional ones are skipped. Shorts in
    ``packed`` come as the store's ``get_packed`` gives them (a GGUF matrix kept in its blocks)
    where it gives one; all else is expanded to ``dtype`` (the offload runtime reads everything
    this way: it expands GGUF blocks at load). ``row_groups`` maps the shorts the store holds to
    ``(fused, parts)`` pairs (the family's ``packed_row_groups``); parts all packed come as one
    matrix under ``fused`` where the store's ``get_packed_rows`` stacks them as it reads (the
    family's fusing then finds it done).

    Raises KeyError naming the missing tensor.
    """
    have = set(store.names())
    groups = row_groups({k: v for k, v in names.items() if v in have}) if row_groups else ()
    out, stacked = _read_row_groups(store, names, have, set(packed), groups, device)
    for short, name in names.items():
        if short in stacked:
            continue
        if name not in have:
            if short in optional:
                continue
            raise KeyError(f"weight {name!r} missing from the checkpoint")
        w = store.get_packed(name) if short in packed else None
        out[short] = w.to(device) if w is not None else store.get(name).to(device=device, dtype=dtype)
    return out


def _read_row_groups(store, names: dict[str, str], have: set[str], packed: set[str],
                     row_groups, device: torch.device) -> tuple[dict, set[str]]:
    """The row groups ``read_weights`` can take stacked from the store, by fused name, and the
    shorts they hold."""
    out, stacked = {}, set()
    rows_of = getattr(store, "get_packed_rows", None)
    for fused, parts in row_groups if rows_of is not None else ():
        if all(p in names and p in packed and names[p] in have for p in parts):
            w = rows_of([names[p] for p in parts])
            if w is not None:
                out[fused] = w.to(device)
                stacked.update(parts)
    return out, stacked


# "0" expands every GGUF tensor at load (the float path; tests compare the packed path with it)
GGUF_PACKED_ENV = "LOCALGEN_GGUF_PACKED"


def packed_shorts(family, store, device: torch.device) -> frozenset[str]:
    """Short names whose GGUF blocks stay packed: the family's ``PACKABLE`` matrices when the
    store keeps blocks (``get_packed``: a GGUF) and ``LOCALGEN_GGUF_PACKED`` is not ``0`` — on
    a CPU only where the compiled kernel is built (dequantizing every matrix at every step would
    be many times slower than expanding once)."""
    if not hasattr(store, "get_packed") or os.environ.get(GGUF_PACKED_ENV, "1") == "0":
        return frozenset()
    if device.type == "cpu":
        from localgen.quant.gguf_blocks import CPU_KERNEL_ENV, Q, cpu_kernel_serves

        # LOCALGEN_GGUF_CPU_KERNEL=0 asks for the packed reference path on purpose; Q8_0 is
        # read by every build of the kernel, so it tells whether the library is there at all
        if os.environ.get(CPU_KERNEL_ENV, "1") != "0" and not cpu_kernel_serves(Q.Q8_0):
            warnings.warn("the GGUF CPU kernel could not be built (see the log): quantized "
                          "matrices load expanded to float", stacklevel=3)
            return frozenset()
    return frozenset(getattr(family, "PACKABLE", ()))


def warn_expanded(store, names: Iterable[str], dtype: torch.dtype) -> None:
    """One warning naming the quantized tensors among ``names`` that load expanded (a type the
    packed weight does not hold: IQ1–IQ3, TQ, MXFP4…), their types and the bytes the expansion
    adds; nothing when there are none."""
    from localgen.quant.gguf_blocks import PACKED_TYPES

    by_type: dict[str, list[str]] = {}
    for n in names:
        kind = store.stored_type(n)
        if kind not in ("F32", "F16", "BF16") and not store.packs(n):
            by_type.setdefault(kind, []).append(n)
    if not by_type:
        return
    late = [n for ns in by_type.values() for n in ns]
    stored = sum(store.nbytes(n) for n in late)
    expanded = sum(_numel(store.shape(n)) for n in late) * torch.empty(0, dtype=dtype).element_size()
    listed = "; ".join(f"{kind}: {', '.join(ns[:3])}" + (f" and {len(ns) - 3} more" if len(ns) > 3 else "")
                       for kind, ns in by_type.items())
    warnings.warn(f"{getattr(store, 'path', store)}: {len(late)} tensors of GGUF type "
                  f"{', '.join(by_type)} are expanded to {str(dtype).removeprefix('torch.')} at load "
                  f"(localgen keeps {'/'.join(t.name for t in sorted(PACKED_TYPES))} in blocks), "
                  f"{(expanded - stored) / 2**20:.1f} MiB more than their {stored / 2**20:.1f} MiB "
                  f"in the file ({listed})", stacklevel=3)


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _use_cpu_int4(cfg: ModelConfig, store, dtype: torch.dtype, device: torch.device) -> bool:
    """bf16 on the CPU with a GGUF source: run its Q4_1 matrices through the int4 kernel."""
    if device.type != "cpu" or dtype != torch.bfloat16 or family_of(cfg) is not llama:
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
                 device: torch.device, prefill_copies: bool = False):
        """``prefill_copies``: hold each GGUF layer matrix also as a bf16 copy that large-M
        products (prefill) multiply, its blocks serving decode (``cpu_int4.BlocksWithCopy``)."""
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.prefill_copies = prefill_copies
        self.family = family_of(cfg)
        # on the device once: a host-to-device copy per step would break CUDA-graph capture
        rope = model_rope(cfg)
        self.inv_freq = None if rope is None else rope.to(self.device)
        gopt = getattr(self.family, "GLOBAL_OPTIONAL", set())
        gnames = self.family.global_weight_names(cfg)
        self._packed_shorts = packed_shorts(self.family, store, self.device)
        if self._packed_shorts:
            every = [*gnames.values(), *(n for i in range(cfg.num_layers)
                                         for n in self.family.layer_weight_names(cfg, i).values())]
            warn_expanded(store, [n for n in every if n in store], dtype)
        int4 = _use_cpu_int4(cfg, store, dtype, self.device)
        self.global_w = read_weights(store, gnames, gopt, dtype, self.device,
                                     packed=self._packed_shorts)
        if int4:
            self._int4_output(store, gnames)
        self.layers = [self._read_layer(store, i) for i in range(cfg.num_layers)]
        self.cpu_decode = CpuDecodeLoop()

    def _int4_output(self, store: WeightSource, gnames: dict[str, str]) -> None:
        """The output matrix (tied: the embedding) through the int4 kernel at small M:
        the largest single read of a decode step (vocab x hidden), a quarter of bf16's bytes. Its
        large-M matrix is the bf16 expansion of the blocks, made at the first large-M call (a
        batch of more sequences than the kernel takes); a packed embedding stays in its blocks for
        the row lookups. Where the kernel cannot take the matrix, every global loads expanded."""
        from localgen.quant.cpu_int4 import int4_output_weight

        key = "lm_head" if "lm_head" in self.global_w else "embed"
        w = self.global_w[key]
        dense = w if isinstance(w, torch.Tensor) else (lambda: w.dequantize(self.dtype))
        lm = int4_output_weight(store, gnames[key], dense=dense)
        if lm is not None:
            self.global_w["lm_head"] = lm
        else:
            self.global_w = {k: v if isinstance(v, torch.Tensor) else v.dequantize(self.dtype)
                             for k, v in self.global_w.items()}

    def _read_layer(self, store: WeightSource, i: int) -> dict:
        """Layer ``i``'s weights; on the CPU int4 path its Q4_1 matrices are read once, as
        Int4Linear, and not also dequantized."""
        names = self.family.layer_weight_names(self.cfg, i)
        packed = {}
        if _use_cpu_int4(self.cfg, store, self.dtype, self.device):
            from localgen.quant.cpu_int4 import int4_layer_weights, replaced_names

            packed = int4_layer_weights(store, names)
            names = {k: v for k, v in names.items() if k not in replaced_names(packed)}
        w = read_weights(store, names, self.family.OPTIONAL, self.dtype, self.device,
                         packed=self._packed_shorts,
                         row_groups=getattr(self.family, "packed_row_groups", None))
        w = {**fuse_weights(self.family, self.cfg, w), **packed}
        if self.prefill_copies:
            from localgen.quant.cpu_int4 import with_copies

            w = with_copies(w)
        return w

    def weight_bytes(self) -> int:
        """Bytes of weights a forward pass reads (4-bit matrices: codes and scales)."""
        from localgen.quant.cpu_int4 import Int4Linear

        head = self.global_w.get("lm_head", torch.empty(0))
        # with a packed output matrix a decode step reads it, not the dense embedding (a row);
        # a packed embedding is the file's blocks and counts (tied, it is the output matrix),
        # except beside an int4 output matrix, which is its own copy
        row_embed = (isinstance(self.global_w.get("embed"), torch.Tensor)
                     or isinstance(head, Int4Linear))
        tensors = [t for k, t in self.global_w.items()
                   if not (not isinstance(head, torch.Tensor) and row_embed and k == "embed")]
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
        rope = step_rope(self.inv_freq, positions, self.dtype, fused=False)
        if self.family is llama and not meta.is_prefill and h.device.type == "cpu":
            out = self.cpu_decode.run(self.cfg, self.layers, h, rope, kv_caches, meta)
            if out is not None:  # every layer through two C calls (models/cpu_decode.py)
                return out
        for i, (w, kv) in enumerate(zip(self.layers, kv_caches)):
            h = self.family.layer(self.cfg, w, h, layer_rope(rope, i), kv, meta)
        return h

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden_size]`` -> float32 ``[n, vocab_size]``."""
        return self.family.logits(self.cfg, self.global_w, hidden)
