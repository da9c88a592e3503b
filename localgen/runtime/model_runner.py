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
        """Packed token ids, positions ``[num_tokens]`` and the step's AttentionMetadata (group
        0's, holding the other KV groups' in ``groups``)."""
        bs = self.kv.block_size
        ids, pos, qlens = [], [], []
        starts = [s.num_computed if is_prefill else s.num_tokens - 1 for s in seqs]
        for s, start in zip(seqs, starts):
            ids += s.token_ids[start:]
            pos += range(start, s.num_tokens)
            qlens.append(s.num_tokens - start)
        ctx = [s.num_tokens for s in seqs]
        t = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)  # noqa: E731
        ctx_t = t(ctx)
        metas = []
        for g in range(len(seqs[0].block_tables)):
            tables = [s.block_tables[g] for s in seqs]
            slots = [x for table, s, start in zip(tables, seqs, starts)
                     for x in _slots(table, start, s.num_tokens, bs)]
            metas.append(AttentionMetadata(is_prefill, t(slots), t(_padded(tables)), ctx_t,
                                           qlens, ctx))
        metas[0].groups = tuple(metas[1:])
        return t(ids), t(pos), metas[0]

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], is_prefill: bool) -> torch.Tensor:
        """float32 logits ``[len(seqs), vocab_size]`` for the last token of each sequence."""
        ids, pos, meta = self.prepare(seqs, is_prefill)
        hidden = self.model.forward(ids, pos, self.kv.views, meta)
        if not is_prefill:  # one token per sequence: every row is a last token
            return self.model.logits(hidden)
        last = torch.tensor(meta.query_lens, device=self.device).cumsum(0) - 1
        return self.model.logits(hidden[last])
