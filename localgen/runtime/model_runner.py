"""The model runner: turns a scheduled batch into packed inputs, runs the model, returns the
logits of each sequence's last token.

Prefill packs every sequence's uncached tokens into one ``[num_tokens]`` batch; decode runs one
token per sequence. K/V are written at the slots the block tables give, one block table per KV
group (``localgen.kv.groups``; most models have one): each group's slot mapping and block tables
go into its own ``AttentionMetadata``, which the group's layers read. In a model of several
groups a sliding group's prefill holds only the window of each sequence's last token: the K/V of
the positions behind it go to the group's scratch block and its layers attend over the step's
own k/v (``AttentionMetadata.fresh_prefill``). The attention backend is chosen here, once
(``localgen.attention.select``), and bound to every paged layer view.
"""

from __future__ import annotations

import torch

from localgen.attention.base import AttentionBackend, ScoreObserver, unsupported
from localgen.attention.select import select_backend
from localgen.attention.spec import layer_specs
from localgen.hostmem import keep_freed_host_memory
from localgen.kernels import cpu_build
from localgen.kv.attention import AttentionMetadata, LayerKV
from localgen.kv.block_manager import blocks_behind_window
from localgen.kv.cache import PagedKVCache
from localgen.kv.groups import prefills_hold_windows
from localgen.models.model import CausalLM
from localgen.runtime.sequence import Sequence


def _slots(table: list[int], start: int, end: int, block_size: int, held_from: int = 0,
           scratch: int = 0) -> list[int]:
    """Flat cache slots of positions ``start .. end - 1`` through ``table``; positions before
    ``held_from`` (behind a windowed prefill's window: their entries are the placeholder, which
    no query reads) go to block ``scratch``."""
    return [(table[p // block_size] if p >= held_from else scratch) * block_size + p % block_size
            for p in range(start, end)]


def _padded(tables: list[list[int]]) -> list[list[int]]:
    width = max(map(len, tables))
    return [t + [0] * (width - len(t)) for t in tables]


def layer_windows(cfg) -> list[int | None]:
    """Each layer's sliding window in tokens (None: full attention) of a ``ModelConfig``: what
    partitions its layers into KV groups (``localgen.kv.groups.kv_groups``)."""
    return [spec.sliding_window for spec in layer_specs(cfg)]


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
        groups = getattr(kv_cache, "groups", ())  # the offload runtime's cache: one group
        windowed = prefills_hold_windows(len(groups))
        # each group's window when its prefill holds only that (module docstring), else None
        self.prefill_windows = [g.window if windowed else None for g in groups]
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
        ids, pos, qlens = [], [], []
        for s in seqs:
            start = s.num_computed if is_prefill else s.num_tokens - 1
            ids += s.token_ids[start:]
            pos += range(start, s.num_tokens)
            qlens.append(s.num_tokens - start)
        ctx = [s.num_tokens for s in seqs]
        t = self._tensor
        meta = AttentionMetadata(is_prefill, t(self._group_slots(seqs, 0, qlens, is_prefill)),
                                 t(_padded([s.block_table for s in seqs])), t(ctx), qlens, ctx,
                                 fresh_prefill=is_prefill and self._holds_window(0))
        if seqs[0].group_tables:
            meta.groups = tuple(self._group_meta(seqs, g, meta)
                                for g in range(len(seqs[0].group_tables)))
        return t(ids), t(pos), meta

    def _tensor(self, x) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.long, device=self.device)

    def _holds_window(self, group: int) -> bool:
        return group < len(self.prefill_windows) and self.prefill_windows[group] is not None

    def _group_slots(self, seqs: list[Sequence], group: int, query_lens: list[int],
                     is_prefill: bool) -> list[int]:
        """The step's slot mapping in KV group ``group``'s pool; a windowed prefill's positions
        behind the window go to the pool's scratch block."""
        bs, slots = self.kv.block_size, []
        windowed = is_prefill and self._holds_window(group)
        for s, n in zip(seqs, query_lens):
            table = s.group_tables[group - 1] if group else s.block_table
            if not windowed:
                slots += _slots(table, s.num_tokens - n, s.num_tokens, bs)
                continue
            if n != s.num_tokens:
                raise RuntimeError(f"sequence {s.request_id}: a windowed prefill needs its whole "
                                   f"prompt ({s.num_tokens} tokens), got {n}")
            held = blocks_behind_window(s.num_tokens, self.prefill_windows[group], bs) * bs
            slots += _slots(table, s.num_tokens - n, s.num_tokens, bs, held,
                            self.kv.group_scratch_block(group))
        return slots

    def _group_meta(self, seqs: list[Sequence], g: int, meta: AttentionMetadata) -> AttentionMetadata:
        """KV group g + 1's metadata (``group_tables[g]``): its own slots and block tables,
        ``meta``'s lengths."""
        slots = self._group_slots(seqs, g + 1, meta.query_lens, meta.is_prefill)
        tables = _padded([s.group_tables[g] for s in seqs])
        return AttentionMetadata(meta.is_prefill, self._tensor(slots), self._tensor(tables),
                                 meta.context_lens, meta.query_lens, meta.context_lens_list,
                                 fresh_prefill=meta.is_prefill and self._holds_window(g + 1))

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], is_prefill: bool) -> torch.Tensor:
        """float32 logits ``[len(seqs), vocab_size]`` for the last token of each sequence."""
        ids, pos, meta = self.prepare(seqs, is_prefill)
        hidden = self.model.forward(ids, pos, self.kv.views, meta)
        if not is_prefill:  # one token per sequence: every row is a last token
            return self.model.logits(hidden)
        last = torch.tensor(meta.query_lens, device=self.device).cumsum(0) - 1
        return self.model.logits(hidden[last])
