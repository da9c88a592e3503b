"""Whole-prompt prefill zig-zag blocks of an all-GPU 4-bit offload policy, replayed as CUDA graphs.

The eager prefill of one zig-zag block (FlexGen §4.1: ``bls`` sequences) launches every kernel
from Python: thousands of launches and a layer call per GPU batch and layer, host work of the
same order as the GPU work, so a busy host becomes the bound. A replayed graph costs the GPU time
alone.

A zig-zag block shape (sequences, prompt length) is captured at its second sighting, for zig-zag
blocks whose prompts all have that length and nothing cached (a chat's prompts rarely repeat a
length; a batch of fixed-length prompts does at once); the capture's eager warm-up serves that
zig-zag block. The host
settles what the eager layers decide on the fly before each replay: the recent-block pool rows
(``RecentIndex.assign``, in the order the eager schedule asks), the pool slots of the tokens each
sequence keeps in fp (``tier_plan.kept_tokens``; a sequence without a row writes the scratch row) and
the cache slots; they reach the GPU in one copy from pinned memory. The prefill graphs share a
memory pool of their own (not the decode graphs'), which holds a prefill's working memory for
as long as they live: before any zig-zag block runs eagerly, the runner drops them
(``release``), since under a tight memory cap the eager zig-zag block may not fit beside the
hundreds of MiB they hold.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch

from localgen.kv.attention import AttentionMetadata, pool_slot
from localgen.runtime.cuda_graphs import EagerGraph, record_graph
from localgen.runtime.offload.tier_plan import StaticPrefill, kept_tokens, recent_mask
from localgen.runtime.sequence import Sequence

MAX_GRAPHS = 4  # zig-zag block shapes captured at once, at most
SIGHTINGS = 2  # a zig-zag block shape is captured when it is seen for this many times


class _PrefillGraph:
    """The static buffers, per-batch metadata and graph of one zig-zag block shape: ``n`` prompts of
    ``length`` tokens in GPU batches of ``gbs``.

    One flat int64 device buffer holds the inputs that change between replays, each a view:
    token ids and cache slots ``[n * length]``, the pool slots kept ``[n * keep]`` and the KV
    block tables ``[n, width]``; ``staging`` is its pinned host twin."""

    def __init__(self, owner: "PrefillGraphs", n: int, length: int, gbs: int):
        self.owner, self.runner, self.n, self.length = owner, owner.runner, n, length
        runner, capture = owner.runner, owner.capture
        kv, dev = runner.kv, runner.device
        bs = self.bs = kv.block_size
        self.width = -(-length // bs)
        self.keep = length - bs * ((length - 1) // bs)  # tokens of the last KV block, pooled in fp
        total = n * (2 * length + self.keep + self.width)
        self.inputs = torch.zeros(total, dtype=torch.long, device=dev)
        self.staging_t = torch.zeros(total, dtype=torch.long, pin_memory=capture and dev.type == "cuda")
        self.staging = self.staging_t.numpy()
        self.copied: torch.cuda.Event | None = None  # the last staging -> device copy
        nl = n * length
        self.ids, self.slots = self.inputs[:nl], self.inputs[nl:2 * nl]
        self.keep_slots = self.inputs[2 * nl:2 * nl + n * self.keep]
        self.tables = self.inputs[2 * nl + n * self.keep:].view(n, self.width)
        self.batches = [(a, min(a + gbs, n)) for a in range(0, n, gbs)]
        mask = recent_mask(0, length, bs, dev) if kv.recent is not None else None
        self.steps, self.lasts = [], []
        for a, e in self.batches:
            self.steps.append(self._step(a, e, mask))
            self.lasts.append(torch.arange(1, e - a + 1, device=dev) * length - 1)
        self.graph = None
        self.logits: torch.Tensor | None = None  # the graph's static output

    def _step(self, a: int, e: int, mask: torch.Tensor | None):
        """(token ids, positions, metadata) of the GPU batch of sequences ``a .. e-1``."""
        L, g, dev = self.length, e - a, self.runner.device
        fixed = None
        if mask is not None:
            _, toks = kept_tokens([0] * g, [L] * g, [L] * g, self.bs)
            fixed = StaticPrefill(self.keep_slots[a * self.keep:e * self.keep],
                                  torch.tensor(toks, dtype=torch.long, device=dev), mask)
        meta = AttentionMetadata(
            is_prefill=True, slot_mapping=self.slots[a * L:e * L], block_tables=self.tables[a:e],
            context_lens=torch.full((g,), L, dtype=torch.long, device=dev),
            query_lens=[L] * g, context_lens_list=[L] * g, static_prefill=fixed)
        return self.ids[a * L:e * L], torch.arange(L, device=dev).repeat(g), meta

    def fill(self, zigzag_block: list[Sequence]) -> None:
        """Settle the zig-zag block's pool rows and slots on the host, write them with the token
        ids, cache slots and KV block tables into the staging buffer, and start one copy to the
        GPU."""
        if self.copied is not None:  # the previous copy must have read the staging buffer
            self.copied.synchronize()
        L, bs, st = self.length, self.bs, self.staging
        nl, nk = self.n * L, self.n * self.keep
        tables = np.array([s.block_table[:self.width] for s in zigzag_block], dtype=np.int64)
        st[:nl] = np.concatenate([s.token_ids for s in zigzag_block])
        st[nl:2 * nl] = pool_slot(tables[:, :, None], np.arange(bs), bs).reshape(self.n, -1)[:, :L].ravel()
        st[2 * nl + nk:] = tables.ravel()
        recent = self.runner.kv.recent
        if recent is not None:
            for a, e in self.batches:  # in the eager schedule's order: one assignment per batch
                rows, init = recent.assign([s.block_table for s in zigzag_block[a:e]],
                                           [L] * (e - a), [L] * (e - a), bs)
                assert not init, "a whole prompt's last KV block holds no earlier slots"
                rows = [r if r >= 0 else recent.scratch for r in rows]
                st[2 * nl + a * self.keep:2 * nl + e * self.keep] = kept_tokens(
                    rows, [L] * (e - a), [L] * (e - a), bs)[0]
        self.inputs.copy_(self.staging_t, non_blocking=True)
        if self.inputs.is_cuda:
            self.copied = torch.cuda.Event()
            self.copied.record()

    def replay(self) -> torch.Tensor:
        """Run the zig-zag block: the first call captures the graph and returns the capture's eager
        warm-up result, later calls replay it. float32 logits ``[n, vocab]``, a copy (the next
        replay overwrites the graph's output)."""
        if self.graph is not None:
            self.graph.replay()
            return self.logits.clone()
        owner = self.owner
        forward = lambda: self.runner.forward_zigzag_block(self.steps, self.lasts)  # noqa: E731
        if owner.capture:
            self.graph, self.logits, warm = record_graph(forward, self.runner.device, owner.pool,
                                                         release_cache=True)
            owner.pool = self.graph.pool()
            return warm
        self.logits = forward()  # CPU tests: the same static step, run eagerly
        self.graph = EagerGraph(forward, self.logits)
        return self.logits.clone()


class PrefillGraphs:
    """``run_zigzag_block(zigzag_block)``: an ``OffloadRunner``'s whole-prompt prefill zig-zag
    block replayed from its
    graph, or None (the runner then calls ``release`` and runs it eagerly). ``capture=False``
    runs the static steps without capturing them (CPU tests)."""

    def __init__(self, runner, capture: bool = True, max_graphs: int = MAX_GRAPHS):
        self.runner, self.capture, self.max_graphs = runner, capture, max_graphs
        self.graphs: dict[tuple[int, int], _PrefillGraph] = {}
        self.seen: Counter = Counter()  # sightings of each zig-zag block shape
        self.pool = None  # the graphs' memory pool (not the decode graphs': released alone)
        self.served = 0  # zig-zag blocks run through a graph (its capture included)

    @torch.inference_mode()
    def run_zigzag_block(self, zigzag_block: list[Sequence]) -> torch.Tensor | None:
        """float32 logits ``[len(zigzag_block), vocab]`` of its sequences' last tokens, or None
        when it is not one equal-length run of whole prompts, its shape is not seen often enough
        yet, or ``max_graphs`` other shapes are held."""
        length = zigzag_block[0].num_tokens
        width = -(-length // self.runner.kv.block_size)
        if any(s.num_computed or s.num_tokens != length or len(s.block_table) < width
               for s in zigzag_block):
            return None
        key = (len(zigzag_block), length)
        g = self.graphs.get(key)
        if g is None:
            if len(self.seen) > 4096:  # a long chat of many prompt lengths: forget them
                self.seen.clear()
            self.seen[key] += 1
            if self.seen[key] < SIGHTINGS or len(self.graphs) >= self.max_graphs:
                return None
            g = self.graphs[key] = _PrefillGraph(self, len(zigzag_block), length,
                                                 self.runner.policy.gbs)
        g.fill(zigzag_block)
        self.served += 1
        return g.replay()

    def release(self) -> None:
        """Drop every graph and hand their memory back (an eager zig-zag block is about to run).
        A shape seen before is captured again at its next sighting: a workload that alternates
        graphed and eager zig-zag blocks pays a capture (about one eager prefill's host work) for each."""
        if not self.graphs:
            return
        self.graphs.clear()
        self.pool = None
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)
            torch.cuda.empty_cache()
