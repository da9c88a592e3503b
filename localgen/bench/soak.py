"""`localgen bench soak`: many requests through a KV cache far smaller than the batch needs.

Runs the same greedy requests twice on one loaded model: once with a KV cache that holds the
whole running batch (``max_num_seqs`` of the longest sequence, so nothing is ever preempted), once
with ``fraction`` of what the running batch needs (``max_num_seqs`` sequences of the mean length),
where the scheduler must preempt and recompute all the time. Every run must
finish, and every output must equal the unconstrained run's (PagedAttention §4.5: recomputation
changes when a token is computed, not what it is).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from itertools import cycle, islice
from pathlib import Path

from localgen.api import LLM, Request, SamplingParams
from localgen.bench.batch_bench import read_prompts
from localgen.runtime.engine import Engine, EngineConfig


@dataclass
class SoakRun:
    kv_cache_bytes: int
    kv_blocks: int
    seconds: float
    generated_tokens: int
    preemptions: int
    steps: int


@dataclass
class SoakResult:
    model: str
    num_requests: int
    max_tokens: int
    max_num_seqs: int
    fraction: float
    unconstrained: SoakRun
    constrained: SoakRun
    identical_outputs: int
    # request index -> first output position where the two runs differ
    mismatches: dict[int, int] = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


def _drive(engine: Engine, prompt_ids: list[list[int]], max_tokens: int) -> tuple[SoakRun, list]:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    ids = [engine.add_request(Request(prompt_token_ids=p, sampling=sp)) for p in prompt_ids]
    done, steps = {}, 0
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        steps += 1
    dt = time.perf_counter() - t0
    outs = [done[i] for i in ids]
    kv = engine.kv_cache
    run = SoakRun(kv.nbytes, engine.block_manager.num_blocks, dt, sum(map(len, outs)),
                  engine.metrics.num_preemptions, steps)
    return run, outs


def _engine(llm: LLM, kv_bytes: int, max_num_seqs: int) -> Engine:
    cfg = EngineConfig(max_num_seqs=max_num_seqs, kv_cache_memory=kv_bytes, cuda_graphs=False)
    return Engine(llm.engine.model, llm.tokenizer, cfg, tuple(sorted(llm.engine.eos_token_ids)))


def run(model: str | None, prompts_path: Path, num_requests: int = 1000, max_tokens: int = 32,
        max_num_seqs: int = 64, fraction: float = 0.1, dtype: str | None = "float32",
        log=print) -> SoakResult:
    """Both runs over ``num_requests`` chat prompts (the file's prompts repeated as needed).
    The constrained cache is never smaller than the longest request needs alone."""
    llm = LLM.load(model, device="cpu", dtype=dtype, max_num_seqs=1,
                   kv_cache_memory=16 << 20)  # this engine only tokenizes
    prompts = list(islice(cycle(read_prompts(prompts_path, num_requests)), num_requests))
    prompt_ids = [llm.engine.tokenize(Request(messages=[{"role": "user", "content": p}]))
                  for p in prompts]
    per_token, bs = llm.kv_bytes_per_token, llm.block_size
    lengths = [len(p) + max_tokens for p in prompt_ids]
    full = max_num_seqs * max(lengths) * per_token
    # the running batch's need is max_num_seqs sequences of the mean length; never less than the
    # whole blocks the longest request needs alone (with fewer it would stop at the cache's
    # capacity, and its output would be cut short rather than soaked)
    small_tokens = max(int(fraction * max_num_seqs * sum(lengths) / len(lengths)),
                       -(-max(lengths) // bs) * bs)
    small = small_tokens * per_token
    log(f"{num_requests} requests, max_tokens {max_tokens}: KV cache {full / 2**20:.1f} MiB, "
        f"then {small / 2**20:.1f} MiB")
    free, ref = _drive(_engine(llm, full, max_num_seqs), prompt_ids, max_tokens)
    log(f"unconstrained: {free.seconds:.1f} s, {free.preemptions} preemptions")
    tight, got = _drive(_engine(llm, small, max_num_seqs), prompt_ids, max_tokens)
    log(f"constrained: {tight.seconds:.1f} s, {tight.preemptions} preemptions")
    mismatches = {i: _first_difference(a, b) for i, (a, b) in enumerate(zip(ref, got)) if a != b}
    return SoakResult(llm.model_name, num_requests, max_tokens, max_num_seqs, fraction, free, tight,
                      num_requests - len(mismatches), mismatches)


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

