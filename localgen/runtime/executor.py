"""The model runner: turns a scheduled batch into packed inputs, runs the model, returns the
logits of each sequence's last token.

Prefill packs every sequence's uncached tokens into one ``[num_tokens]`` batch; decode runs one
token per sequence. K/V are written at the slots the block tables give.
"""

from __future__ import annotations

import ctypes
import os
import sys

import torch

from localgen.kv.attention import AttentionMetadata
from localgen.kv.cache import PagedKVCache
from localgen.models.model import CausalLM
from localgen.runtime.sequence import Sequence


def _slots(table: list[int], start: int, end: int, block_size: int) -> list[int]:
    return [table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def _block_tables(seqs: list[Sequence], device) -> torch.Tensor:
    width = max(len(s.block_table) for s in seqs)
    rows = [s.block_table + [0] * (width - len(s.block_table)) for s in seqs]
    return torch.tensor(rows, dtype=torch.long, device=device)


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters (malloc.h)
_heap_kept = False


def keep_freed_host_memory(limit: int = 1 << 30) -> bool:
    """Let glibc's malloc keep freed blocks below ``limit`` bytes for reuse instead of returning
    them to the kernel (``mallopt`` M_MMAP_THRESHOLD and M_TRIM_THRESHOLD). By default every
    allocation above 128 KiB is a fresh ``mmap``, zero-filled page by page on first touch and
    unmapped when freed; a CPU forward allocates such tensors in every layer (a decode step's
    gathered K/V and logits, a prefill's activations), and on the project's 2-core VM first-touch
    writes ran at ~4 GB/s against ~35 GB/s into reused memory. This is what the jemalloc /
    tcmalloc advice for PyTorch on CPUs achieves, without preloading another allocator. The
    process keeps its peak heap (the memory stays mapped, not in use). Once per process; glibc
    only; ``LOCALGEN_MALLOPT=0`` turns it off. Returns whether it was applied."""
    global _heap_kept
    off = os.environ.get("LOCALGEN_MALLOPT", "1") == "0"
    if _heap_kept or off or not sys.platform.startswith("linux"):
        return _heap_kept
    try:
        libc = ctypes.CDLL("libc.so.6")
        _heap_kept = bool(libc.mallopt(_M_MMAP_THRESHOLD, limit)) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, limit))
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        _heap_kept = False
    return _heap_kept


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: PagedKVCache):
        self.model, self.kv = model, kv_cache
        self.device = model.device
        if self.device.type == "cpu":
            keep_freed_host_memory()

    def prepare(self, seqs: list[Sequence], is_prefill: bool):
        """Packed token ids, positions ``[num_tokens]`` and the step's AttentionMetadata."""
        bs = self.kv.block_size
        ids, pos, slots, qlens = [], [], [], []
        for s in seqs:
            start = s.num_computed if is_prefill else s.num_tokens - 1
            ids += s.token_ids[start:]
            pos += range(start, s.num_tokens)
            slots += _slots(s.block_table, start, s.num_tokens, bs)
            qlens.append(s.num_tokens - start)
        ctx = [s.num_tokens for s in seqs]
        t = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)  # noqa: E731
        meta = AttentionMetadata(is_prefill, t(slots), _block_tables(seqs, self.device), t(ctx),
                                 qlens, ctx)
        return t(ids), t(pos), meta

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], is_prefill: bool) -> torch.Tensor:
        """float32 logits ``[len(seqs), vocab_size]`` for the last token of each sequence."""
        ids, pos, meta = self.prepare(seqs, is_prefill)
        hidden = self.model.forward(ids, pos, self.kv.views, meta)
        if not is_prefill:  # one token per sequence: every row is a last token
            return self.model.logits(hidden)
        last = torch.tensor(meta.query_lens, device=self.device).cumsum(0) - 1
        return self.model.logits(hidden[last])
