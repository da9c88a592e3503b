"""Block allocator with per-sequence block tables, reference counts and prefix caching.

A sequence's KV cache is a list of fixed-size blocks (its block table, PagedAttention §4.2). A full
block is identified by a hash chained over all tokens up to its end, so two sequences with the same
prefix (a system prompt, a chat history) share those blocks (vLLM automatic prefix caching; LightLLM
TokenAttention, FineInfer report §3.4). Freed blocks keep their contents and hash until reused, in
least-recently-freed order, so a finished conversation's prefix stays reusable while memory allows.

With a ``sliding_window`` (the pool of layers that all attend within it: every layer of Mistral,
Jiang et al. 2023 §2, or one KV group of a model that mixes windows, ``localgen.kv.groups``), a
decoding sequence gives back the blocks no later query can see: their table entries then point at
one shared placeholder block, which attention masks out, so the table keeps its position-to-block
layout and a sequence holds at most ``ceil(window / block_size) + 1`` blocks besides it.

A pool whose prefills all start from an empty cache (``window_prefill``: a sliding group of a
model of several KV groups, where prefix reuse is off) holds only the window from the prefill
on: a new (or recomputed) sequence gets live blocks for the positions the window of its last
token covers, and the entries behind point at the placeholder, as if it had decoded there. Its
prefill attends over the step's own K/V (``AttentionMetadata.fresh_prefill``), so the cache need
not hold the positions behind.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation needs more blocks than are free; the scheduler checks first."""


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    tokens: tuple[int, ...] = field(default=())


def chain_hash(prev_hash: int | None, tokens: Sequence[int]) -> int:
    return hash((prev_hash, tuple(tokens)))


def blocks_behind_window(num_tokens: int, window: int, block_size: int) -> int:
    """Leading KV blocks of a sequence of ``num_tokens`` whose every position is before the
    window of its last query (position ``num_tokens - 1`` sees ``num_tokens - window ..``), and
    so of every later query."""
    return max(0, num_tokens - window) // block_size


