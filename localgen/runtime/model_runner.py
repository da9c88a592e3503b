"""The model runner: turns a scheduled batch into packed inputs, runs the model, returns the
logits of each sequence's last token.

Prefill packs every sequence's uncached tokens into one ``[num_tokens]`` batch; decode runs one
token per sequence. K/V are written at the slots the block tables give, one block table per KV
group (``localgen.kv.groups``; most models have one): each group's slot mapping and block tables
go into its own ``AttentionMetadata``, which the group's layers read. The attention backend is
chosen here, once (``localgen.attention.select``), and bound to every paged layer view.
"""

from __future__ import annotations

import torch

from localgen.attention.base import AttentionBackend, ScoreObserver, unsupported
from localgen.attention.select import select_backend
from localgen.attention.spec import layer_specs
from localgen.hostmem import keep_freed_host_memory
from localgen.kernels import cpu_build
from localgen.kv.attention import AttentionMetadata, LayerKV
from localgen.kv.cache import PagedKVCache
from localgen.models.model import CausalLM
from localgen.runtime.sequence import Sequence


def _slots(table: list[int], start: int, end: int, block_size: int) -> list[int]:
    return [table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def _padded(tables: list[list[int]]) -> list[list[int]]:
    width = max(map(len, tables))
    return [t + [0] * (width - len(t)) for t in tables]


def layer_windows(cfg) -> list[int | None]:
    """Each layer's sliding window in tokens (None: full attention) of a ``ModelConfig``: what
    partitions its layers into KV groups (``localgen.kv.groups.kv_groups``)."""
    return [cfg.dense.window(i) for i in range(cfg.num_layers)]


class ModelRunner:
    """Runs ``model`` over ``kv_cache`` (``views``: one KV view per layer).

    ``backend``: the attention backend of the cache's unbound paged views; None chooses it from
    the device, the cache's dtype and the model's layer specs. Raises ``UnsupportedAttention``
    when a layer's view is bound to a backend that does not compute that layer's spec."""

    def __init__(self, model: CausalLM, kv_cache: PagedKVCache,
                 backend: AttentionBackend | None = None):
        self.model, self.kv = model, kv_cache
        self.device = model.device
        specs = layer_specs(model.cfg)
        self.attention = backend or select_backend(self.device, model.dtype, specs)
        for view, spec in zip(kv_cache.views, specs):
            if isinstance(view, LayerKV) and view.backend is None:
                view.backend = self.attention
            used = view.backend if isinstance(view, LayerKV) else view
            if not used.supports(spec):
                raise unsupported(used, spec, self.device)
        if self.device.type == "cpu":
            keep_freed_host_memory()
            cpu_build.build_all()  # the C decode kernels: compiled now, not in the first step

    def observe_scores(self, fn: ScoreObserver | None) -> ScoreObserver | None:
        """Install (None: remove) the score observer of this runner's paged backend, called as
        ``fn(q, kv, meta, scale)`` after each layer's K/V are written; returns the previous one."""
        prev, self.attention.observer = self.attention.observer, fn
        return prev

    def prepare(self, seqs: list[Sequence], is_prefill: bool):
        """Packed token ids, positions ``[num_tokens]`` and the step's AttentionMetadata (KV group
        0's, holding the other groups' in ``groups``)."""
        bs = self.kv.block_size
        ids, pos, slots, qlens = [], [], [], []
        for s in seqs:
            start = s.num_computed if is_prefill else s.num_tokens - 1
            ids += s.token_ids[start:]
            pos += range(start, s.num_tokens)
            slots += _slots(s.block_table, start, s.num_tokens, bs)
            qlens.append(s.num_tokens - start)
        ctx = [s.num_tokens for s in seqs]
        t = self._tensor
        meta = AttentionMetadata(is_prefill, t(slots), t(_padded([s.block_table for s in seqs])),
                                 t(ctx), qlens, ctx)
        if seqs[0].group_tables:
            meta.groups = tuple(self._group_meta(seqs, g, meta)
                                for g in range(len(seqs[0].group_tables)))
        return t(ids), t(pos), meta

    def _tensor(self, x) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.long, device=self.device)

    def _group_meta(self, seqs: list[Sequence], g: int, meta: AttentionMetadata) -> AttentionMetadata:
        """KV group g + 1's metadata (``group_tables[g]``): its own slots and block tables,
        ``meta``'s lengths."""
        bs, slots = self.kv.block_size, []
        for s, n in zip(seqs, meta.query_lens):
            slots += _slots(s.group_tables[g], s.num_tokens - n, s.num_tokens, bs)
        tables = _padded([s.group_tables[g] for s in seqs])
        return AttentionMetadata(meta.is_prefill, self._tensor(slots), self._tensor(tables),
                                 meta.context_lens, meta.query_lens, meta.context_lens_list)

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], is_prefill: bool) -> torch.Tensor:
        """float32 logits ``[len(seqs), vocab_size]`` for the last token of each sequence."""
        ids, pos, meta = self.prepare(seqs, is_prefill)
        hidden = self.model.forward(ids, pos, self.kv.views, meta)
        if not is_prefill:  # one token per sequence: every row is a last token
            return self.model.logits(hidden)
        last = torch.tensor(meta.query_lens, device=self.device).cumsum(0) - 1
        return self.model.logits(hidden[last])
