"""Scheduler decisions on synthetic sequences (no model): admission, priorities, preemption."""

from localgen.kv.block_manager import BlockManager
from localgen.runtime.request import Priority, SamplingParams
from localgen.runtime.scheduler import Scheduler
from localgen.runtime.sequence import Sequence, SequenceStatus


def seq(name: str, n: int, priority: Priority) -> Sequence:
    return Sequence(name, list(range(1, n + 1)), n, SamplingParams(), priority, None)


def test_a_batch_sequence_that_runs_out_of_blocks_gives_way_itself():
    sched = Scheduler(BlockManager(5, block_size=4, enable_prefix_caching=False), 8, 64)
    batch_seq, chat_seq = seq("b", 8, Priority.BATCH), seq("i", 8, Priority.INTERACTIVE)
    sched.add(batch_seq)
    sched.add(chat_seq)
    assert set(sched.schedule().seqs) == {batch_seq, chat_seq}  # prefill: 4 of 5 blocks
    for s in (batch_seq, chat_seq):
        s.token_ids.append(99)  # each now needs a third block; only one is free
        s.num_computed = s.num_tokens - 1
    step = sched.schedule()
    assert step.seqs == [chat_seq] and step.preempted == [batch_seq]
    assert batch_seq.status is SequenceStatus.WAITING and chat_seq.status is SequenceStatus.RUNNING


def test_an_interactive_request_takes_a_batch_slot():
    sched = Scheduler(BlockManager(16, block_size=4), max_num_seqs=2, max_num_batched_tokens=64)
    jobs = [seq(f"b{i}", 4, Priority.BATCH) for i in range(3)]
    for j in jobs:
        sched.add(j)
    assert sched.schedule().seqs == jobs[:2]  # max_num_seqs
    chat = seq("i", 4, Priority.INTERACTIVE)
    sched.add(chat)
    step = sched.schedule()
    assert step.is_prefill and step.seqs == [chat] and step.preempted == [jobs[1]]


def test_a_sequence_alone_without_room_is_reported_out_of_memory():
    sched = Scheduler(BlockManager(2, block_size=4), 4, 64)
    s = seq("a", 8, Priority.BATCH)
    sched.add(s)
    sched.schedule()
    s.token_ids.append(7)
    s.num_computed = 8
    step = sched.schedule()
    assert step.out_of_memory == [s] and step.seqs == []
