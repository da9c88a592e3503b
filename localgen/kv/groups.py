"""KV groups: a model's layers partitioned by attention window, each group with its own pool of KV
blocks and its own block table per sequence (the idea of vLLM's hybrid KV cache manager).

A model whose layers all attend alike has one group: one pool and one block table per sequence
(PagedAttention §4.2). That covers every model without a window and Mistral, whose every layer
slides (its one group gives back the blocks behind the window). A model that interleaves
sliding-window layers with full-attention ones (Gemma 2/3: Team Gemma 2024 §2; gpt-oss; Qwen2 past
``max_window_layers``) has one group per distinct window. The full-attention group holds every
block of the context; a sliding group gives back the blocks behind its window as the sequence
decodes (``BlockManager._release_behind_window``), so its pool is sized for windows, not contexts
(``localgen.kv.cache.plan_group_blocks``).

Prefix caching is off for a model of several groups: a sliding group has given back, and may have
handed out again, the blocks of a cached prefix that lie behind its window, so a hit in the
full-attention group could not be matched in the sliding one, and a prefix the model skips must
be cached in every group.

So every prefill (and every recomputation after preemption) of such a model starts from an empty
cache, and its sliding layers attend over the step's own K/V (``AttentionMetadata.fresh_prefill``)
rather than the cache: a sliding group then holds only its window from the prefill on
(``BlockManager`` ``window_prefill``), the K/V of the positions behind it going to the pool's
scratch block, and a long prompt costs its sliding layers no more than a decoding sequence does.

Block counts (``num_blocks``, ``num_free_blocks``, what ``/metrics`` reports as KV blocks used and
total) are sums over the groups' pools; a block of a group holds K and V of that group's layers
only (``PagedKVCache.group_block_bytes``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from localgen.kv.block_manager import BlockManager, NoFreeBlocksError

Tables = list[list[int]]  # one block table per KV group, group 0 first


@dataclass(frozen=True)
class KVGroup:
    """Layers sharing one pool of KV blocks and one block table per sequence.

    window: the sliding window (tokens) of every layer of the group; None = full attention.
    layers: the model's layer indices in the group, ascending.
    """

    window: int | None
    layers: tuple[int, ...]


def prefills_hold_windows(num_groups: int) -> bool:
    """Whether the sliding groups of a model of ``num_groups`` KV groups hold only their windows
    in a prefill: with several groups (module docstring)."""
    return num_groups > 1


def kv_groups(windows: Sequence[int | None]) -> tuple[KVGroup, ...]:
    """Layers partitioned by window: ``windows[i]`` is layer i's sliding window in tokens (None:
    full attention). The full-attention group comes first, then the windows in ascending order.
    Raises ValueError for no layers or a window below 1."""
    if not windows:
        raise ValueError("kv_groups needs at least one layer's window")
    bad = [(i, w) for i, w in enumerate(windows) if w is not None and w < 1]
    if bad:
        raise ValueError(f"layer {bad[0][0]}'s sliding window must be >= 1, got {bad[0][1]}")
    order = sorted(set(windows), key=lambda w: (w is not None, w or 0))
    return tuple(KVGroup(w, tuple(i for i, x in enumerate(windows) if x == w)) for w in order)


class GroupedBlockManager:
    """One ``BlockManager`` per KV group (``pools[g]`` serves group g); a sequence holds one block
    table per group (``Tables``). Admission and growth need room in every pool; a prefix is
    reused only with one group (module docstring). With one pool every call is that pool's own.
    Raises ValueError for no pools, pools of different block sizes, or several pools with prefix
    caching on."""

    def __init__(self, pools: Sequence[BlockManager]):
        if not pools:
            raise ValueError("GroupedBlockManager needs at least one pool")
        if len({p.block_size for p in pools}) != 1:
            raise ValueError(f"KV group pools differ in block size: {[p.block_size for p in pools]}")
        if len(pools) > 1 and any(p.enable_prefix_caching for p in pools):
            raise ValueError("prefix caching needs a single KV group (module docstring)")
        self.pools = list(pools)
        self.block_size = pools[0].block_size

    @classmethod
    def build(cls, pools: Sequence[tuple[int, int | None]], block_size: int,
              enable_prefix_caching: bool = True) -> "GroupedBlockManager":
        """A manager of one pool per ``(num_blocks, sliding_window)`` pair, in group order; prefix
        caching as asked with one pool, off with several, where a sliding pool's prefill holds
        only its window (``prefills_hold_windows``)."""
        reuse = enable_prefix_caching and len(pools) == 1
        windowed = prefills_hold_windows(len(pools))
        return cls([BlockManager(n, block_size, reuse, w, windowed and w is not None)
                    for n, w in pools])

    @property
    def num_groups(self) -> int:
        return len(self.pools)

    @property
    def num_blocks(self) -> int:
        """Blocks of every pool together."""
        return sum(p.num_blocks for p in self.pools)

    @property
    def num_free_blocks(self) -> int:
        """Free blocks of every pool together."""
        return sum(p.num_free_blocks for p in self.pools)

    @property
    def capacity_tokens(self) -> int:
        """Most tokens one sequence alone can hold: the smallest pool's ``capacity_tokens``."""
        return min(p.capacity_tokens for p in self.pools)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, token_ids: Sequence[int]) -> bool:
        return all(p.can_allocate(token_ids) for p in self.pools)

    def allocate(self, token_ids: Sequence[int]) -> tuple[Tables, int]:
        """One block table per group for a new (or recomputed) sequence, and how many of its
        tokens every group has cached. Raises NoFreeBlocksError (nothing held) when a pool lacks
        room."""
        if not self.can_allocate(token_ids):
            raise NoFreeBlocksError(f"KV blocks needed per group: "
                                    f"{[p.prefill_blocks(len(token_ids)) for p in self.pools]}; "
                                    f"free: {[p.num_free_blocks for p in self.pools]}")
        got = [p.allocate(token_ids) for p in self.pools]
        return [table for table, _ in got], min(cached for _, cached in got)

    def can_append(self, tables: Tables, num_tokens: int) -> bool:
        """Whether every group's table has or can get room for ``num_tokens`` (after the append)."""
        return all(p.can_append(t, num_tokens) for p, t in zip(self.pools, tables))

    def append(self, tables: Tables, token_ids: Sequence[int]) -> None:
        """``BlockManager.append`` in every group (a sliding group then gives back the blocks
        behind its window)."""
        for p, t in zip(self.pools, tables):
            p.append(t, token_ids)

    def free(self, tables: Tables) -> None:
        """Release every group's table (each emptied in place)."""
        for p, t in zip(self.pools, tables):
            p.free(t)

    def live_blocks(self, group: int, table: list[int]) -> int:
        """Blocks of group ``group``'s ``table`` that hold KV (the placeholder excluded)."""
        return self.pools[group].live_blocks(table)
