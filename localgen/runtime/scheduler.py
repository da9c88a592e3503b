"""Iteration-level scheduling (Orca): every step picks which sequences run, so requests join and
leave the batch at any step.

Each step is either a prefill of newly admitted sequences or a decode of the running ones (vLLM's
default policy). Admission is by free KV blocks, ``max_num_seqs`` and ``max_num_batched_tokens``,
in priority order (interactive before batch, FineInfer report §3.3), first come first served within
a priority. When blocks run out, the lowest-priority, latest-arrived sequence is preempted: its
blocks are freed and it is recomputed later from its tokens so far (vLLM §4.5, recomputation).
A model whose layers differ in attention window keeps one block table per KV group
(``localgen.kv.groups``); admission, growth and preemption then need room in every group's pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from localgen.kv.block_manager import BlockManager
from localgen.kv.groups import GroupedBlockManager
from localgen.runtime.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    is_prefill: bool
    preempted: list[Sequence] = field(default_factory=list)
    out_of_memory: list[Sequence] = field(default_factory=list)  # alone and still no room: finish


class Scheduler:
    """``block_manager``: the KV groups' pools, or one ``BlockManager`` (a single group)."""

    def __init__(self, block_manager: GroupedBlockManager | BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if isinstance(block_manager, BlockManager):
            block_manager = GroupedBlockManager([block_manager])
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        batch = self._schedule_prefill()
        if batch.seqs:
            return batch
        decode = self._schedule_decode()
        decode.preempted[:0] = batch.preempted
        return decode if decode.seqs or decode.out_of_memory or decode.preempted else None

    def _schedule_prefill(self) -> ScheduledBatch:
        """Admit waiting sequences in priority order while slots, the token budget and KV blocks
        allow. Every admitted sequence joins ``running`` whatever stops the loop: a sequence
        holding blocks outside both queues would never run nor free them."""
        batch = ScheduledBatch([], is_prefill=True)
        self.waiting.sort(key=lambda s: s.sort_key)
        try:
            self._admit(batch)
        finally:
            self.running.extend(batch.seqs)
        return batch

    def _admit(self, batch: ScheduledBatch) -> None:
        tokens = 0
        while self.waiting:
            seq = self.waiting[0]
            if seq in batch.preempted:
                return  # just made room for a higher priority; do not take it back this step
            if len(self.running) + len(batch.seqs) >= self.max_num_seqs and not self._make_room(seq, batch):
                return
            if batch.seqs and tokens + seq.num_tokens > self.max_num_batched_tokens:
                return
            while not self.bm.can_allocate(seq.token_ids):
                if not self._make_room(seq, batch):
                    return
            tables, seq.num_computed = self.bm.allocate(seq.token_ids)
            seq.block_table, seq.group_tables = tables[0], tables[1:]
            if seq.num_preemptions == 0:
                seq.num_cached_prompt_tokens = seq.num_computed
            seq.status = SequenceStatus.RUNNING
            self.waiting.pop(0)
            batch.seqs.append(seq)
            tokens += seq.num_tokens - seq.num_computed

    def _make_room(self, seq: Sequence, batch: ScheduledBatch) -> bool:
        """Preempt one running sequence of lower priority than ``seq`` (interactive requests take
        the place of batch work). Returns False when there is none."""
        victims = [s for s in self.running if s.priority > seq.priority and s not in batch.seqs]
        if not victims:
            return False
        self._preempt(max(victims, key=lambda s: s.sort_key), batch)
        return True

    def _schedule_decode(self) -> ScheduledBatch:
        batch = ScheduledBatch([], is_prefill=False)
        for seq in sorted(self.running, key=lambda s: s.sort_key):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            while not self.bm.can_append(seq.block_tables, seq.num_tokens):
                running = [s for s in self.running if s.status is SequenceStatus.RUNNING]
                if len(running) == 1:
                    batch.out_of_memory.append(seq)  # alone and still no room: it cannot grow
                    break
                victim = max(running, key=lambda s: s.sort_key)  # lowest priority, latest
                self._preempt(victim, batch)
                if victim is seq:
                    break  # it was the one to give way; it is recomputed later
            else:
                self.bm.append(seq.block_tables, seq.token_ids)
                batch.seqs.append(seq)
        batch.seqs = [s for s in batch.seqs if s.status is SequenceStatus.RUNNING]
        return batch

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.bm.free(seq.block_tables)
        self.running.remove(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        if seq in batch.seqs:
            batch.seqs.remove(seq)
        self.add(seq)
        batch.preempted.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove a sequence (running or waiting) and free its blocks."""
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free(seq.block_tables)
