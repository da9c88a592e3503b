"""Decode steps, and one prompt's whole prefill, replayed as CUDA graphs.

A decode step of ``n`` sequences runs the graph captured for the smallest batch bucket ``>= n``
and the smallest context bucket ``>=`` the longest context; inputs are copied into the graph's
static buffers, padded rows write their K/V into the cache's scratch block and attend to it alone,
and their logits are ignored. Graph replays remove the per-kernel launch cost that dominates
small-batch decode (vLLM and gpt-fast do the same).

A prefill of one prompt with nothing cached (``prefill_graphs``) runs the graph of the smallest
prefill bucket ``>=`` its length: the prompt's tokens first, then padding tokens that write
their K/V into the scratch block; causal attention keeps the prompt's rows from seeing them, and
the logits are read at the prompt's last row. A single prompt's eager prefill launches a few
hundred kernels from Python for little GPU work, so the host is its bound. Prefills of several
prompts or onto a cached prefix stay eager (their GPU work hides the launches); the offload
runtime replays its whole-prompt 4-bit prefill blocks (``runtime.offload.prefill_graphs``).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch

from localgen.attention.spec import layer_specs
from localgen.kv.attention import AttentionMetadata, pool_slot
from localgen.kv.cache import PagedKVCache
from localgen.models.model import CausalLM
from localgen.runtime.model_runner import ModelRunner, _slots
from localgen.runtime.request import Priority, SamplingParams
from localgen.runtime.sequence import Sequence

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
COLUMNS = 6  # [batch] columns of a graph's flat input buffer before the block table
# prompt lengths (tokens) of the prefill graphs; a longer prompt's GPU work hides its launches
PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512)


def context_buckets(max_model_len: int, smallest: int = 512) -> list[int]:
    """Powers of two from ``smallest`` up to (and including) ``max_model_len``."""
    out, c = [], smallest
    while c < max_model_len:
        out.append(c)
        c *= 2
    return out + [max_model_len]


def _bucket(buckets: list[int], n: int) -> int:
    """The smallest bucket ``>= n``. Raises ValueError past the largest (``max_num_seqs``
    sequences, ``max_model_len`` tokens: the engine's limits)."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} is past the largest decode graph bucket, {buckets[-1]}")
    return buckets[i]


@dataclass
class _Graph:
    graph: "torch.cuda.CUDAGraph | EagerGraph"
    batch: int
    max_context: int
    # flat: ids, positions, slots, ctx, pool rows, pool slots ([batch] each), block table
    device_inputs: torch.Tensor
    staging: np.ndarray  # its pinned host twin, written through numpy (no torch op per field)
    staging_t: torch.Tensor  # the same pinned memory as a tensor, the copy's source
    meta: AttentionMetadata
    logits: torch.Tensor


@dataclass
class _PrefillGraph:
    graph: "torch.cuda.CUDAGraph | EagerGraph"
    length: int  # the bucket: prompt tokens plus padding
    width: int  # block table entries
    # flat: ids [length], slots [length], the prompt's last row [1], block table [width]
    device_inputs: torch.Tensor
    staging: np.ndarray
    staging_t: torch.Tensor
    logits: torch.Tensor  # [1, vocab]


class EagerGraph:
    """A stand-in for a captured graph that runs the same static-shape step eagerly (``capture``
    off: CPU tests of everything but the capture itself)."""

    def __init__(self, forward, logits: torch.Tensor):
        self.forward, self.logits = forward, logits

    def replay(self) -> None:
        self.logits.copy_(self.forward())


class GraphedModelRunner(ModelRunner):
    """ModelRunner whose decode steps replay CUDA graphs (captured lazily per bucket pair).

    A cache with a recent-block pool (``runtime.offload.kv.TieredKVCache``) gives each step's pool
    rows (``graph_pool_rows``) and may refuse a step, which then runs eagerly. A model with a
    layer beyond plain causal attention (``AttentionSpec.plain``: its window, softcap or sinks
    are computed per sequence from host-side lengths) decodes eagerly, and so does a sequence of
    several KV groups (``localgen.kv.groups``: the graphs' inputs hold one block table per
    sequence; such a model has a windowed layer anyway). ``capture=False`` runs the static steps
    without capturing them. ``prefill_graphs``: replay one prompt's whole prefill too (module
    docstring), where the attention backend's prefill allows capture
    (``AttentionBackend.graphs_prefill``)."""

    def __init__(self, model: CausalLM, kv_cache: PagedKVCache, max_num_seqs: int,
                 max_model_len: int, capture: bool = True, prefill_graphs: bool = False):
        super().__init__(model, kv_cache)
        self.replays = all(spec.plain for spec in layer_specs(model.cfg))
        self.batch_buckets = [b for b in BATCH_BUCKETS if b < max_num_seqs] + [max_num_seqs]
        self.ctx_buckets = context_buckets(max_model_len)
        self.graphs: dict[tuple[int, int], _Graph] = {}
        prefills = prefill_graphs and self.replays and (self.attention.graphs_prefill or not capture)
        self.prefill_buckets = [b for b in PREFILL_BUCKETS if b <= max_model_len] if prefills else []
        self.prefill_graphs: dict[int, _PrefillGraph] = {}
        self.pool = None  # one memory pool shared by all graphs
        self.capture = capture
        recent = getattr(kv_cache, "recent", None)
        self.scratch_row = recent.scratch if recent is not None else 0  # padded rows' pool row

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], is_prefill: bool) -> torch.Tensor:
        out = self.prefill(seqs) if is_prefill else self.decode(seqs)
        return out if out is not None else super().run(seqs, is_prefill)

    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence]) -> torch.Tensor | None:
        """float32 logits ``[1, vocab]`` of one whole prompt's prefill replayed from the graph of
        its bucket (captured on first use: its eager warm-up is this step's result); None
        (eager) for several prompts, a cached prefix, several KV groups or a prompt past the
        largest bucket."""
        if len(seqs) != 1 or not self.prefill_buckets:
            return None
        s = seqs[0]
        if s.num_computed or s.group_tables:
            return None
        i = bisect.bisect_left(self.prefill_buckets, s.num_tokens)
        if i == len(self.prefill_buckets):
            return None
        length = self.prefill_buckets[i]
        if len(s.block_table) > self._prefill_width(length):
            return None  # more blocks than the bucket's table holds (not the block manager's way)
        g = self.prefill_graphs.get(length)
        if g is None:
            return self._capture_prefill(length, s)
        self._fill_prefill(g, s)
        g.graph.replay()
        return g.logits

    @torch.inference_mode()
    def capture_prefills(self) -> int:
        """Capture the prefill graph of every prompt-length bucket not captured yet, around a
        stand-in prompt whose K/V go to the scratch block; returns how many. A server calls it
        at load: a bucket's first prompt otherwise pays its kernels' compilation and the
        capture inside its step, which stalls the running batch."""
        bs, scratch = self.kv.block_size, self.kv.scratch_block
        todo = [L for L in self.prefill_buckets if L not in self.prefill_graphs]
        for L in todo:
            stand_in = Sequence("prefill-graph", [0] * L, L, SamplingParams(), Priority.BATCH,
                                None, block_table=[scratch] * -(-L // bs))
            self._capture_prefill(L, stand_in)
        return len(todo)

    def _prefill_width(self, length: int) -> int:
        """Block table entries of the prefill graph of bucket ``length``: its blocks and one
        more (a block manager that allocates the first generated token's slot with the prompt)."""
        return -(-length // self.kv.block_size) + 1

    def _fill_prefill(self, g: _PrefillGraph, s: Sequence) -> None:
        """Stage ``s``'s prompt and its padding (module docstring), then one asynchronous copy."""
        n, L, bs, st = s.num_tokens, g.length, self.kv.block_size, g.staging
        scratch = self.kv.scratch_block
        ids, slots, table = st[:L], st[L:2 * L], st[2 * L + 1:]
        ids[:n], ids[n:] = s.token_ids, 0
        slots[:n] = _slots(s.block_table, 0, n, bs)
        slots[n:] = scratch * bs + np.arange(n, L) % bs
        st[2 * L] = n - 1
        nb = len(s.block_table)
        table[:nb], table[nb:] = s.block_table, scratch
        g.device_inputs.copy_(g.staging_t, non_blocking=True)

    def _capture_prefill(self, length: int, s: Sequence) -> torch.Tensor:
        """Capture the prefill graph of bucket ``length`` around ``s``'s prefill; ``s``'s logits
        (the warm-up's)."""
        dev, width = self.device, self._prefill_width(length)
        inputs = torch.zeros(2 * length + 1 + width, dtype=torch.long, device=dev)
        ids, slots = inputs[:length], inputs[length:2 * length]
        last, table = inputs[2 * length:2 * length + 1], inputs[2 * length + 1:].view(1, width)
        positions = torch.arange(length, device=dev)
        meta = AttentionMetadata(
            is_prefill=True, slot_mapping=slots, block_tables=table,
            context_lens=torch.tensor([length], device=dev), query_lens=[length],
            context_lens_list=[length])

        def forward():
            hidden = self.model.forward(ids, positions, self.kv.views, meta)
            return self.model.logits(hidden.index_select(0, last))

        staging_t = self._staging(inputs)
        g = _PrefillGraph(None, length, width, inputs, staging_t.numpy(), staging_t, None)
        self._fill_prefill(g, s)
        g.graph, g.logits, out = self._graph_of(forward)
        self.prefill_graphs[length] = g
        return out

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> torch.Tensor | None:
        """float32 logits ``[len(seqs), vocab]`` of a decode step replayed from its graph; None
        when the cache wants this step run eagerly, or the model's attention does."""
        if not self.replays or seqs[0].group_tables:
            return None
        g = self.graph_for(seqs)
        if not self._fill(g, seqs):
            return None
        g.graph.replay()
        return g.logits[:len(seqs)]

    def graph_for(self, seqs: list[Sequence]) -> _Graph:
        """The decode graph of the smallest (batch, context) bucket pair that holds ``seqs``,
        captured on first use."""
        b = _bucket(self.batch_buckets, len(seqs))
        c = _bucket(self.ctx_buckets, max(s.num_tokens for s in seqs))
        return self.graphs.get((b, c)) or self._capture(b, c)

    @torch.inference_mode()
    def capture_batches(self, context: int = 1) -> int:
        """Capture the decode graph of every batch bucket at the context bucket that holds
        ``context`` tokens (by default the smallest), those not captured yet; returns how many.
        Raises ValueError for a context past ``max_model_len``.
        A server calls it at load: a bucket's first use otherwise pays its kernels' compilation
        and the capture inside the step of the requests that first reach that batch size. Does
        nothing for a model whose steps run eagerly (``replays`` false)."""
        if not self.replays:
            return 0
        c = _bucket(self.ctx_buckets, context)
        todo = [b for b in self.batch_buckets if (b, c) not in self.graphs]
        for b in todo:
            self._capture(b, c)
        return len(todo)

    def _fill(self, g: _Graph, seqs: list[Sequence]) -> bool:
        """Write the step's inputs into the graph's pinned staging buffer, then one asynchronous
        host-to-device copy into the static buffers. Rows past ``len(seqs)`` are padding: they
        write their K/V into the cache's scratch block (and pool row) and attend to that one
        slot. False (nothing copied) when the cache refuses the step's pool rows."""
        n, bs, b, st = len(seqs), self.kv.block_size, g.batch, g.staging
        rows = [0] * n
        pool_rows = getattr(self.kv, "graph_pool_rows", None)
        if pool_rows is not None:
            rows = pool_rows([s.block_table for s in seqs], [s.num_tokens for s in seqs])
            if rows is None:
                return False
        scratch = self.kv.scratch_block
        ids, pos, slots, ctx, prow, pslot = (st[i * b:(i + 1) * b] for i in range(COLUMNS))
        table = st[COLUMNS * b:].reshape(b, -1)
        for i, s in enumerate(seqs):
            p = s.num_tokens - 1
            ids[i], pos[i], ctx[i] = s.token_ids[-1], p, s.num_tokens
            slots[i] = s.block_table[p // bs] * bs + p % bs
            nb = len(s.block_table)
            table[i, :nb] = s.block_table
            table[i, nb:] = scratch
        prow[:n] = rows
        if n < b:
            ids[n:], pos[n:], slots[n:], ctx[n:], table[n:] = 0, 0, scratch * bs, 1, scratch
            prow[n:] = self.scratch_row
        pslot[:] = pool_slot(prow, (ctx - 1) % bs, bs)  # once a step, not once a layer
        g.device_inputs.copy_(g.staging_t, non_blocking=True)
        if not self.capture:  # an eager step may read host-side lengths (the CPU reference path)
            g.meta.context_lens_list = ctx.tolist()
            g.meta.clear_plans()
        return True

    def _capture(self, batch: int, max_context: int) -> _Graph:
        dev, bs = self.device, self.kv.block_size
        width = -(-max_context // bs)
        # one flat buffer, every field a contiguous view of it (no unpacking kernels in the
        # graph): ids, positions, slots, context lens, pool rows, pool slots ([batch] each),
        # then the [batch, width] block table
        inputs = torch.zeros(batch * (COLUMNS + width), dtype=torch.long, device=dev)
        cols = [inputs[i * batch:(i + 1) * batch] for i in range(COLUMNS)]
        tables = inputs[COLUMNS * batch:].view(batch, width)
        cols[2].fill_(self.kv.scratch_block * bs)
        cols[3].fill_(1)
        cols[4].fill_(self.scratch_row)
        cols[5].fill_(self.scratch_row * bs)
        tables.fill_(self.kv.scratch_block)
        meta = AttentionMetadata(
            is_prefill=False, slot_mapping=cols[2], block_tables=tables, context_lens=cols[3],
            query_lens=[1] * batch,
            context_lens_list=[max_context] * batch,  # fixes the kernel's split count
        )
        if hasattr(self.kv, "graph_pool_rows"):
            meta.pool_rows, meta.pool_slots = cols[4], cols[5]

        def forward():
            return self.model.logits(self.model.forward(cols[0], cols[1], self.kv.views, meta))

        staging_t = self._staging(inputs)
        graph, logits, _ = self._graph_of(forward)
        g = _Graph(graph, batch, max_context, inputs, staging_t.numpy(), staging_t, meta, logits)
        self.graphs[(batch, max_context)] = g
        return g

    def _staging(self, inputs: torch.Tensor) -> torch.Tensor:
        """The host twin of a graph's device inputs: pinned when capturing (asynchronous
        copies), a plain copy for the eager stand-in."""
        return inputs.cpu().pin_memory() if self.capture else inputs.clone()

    def _graph_of(self, forward):
        """(graph, its static output, the first run's output) of ``forward``: captured around
        an eager warm-up (``record_graph``, in the pool all this runner's graphs share), or,
        with ``capture`` off, the eager stand-in whose first run is its static output."""
        if not self.capture:
            out = forward()
            return EagerGraph(forward, out), out, out
        graph, static, warm = record_graph(forward, self.device, self.pool)
        self.pool = graph.pool()
        return graph, static, warm


def record_graph(forward, device: torch.device, pool=None, release_cache: bool = False):
    """Run ``forward`` once eagerly on a side stream (compiles the Triton kernels, sizes the
    allocator; its output is a real result), then capture it into a graph whose allocations come
    from ``pool`` (a ``graph_pool_handle``; None: a new pool). ``release_cache``: hand the
    allocator's cached free blocks back to the driver between the two (a large capture under a
    memory cap otherwise finds the warm-up's freed blocks held by the eager pool). Returns
    (graph, the graph's static output, the eager run's output)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        warm = forward()
    torch.cuda.current_stream(device).wait_stream(stream)
    if release_cache:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = forward()
    return graph, out, warm
