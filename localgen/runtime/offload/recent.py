"""Which row of the fp recent-block pool holds each running sequence's last block (KIVI's recent
tokens in full precision at block granularity; ``kv``'s module docstring).

Every layer of a 4-bit cache keeps its own pool tensors, but the layers of one step see the same
block tables, so one ``RecentIndex`` per cache decides the rows for all of them, once per step
(GPU batch): layer ``j`` puts its K/V into the same row as layer 0. Rows are handed out least
recently written first when the pool is full; row ``capacity`` is a scratch row that padded rows
of a CUDA-graph batch write and read.
"""

from __future__ import annotations

from collections import Counter, OrderedDict


def used_blocks(tables: list[list[int]], context_lens: list[int], block_size: int) -> list[int]:
    """Every block a step reads, per sequence in table order (repeats where sequences share)."""
    used: list[int] = []
    for row, ctx in zip(tables, context_lens):
        used += row[:-(-ctx // block_size)]
    return used


def own_blocks(tables: list[list[int]], context_lens: list[int], block_size: int,
               used: list[int] | None = None) -> list[int] | None:
    """The block each sequence of a decode step writes its new token into (its last block), or
    None when one of them is also read by another sequence of the step (a shared prefix block),
    which the pool cannot serve (the other sequence must see it 4-bit). ``used``: the step's
    ``used_blocks`` when the caller has them."""
    if used is None:
        used = used_blocks(tables, context_lens, block_size)
    own = [row[(c - 1) // block_size] for row, c in zip(tables, context_lens)]
    mine = set(own)
    if len(set(used)) == len(used) or all(n == 1 for b, n in Counter(used).items() if b in mine):
        return own
    return None


class RecentIndex:
    """Block id -> pool row for up to ``capacity`` blocks, shared by the layers of one cache."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.rows: OrderedDict[int, int] = OrderedDict()  # least recently written first
        self.free = list(range(capacity - 1, -1, -1))  # pop() hands out row 0 first

    @property
    def scratch(self) -> int:
        return self.capacity

    def assign(self, tables: list[list[int]], context_lens: list[int], query_lens: list[int],
               block_size: int) -> tuple[list[int], list[int]]:
        """Pool bookkeeping of one step (host only): drop the rows of blocks each sequence has
        moved past, find or make the row of each sequence's last block. Returns (row per
        sequence, -1 where the pool is full of this step's rows; indices of the sequences whose
        row is new while their block already holds earlier slots: every layer must fill those
        rows from the block's 4-bit values before use)."""
        rows, need, taken = [], [], set()
        for i, (row, ctx, ql) in enumerate(zip(tables, context_lens, query_lens)):
            a, j = ctx - ql, (ctx - 1) // block_size
            lo = a // block_size - (1 if a % block_size == 0 and a else 0)  # a block just left is done, too
            for jj in range(lo, j):
                r = self.rows.pop(row[jj], None)
                if r is not None:
                    self.free.append(r)
            r = self.rows.pop(row[j], None)  # existing rows first, so none is evicted below
            if r is None:
                need.append(i)
                r = -1
            else:
                self.rows[row[j]] = r  # most recently written
                taken.add(row[j])
            rows.append(r)
        init = []
        for i in need:
            row, ctx, ql = tables[i], context_lens[i], query_lens[i]
            j = (ctx - 1) // block_size
            r = self._new_row(taken)
            if r >= 0:
                self.rows[row[j]] = r
                taken.add(row[j])
                rows[i] = r
                if ctx - ql > j * block_size:  # the block already holds slots from earlier steps
                    init.append(i)
        return rows, init

    def _new_row(self, taken: set[int]) -> int:
        """A free row, else the least recently written block's unless this step uses it; -1 when
        none can be had."""
        if not self.free:
            if not self.rows or next(iter(self.rows)) in taken:
                return -1
            self.free.append(self.rows.pop(next(iter(self.rows))))
        return self.free.pop()
