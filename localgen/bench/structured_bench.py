"""`localgen bench structured`: what a response_format costs. The same prompts run twice in one
process, free and constrained to a JSON schema, each as one continuous batch; the peer of the
constrained run is the free one (same engine, same batch size). Also times the schema's grammar
compile, first and cached.

    python -m localgen.bench.structured_bench --concurrency 16 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from typing import Callable

# A bounded record, so most constrained answers complete inside a modest max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "genre": {"enum": ["drama", "comedy", "thriller", "documentary"]},
        "cast": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 3},
        "rating": {"type": "number", "minimum": 0, "maximum": 10},
    },
    "required": ["title", "year", "genre", "cast", "rating"],
}
TOPICS = ["a film about the sea", "a film about a chess player", "a comedy set in Paris",
          "a documentary about bees", "a thriller on a train", "a drama about two sisters",
          "a film about a lighthouse keeper", "a comedy about a wedding"]


@dataclass
class Run:
    requests: int
    output_tokens: int
    seconds: float
    finished_by_stop: int

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class Result:
    model: str
    concurrency: int
    max_tokens: int
    compile_first_s: float
    compile_cached_s: float
    free: Run
    constrained: Run
    valid_json: int

    @property
    def ratio(self) -> float:
        """Constrained output tokens/s over free output tokens/s."""
        return self.constrained.tokens_per_s / self.free.tokens_per_s if self.free.tokens_per_s else 0.0

    def to_json(self) -> dict:
        return asdict(self) | {"ratio": self.ratio, "free_tokens_per_s": self.free.tokens_per_s,
                               "constrained_tokens_per_s": self.constrained.tokens_per_s}


def _requests(n: int, max_tokens: int, response_format: dict | None, tag: str):
    from localgen.runtime.request import Request, SamplingParams

    return [Request(messages=[{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} "
                                                           f"as a JSON record."}],
                    sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                            response_format=response_format),
                    request_id=f"{tag}-{i}") for i in range(n)]


def _timed(llm, reqs) -> tuple[Run, list]:
    t0 = time.perf_counter()
    outs = llm.generate(reqs)
    secs = time.perf_counter() - t0
    return Run(len(outs), sum(o.completion_tokens for o in outs), secs,
               sum(o.finish_reason == "stop" for o in outs)), outs


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def load(model: str | None, concurrency: int, log: Callable[[str], None] = print):
    from localgen.api import LLM

    log(f"loading {model or 'the embedded model'} ...")
    return LLM.load(model, max_num_seqs=concurrency)


def run(llm, concurrency: int, max_tokens: int, log: Callable[[str], None] = print) -> Result:
    """Both runs on a loaded ``LLM`` (its max_num_seqs should hold ``concurrency``)."""
    rf = {"type": "json_schema", "json_schema": {"name": "film", "schema": SCHEMA}}
    t0 = time.perf_counter()
    llm.engine.grammars.compile(rf)  # the tokenizer's vocabulary is read once, here
    t1 = time.perf_counter()
    llm.engine.grammars.compile(rf)
    t2 = time.perf_counter()
    _timed(llm, _requests(min(concurrency, 2), 4, None, "warmup"))
    log(f"free run: {concurrency} requests, max_tokens {max_tokens}")
    free, _ = _timed(llm, _requests(concurrency, max_tokens, None, "free"))
    log("constrained run: the same prompts with a json_schema response_format")
    constrained, outs = _timed(llm, _requests(concurrency, max_tokens, rf, "json"))
    return Result(getattr(llm, "model_name", "?"), concurrency, max_tokens,
                  t1 - t0, t2 - t1, free, constrained, sum(_is_json(o.text) for o in outs))


def report(res: Result) -> str:
    f, c = res.free, res.constrained
    return "\n".join([
        f"model {res.model}: {res.concurrency} requests in one batch, max_tokens {res.max_tokens}",
        f"grammar compile   first {res.compile_first_s * 1e3:8.1f} ms   cached "
        f"{res.compile_cached_s * 1e3:.3f} ms",
        f"free          {f.tokens_per_s:8.1f} tokens/s ({f.output_tokens} tokens, {f.seconds:.1f} s)",
        f"constrained   {c.tokens_per_s:8.1f} tokens/s ({c.output_tokens} tokens, {c.seconds:.1f} s, "
        f"{res.valid_json}/{c.requests} parse as JSON, {c.finished_by_stop} complete)",
        f"ratio         {res.ratio:8.2f}x (constrained / free output tokens/s)",
    ])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    llm = load(args.model, args.concurrency)
    print(report(run(llm, args.concurrency, args.max_tokens)))


if __name__ == "__main__":
    main()
