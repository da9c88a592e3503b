"""The engine under memory pressure, by property (hypothesis): every run finishes, the scheduler's
invariants hold after every step, and outputs equal an unconstrained run's.

The model is a stand-in whose "KV cache" stores token ids in the engine's blocks: each step it
checks that the cached part of every sequence reads back, through the block table, as that
sequence's own tokens, then computes the next-token logits from what it reads. A block handed to
two sequences, a prefix-cache hit on the wrong block, or a lost write changes the outputs or
fails the check, so equal outputs prove the paging as well as the scheduling.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from localgen.runtime.engine import Engine, EngineConfig
from localgen.runtime.request import KVBudgetError, Priority, Request, SamplingParams
from localgen.runtime.sequence import SequenceStatus

VOCAB, EOS = 24, 0


def logits_for(context: list[int]) -> torch.Tensor:
    """A fixed pseudo-random function of the whole context (no ties: greedy is well defined)."""
    gen = torch.Generator().manual_seed(hash(tuple(context)) & 0xFFFF_FFFF)
    return torch.randn(VOCAB, generator=gen)


class TokenKV:
    """KV storage of token ids, ``[num_blocks][block_size]``, written and read by block table."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.bytes_per_block = block_size * 1024  # 1 KiB a token, for the budget messages
        self.nbytes = num_blocks * self.bytes_per_block
        self.slots = [[None] * block_size for _ in range(num_blocks)]

    def read(self, table: list[int], n: int) -> list[int]:
        bs = self.block_size
        return [self.slots[table[p // bs]][p % bs] for p in range(n)]

    def write(self, table: list[int], start: int, tokens: list[int]) -> None:
        bs = self.block_size
        for p, tok in enumerate(tokens, start):
            self.slots[table[p // bs]][p % bs] = tok


class TokenRunner:
    def __init__(self, kv: TokenKV):
        self.kv = kv

    def run(self, seqs, is_prefill: bool) -> torch.Tensor:
        rows = []
        for s in seqs:
            if not is_prefill:
                assert s.num_computed == s.num_tokens - 1, "decode computes exactly one new token"
            cached = self.kv.read(s.block_table, s.num_computed)
            assert cached == s.token_ids[:s.num_computed], f"{s.request_id}: KV cache corrupted"
            self.kv.write(s.block_table, s.num_computed, s.token_ids[s.num_computed:])
            rows.append(logits_for(self.kv.read(s.block_table, s.num_tokens)))
        return torch.stack(rows)


def make_engine(num_blocks: int, block_size: int, max_num_seqs: int, max_batched: int,
                max_model_len: int = 4096) -> Engine:
    model = SimpleNamespace(cfg=SimpleNamespace(max_position_embeddings=max_model_len, vocab_size=VOCAB),
                            device=torch.device("cpu"), dtype=torch.float32)

    def factory(model, config, max_model_len):
        return TokenRunner(TokenKV(num_blocks, block_size))

    cfg = EngineConfig(block_size=block_size, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=max_batched)
    return Engine(model, None, cfg, eos_token_ids=(EOS,), runner_factory=factory)


@dataclass
class Job:
    rid: str
    prompt: list[int]
    max_tokens: int
    priority: Priority
    seed: int | None  # None: greedy
    arrive_at: int  # engine step at which it is added
    abort_at: int | None  # engine step at which it is aborted, if any

    def request(self) -> Request:
        sp = SamplingParams(temperature=0.0 if self.seed is None else 0.9, seed=self.seed,
                            max_tokens=self.max_tokens)
        return Request(prompt_token_ids=list(self.prompt), sampling=sp, priority=self.priority,
                       request_id=self.rid)


def check_invariants(engine: Engine) -> None:
    """Every block is owned by a running sequence or free (cached contents included); every
    unfinished request sits in exactly one queue with the matching status."""
    sched, bm = engine.scheduler, engine.block_manager.pools[0]  # the one KV group's pool
    owners = [0] * bm.num_blocks
    for s in sched.running:
        assert s.status is SequenceStatus.RUNNING
        for b in s.block_table:
            owners[b] += 1
        assert len(s.block_table) >= bm.blocks_for(s.num_computed)
    for s in sched.waiting:
        assert s.status is SequenceStatus.WAITING and not s.block_table
    for b in bm.blocks:
        assert b.ref_count == owners[b.block_id], f"block {b.block_id} is orphaned or over-shared"
        assert (b.block_id in bm.free_ids) == (b.ref_count == 0)
    queued = [s.request_id for s in sched.running + sched.waiting]
    assert len(queued) == len(set(queued))
    assert set(queued) == set(engine.seqs), "a request is in neither queue"


def run(engine: Engine, jobs: list[Job], max_steps: int = 20_000) -> dict[str, object]:
    """Drive the engine to the end, checking the invariants and progress after every step."""
    results: dict[str, object] = {}
    pending = sorted(jobs, key=lambda j: j.arrive_at)
    aborts = {j.abort_at: [] for j in jobs if j.abort_at is not None}
    for j in jobs:
        if j.abort_at is not None:
            aborts[j.abort_at].append(j.rid)
    step = 0
    while pending or engine.has_unfinished():
        while pending and pending[0].arrive_at <= step:
            job = pending.pop(0)
            try:
                engine.add_request(job.request())
            except KVBudgetError as e:
                results[job.rid] = e
        for rid in aborts.get(step, []):
            out = engine.abort(rid)
            if out is not None:
                results[rid] = out
        running_before = set(map(id, engine.scheduler.running))
        tokens_before = engine.metrics.generation_tokens
        outs = engine.step()
        generated = engine.metrics.generation_tokens - tokens_before
        shrank = not running_before <= set(map(id, engine.scheduler.running))
        idle = not running_before and not outs and not engine.has_unfinished()
        assert generated > 0 or shrank or idle, f"step {step} made no progress"
        check_invariants(engine)
        for o in outs:
            if o.finished:
                results[o.request_id] = o
        step += 1
        assert step < max_steps, "the engine did not finish"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return results


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    n = draw(st.integers(1, 10))
    prefixes = [draw(st.lists(st.integers(1, VOCAB - 1), min_size=0, max_size=20)) for _ in range(2)]
    jobs = []
    for i in range(n):
        head = prefixes[draw(st.integers(0, 1))][:draw(st.integers(0, 20))]
        tail = draw(st.lists(st.integers(1, VOCAB - 1), min_size=1 if not head else 0, max_size=24))
        jobs.append(Job(f"r{i}", head + tail, draw(st.integers(1, 24)),
                        draw(st.sampled_from(list(Priority))),
                        draw(st.one_of(st.none(), st.integers(0, 99))),
                        draw(st.integers(0, 12)),
                        draw(st.one_of(st.none(), st.integers(0, 40))) if draw(st.booleans()) else None))
    longest = max(len(j.prompt) + j.max_tokens for j in jobs)
    # from a budget below one sequence's need (capped outputs, budget errors) to ample room
    num_blocks = draw(st.integers(1, -(-longest // block_size) * 3))
    return dict(block_size=block_size, num_blocks=num_blocks, jobs=jobs,
                max_num_seqs=draw(st.integers(1, 8)), max_batched=draw(st.integers(1, 64)))


def reference(jobs: list[Job]) -> dict[str, list[int]]:
    """Each job's output alone with ample memory, no aborts."""
    out = {}
    for job in jobs:
        alone = Job(job.rid, job.prompt, job.max_tokens, job.priority, job.seed, 0, None)
        engine = make_engine(64, 16, 1, 4096)
        out[job.rid] = run(engine, [alone])[job.rid].token_ids
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_every_run_finishes_with_the_unconstrained_outputs(w):
    engine = make_engine(w["num_blocks"], w["block_size"], w["max_num_seqs"], w["max_batched"])
    results = run(engine, w["jobs"])
    ref = reference(w["jobs"])
    capacity = w["num_blocks"] * w["block_size"]
    for job in w["jobs"]:
        res = results[job.rid]
        if len(job.prompt) + 1 > capacity:
            assert isinstance(res, KVBudgetError), "a prompt the cache cannot hold alone is refused"
            assert "--kv-cache-memory" in str(res) and res.needed_bytes > res.budget_bytes
            continue
        got = res.token_ids
        assert got == ref[job.rid][:len(got)], f"{job.rid}: output differs from the unconstrained run"
        if res.finish_reason == "abort":
            continue
        if len(got) < len(ref[job.rid]):  # cut short only by the KV capacity
            assert res.finish_reason == "length" and len(job.prompt) + len(got) == capacity


def test_three_started_requests_are_never_orphaned():
    """The reported livelock: 8 blocks, four requests; the first prefill admits three and the
    fourth does not fit. All four must finish."""
    engine = make_engine(num_blocks=8, block_size=16, max_num_seqs=64, max_batched=8192)
    jobs = [Job(f"r{i}", [1 + i] * 30, 40, Priority.BATCH, None, 0, None) for i in range(4)]
    results = run(engine, jobs)
    assert all(results[j.rid].finished for j in jobs)
    assert engine.metrics.num_preemptions > 0


def test_budget_error_names_the_budget_and_the_flag():
    engine = make_engine(num_blocks=1, block_size=16, max_num_seqs=4, max_batched=64)
    with pytest.raises(KVBudgetError, match=r"holds 16 tokens; this prompt needs 34 .*--kv-cache-memory"):
        engine.add_request(Request(prompt_token_ids=[5] * 33))


@pytest.mark.parametrize("seed", range(3))
def test_soak_a_tenth_of_the_memory(seed):
    """Many requests with a KV budget a tenth of what they need together."""
    rng = random.Random(seed)
    jobs = [Job(f"r{i}", [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 40))],
                rng.randrange(1, 40), rng.choice(list(Priority)), None, i // 4, None)
            for i in range(150)]
    need = sum(-(-(len(j.prompt) + j.max_tokens) // 4) for j in jobs)
    engine = make_engine(num_blocks=max(need // 10, 20), block_size=4, max_num_seqs=32,
                         max_batched=256)
    results = run(engine, jobs)
    ref = reference(jobs)
    assert {j.rid: results[j.rid].token_ids for j in jobs} == ref
    assert engine.metrics.num_preemptions > 0
