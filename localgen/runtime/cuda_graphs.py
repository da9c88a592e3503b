"""Decode steps replayed as CUDA graphs.

A decode step of ``n`` sequences runs the graph captured for the smallest batch bucket ``>= n``
and the smallest context bucket ``>=`` the longest context; inputs are copied into the graph's
static buffers, padded rows write their K/V into the cache's scratch block and attend to it alone,
and their logits are ignored. Graph replays remove the per-kernel launch cost that dominates
small-batch decode (vLLM and gpt-fast do the same). Prefill stays eager.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch

from localgen.kv.attention import AttentionMetadata
from localgen.kv.cache import PagedKVCache
from localgen.models.model import CausalLM
from localgen.runtime.executor import ModelRunner
from localgen.runtime.sequence import Sequence

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def context_buckets(max_model_len: int, smallest: int = 512) -> list[int]:
    """Powers of two from ``smallest`` up to (and including) ``max_model_len``."""
    out, c = [], smallest
    while c < max_model_len:
        out.append(c)
        c *= 2
    return out + [max_model_len]


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    batch: int
    max_context: int
    device_inputs: torch.Tensor  # flat: ids, positions, slots, ctx ([batch] each), table
    staging: np.ndarray  # its pinned host twin, written through numpy (no torch op per field)
    staging_t: torch.Tensor  # the same pinned memory as a tensor, the copy's source
    meta: AttentionMetadata
    logits: torch.Tensor


class GraphedModelRunner(ModelRunner):
    """ModelRunner whose decode steps replay CUDA graphs (captured lazily per bucket pair)."""

    def __init__(self, model: CausalLM, kv_cache: PagedKVCache, max_num_seqs: int,
                 max_model_len: int):
        super().__init__(model, kv_cache)
        self.batch_buckets = [b for b in BATCH_BUCKETS if b < max_num_seqs] + [max_num_seqs]
        self.ctx_buckets = context_buckets(max_model_len)
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.pool = None  # one memory pool shared by all graphs

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], is_prefill: bool) -> torch.Tensor:
        if is_prefill:
            return super().run(seqs, is_prefill)
        g = self.graph_for(seqs)
        self._fill(g, seqs)
        g.graph.replay()
        return g.logits[:len(seqs)]

    def graph_for(self, seqs: list[Sequence]) -> _Graph:
        """The decode graph of the smallest (batch, context) bucket pair that holds ``seqs``,
        captured on first use."""
        longest = max(s.num_tokens for s in seqs)
        b = self.batch_buckets[bisect.bisect_left(self.batch_buckets, len(seqs))]
        c = self.ctx_buckets[bisect.bisect_left(self.ctx_buckets, longest)]
        return self.graphs.get((b, c)) or self._capture(b, c)

    def _fill(self, g: _Graph, seqs: list[Sequence]) -> None:
        """Write the step's inputs into the graph's pinned staging buffer, then one asynchronous
        host-to-device copy into the static buffers. Rows past ``len(seqs)`` are padding: they
        write their K/V into the cache's scratch block and attend to that one slot."""
        n, bs, b, st = len(seqs), self.kv.block_size, g.batch, g.staging
        scratch = self.kv.scratch_block
        ids, pos, slots, ctx = st[:b], st[b:2 * b], st[2 * b:3 * b], st[3 * b:4 * b]
        table = st[4 * b:].reshape(b, -1)
        for i, s in enumerate(seqs):
            p = s.num_tokens - 1
            ids[i], pos[i], ctx[i] = s.token_ids[-1], p, s.num_tokens
            slots[i] = s.block_table[p // bs] * bs + p % bs
            nb = len(s.block_table)
            table[i, :nb] = s.block_table
            table[i, nb:] = scratch
        if n < b:
            ids[n:], pos[n:], slots[n:], ctx[n:], table[n:] = 0, 0, scratch * bs, 1, scratch
        g.device_inputs.copy_(g.staging_t, non_blocking=True)

    def _capture(self, batch: int, max_context: int) -> _Graph:
        dev, bs = self.device, self.kv.block_size
        width = -(-max_context // bs)
        # one flat buffer, every field a contiguous view of it (no unpacking kernels in the
        # graph): ids, positions, slots, context lens ([batch] each), then the [batch, width]
        # block table
        inputs = torch.zeros(batch * (4 + width), dtype=torch.long, device=dev)
        cols = [inputs[i * batch:(i + 1) * batch] for i in range(4)]
        tables = inputs[4 * batch:].view(batch, width)
        cols[2].fill_(self.kv.scratch_block * bs)
        cols[3].fill_(1)
        tables.fill_(self.kv.scratch_block)
        staging_t = inputs.cpu().pin_memory()
        meta = AttentionMetadata(
            is_prefill=False, slot_mapping=cols[2], block_tables=tables, context_lens=cols[3],
            query_lens=[1] * batch,
            context_lens_list=[max_context] * batch,  # fixes the kernel's split count
        )

        def forward():
            return self.model.logits(self.model.forward(cols[0], cols[1], self.kv.views, meta))

        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            forward()  # warm-up: compiles the Triton kernels and sizes the allocator
        torch.cuda.current_stream(dev).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = forward()
        self.pool = graph.pool()
        g = _Graph(graph, batch, max_context, inputs, staging_t.numpy(), staging_t, meta, logits)
        self.graphs[(batch, max_context)] = g
        return g