class BlockManager:
    """Owns ``num_blocks`` KV blocks of ``block_size`` tokens each. ``window_prefill`` (module
    docstring) needs a ``sliding_window`` and prefix caching off; raises ValueError otherwise, or
    for a count or size below 1."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None, window_prefill: bool = False):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be >= 1")
        if window_prefill and (sliding_window is None or enable_prefix_caching):
            raise ValueError("window_prefill needs a sliding_window and prefix caching off")
        self.window_prefill = window_prefill
        self.block_size = block_size
        self.sliding_window = sliding_window
        self._placeholder: int | None = None  # the block released table entries point at
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_id: dict[int, int] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def window_blocks(self) -> int:
        """Most live blocks a table keeps once behind-window blocks are given back:
        ``ceil(sliding_window / block_size) + 1`` (the window seldom starts at a block edge)."""
        return -(-self.sliding_window // self.block_size) + 1

    @property
    def capacity_tokens(self) -> int:
        """Most tokens one sequence alone can hold: a prefill (or a recomputation) takes a block
        per ``block_size`` tokens (the placeholder is free while no other table points at it).
        A ``window_prefill`` pool with room for a window's blocks and the placeholder holds any
        length (``sys.maxsize``)."""
        if self.window_prefill and self.num_blocks >= self.window_blocks + 1:
            return sys.maxsize
        return self.num_blocks * self.block_size

    def prefill_blocks(self, num_tokens: int) -> int:
        """Blocks a new sequence of ``num_tokens`` takes from the free list (prefix hits aside):
        every block's, or under ``window_prefill`` those of its window plus the placeholder when
        an entry must point at it and no table holds it yet."""
        n = self.blocks_for(num_tokens)
        if not self.window_prefill:
            return n
        behind = blocks_behind_window(num_tokens, self.sliding_window, self.block_size)
        return n - behind + (behind > 0 and self._placeholder is None)

    def live_blocks(self, table: list[int]) -> int:
        """Entries of ``table`` that hold a block of KV (not the placeholder)."""
        return sum(1 for b in table if b != self._placeholder)

    # -- prefix cache lookups -------------------------------------------------------------
    def _prefix_hits(self, token_ids: Sequence[int]) -> list[int]:
        """Block ids caching the longest prefix of full blocks, leaving >= 1 token to compute."""
        if not self.enable_prefix_caching:
            return []
        hits, h, bs = [], None, self.block_size
        for i in range((len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(h, tokens)
            bid = self.hash_to_id.get(h)
            if bid is None or self.blocks[bid].tokens != tokens:
                break
            hits.append(bid)
        return hits

    def can_allocate(self, token_ids: Sequence[int]) -> bool:
        hits = self._prefix_hits(token_ids)
        in_use_hits = sum(1 for b in hits if self.blocks[b].ref_count > 0)
        return self.prefill_blocks(len(token_ids)) - in_use_hits <= self.num_free_blocks

    # -- allocation -----------------------------------------------------------------------
    def _take_free(self) -> Block:
        if not self.free_ids:
            raise NoFreeBlocksError("no free KV cache block")
        bid, _ = self.free_ids.popitem(last=False)
        block = self.blocks[bid]
        if block.hash is not None and self.hash_to_id.get(block.hash) == bid:
            del self.hash_to_id[block.hash]  # its old contents are about to be overwritten
        block.hash, block.tokens, block.ref_count = None, (), 1
        return block

    def _register(self, block: Block, prev_hash: int | None, tokens: Sequence[int]) -> None:
        if not self.enable_prefix_caching:
            return
        block.tokens = tuple(tokens)
        block.hash = chain_hash(prev_hash, block.tokens)
        self.hash_to_id[block.hash] = block.block_id

    def allocate(self, token_ids: Sequence[int]) -> tuple[list[int], int]:
        """Block table for a new (or recomputed) sequence and how many tokens are already cached.

        Full blocks get their hash at once: their K/V are written in the coming prefill before any
        sequence reads them (each layer writes all new K/V before attending). Under
        ``window_prefill`` the entries behind the window point at the placeholder.
        Raises NoFreeBlocksError (nothing taken) when blocks run out.
        """
        if not self.can_allocate(token_ids):
            raise NoFreeBlocksError(f"{self.prefill_blocks(len(token_ids))} blocks needed, "
                                    f"{self.num_free_blocks} free")
        if self.window_prefill:
            return self._allocate_window(len(token_ids)), 0
        hits = self._prefix_hits(token_ids)
        table: list[int] = []
        for bid in hits:
            block = self.blocks[bid]
            if block.ref_count == 0:
                del self.free_ids[bid]
            block.ref_count += 1
            table.append(bid)
        bs = self.block_size
        for i in range(len(hits), self.blocks_for(len(token_ids))):
            block = self._take_free()
            table.append(block.block_id)
            chunk = token_ids[i * bs:(i + 1) * bs]
            if len(chunk) == bs:
                self._register(block, self.blocks[table[i - 1]].hash if i else None, chunk)
        return table, len(hits) * bs

    def _allocate_window(self, num_tokens: int) -> list[int]:
        """The table of a ``window_prefill`` sequence: the placeholder for the blocks behind the
        window, then a fresh block for each block the window covers."""
        behind = blocks_behind_window(num_tokens, self.sliding_window, self.block_size)
        table = []
        if behind:
            if self._placeholder is None:
                self._placeholder = self._take_free().block_id  # its reference is this table's
            else:
                self.blocks[self._placeholder].ref_count += 1
            table = [self._placeholder] * behind
        return table + [self._take_free().block_id
                        for _ in range(behind, self.blocks_for(num_tokens))]

    def can_append(self, table: list[int], num_tokens: int) -> bool:
        """Whether a sequence holding ``num_tokens`` (after the append) has or can get room."""
        return self.blocks_for(num_tokens) <= len(table) or self.num_free_blocks > 0

    def append(self, table: list[int], token_ids: Sequence[int]) -> None:
        """Make room for the last of ``token_ids`` (the token being decoded); when that token
        completes a block, register the block for prefix reuse."""
        n, bs = len(token_ids), self.block_size
        if self.blocks_for(n) > len(table):
            table.append(self._take_free().block_id)
        if n % bs == 0:
            idx = n // bs - 1
            prev = self.blocks[table[idx - 1]].hash if idx else None
            if idx == 0 or prev is not None:
                self._register(self.blocks[table[idx]], prev, token_ids[idx * bs:n])
        if self.sliding_window is not None:
            self._release_behind_window(table, n)

    def _release_behind_window(self, table: list[int], num_tokens: int) -> None:
        """Give back the blocks whose every position is before the window of the query at
        ``num_tokens - 1`` (and so of every later query); their entries point at the placeholder.
        Released entries are a prefix of the table, so ``table[0]`` says whether this table
        already holds its one reference to the placeholder."""
        behind = blocks_behind_window(num_tokens, self.sliding_window, self.block_size)
        gone = [j for j in range(behind) if table[j] != self._placeholder]
        if not gone:
            return
        if self._placeholder is None:
            if not self.free_ids:
                return  # taken on a later step, once a block is free
            self._placeholder = self._take_free().block_id  # its reference is this table's
        elif table[0] != self._placeholder:
            self.blocks[self._placeholder].ref_count += 1
        for j in gone:
            self._unref(table[j])
            table[j] = self._placeholder

    def free(self, table: list[int]) -> None:
        """Release a sequence's blocks; cached contents stay reusable until the block is taken.
        The placeholder goes back to the free blocks with the last table pointing at it."""
        holds_placeholder = bool(table) and table[0] == self._placeholder
        for bid in reversed(table):  # tail blocks first: they are the least likely to be shared
            if bid != self._placeholder:
                self._unref(bid)
        if holds_placeholder:
            self._unref(self._placeholder)
            if self.blocks[self._placeholder].ref_count == 0:
                self._placeholder = None
        table.clear()

    def _unref(self, bid: int) -> None:
        block = self.blocks[bid]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_ids[bid] = None
