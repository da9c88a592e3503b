"""`localgen bench accuracy`: what 4-bit compression (FlexGen §5) costs in accuracy on a real model.

Compares configurations of the same model, loaded with ``LLM.load`` (default: the embedded
SmolLM2-135M-Instruct, whose GGUF weights are Q4_1; "uncompressed" means those weights dequantized
to fp32, the plain path):
- ``fp32``: the plain resident path;
- ``w4+kv4``: 4-bit weights (re-quantized to FlexGen's g=64 along output channels) + 4-bit KV
  (g=64 along head_dim) through the offloading runtime;
- ``w4native+kv4`` (``--gguf-native``): Q4_1 weights imported bit-exactly + 4-bit KV.

Metrics:
- WikiText-2 perplexity over the first ``max_tokens`` tokens of ``wikitext2_test.raw``, read as
  stored (the raw file's own "\\n" line ends, " = Title = " headers kept; no re-joining), tokenized
  once without special tokens, scored in non-overlapping windows of ``window`` tokens (each window
  from an empty cache; the first token of each window is not scored);
- LAMBADA last-word accuracy on the first ``max_examples`` lines of ``lambada_test.jsonl``: the
  context is the text up to the last space, the target the last word with its leading space; an
  example counts when greedy argmax predicts every target token.
With compressed KV, the prompt's own attention already reads the 4-bit cache (stricter than
compressing only for later decode steps).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from localgen.bench.data import data_dir

DATA = data_dir()


@dataclass
class AccuracyResult:
    config: str
    perplexity: float
    scored_tokens: int
    lambada_accuracy: float
    lambada_examples: int
    seconds: float


@torch.inference_mode()
def full_logits(llm, ids: list[int]) -> torch.Tensor:
    """float32 logits ``[len(ids), vocab]`` of one sequence, from an empty cache (blocks 0..n-1)."""
    from localgen.kv.attention import AttentionMetadata

    eng = llm.engine
    bs, dev = eng.config.block_size, eng.model.device
    n = len(ids)
    nb = -(-n // bs)
    if nb > eng.kv_cache.num_blocks:
        raise ValueError(f"{n} tokens need {nb} KV blocks; the cache has {eng.kv_cache.num_blocks}")
    t = lambda x: torch.tensor(x, dtype=torch.long, device=dev)  # noqa: E731
    meta = AttentionMetadata(True, t(list(range(n))), t([list(range(nb))]), t([n]), [n], [n])
    h = eng.model.forward(t(ids), t(list(range(n))), eng.kv_cache.views, meta)
    return eng.model.logits(h)


def perplexity(llm, tokens: list[int], window: int) -> tuple[float, int]:
    nll, count = 0.0, 0
    for s in range(0, len(tokens) - 1, window):
        chunk = tokens[s:s + window]
        if len(chunk) < 2:
            break
        logp = torch.log_softmax(full_logits(llm, chunk)[:-1], -1)
        tgt = torch.tensor(chunk[1:], device=logp.device)
        nll -= float(logp.gather(1, tgt[:, None]).sum())
        count += len(chunk) - 1
    return math.exp(nll / count), count


def lambada(llm, tok, examples: list[str]) -> float:
    hits = 0
    for text in examples:
        ctx, word = text.rsplit(" ", 1)
        c = tok(ctx, add_special_tokens=False)["input_ids"]
        full = tok(ctx + " " + word, add_special_tokens=False)["input_ids"]
        if full[:len(c)] != c:  # tokenization merged across the boundary: score the tail of full
            c = full[:len(c) - 1]
        target = full[len(c):]
        logits = full_logits(llm, full[:-1])
        pred = logits[len(c) - 1:].argmax(-1).tolist()
        hits += pred == target
    return hits / len(examples)


def run(model: str | None = None, *, max_tokens: int = 2048, window: int = 512, max_examples: int = 200,
        configs: tuple[str, ...] = ("fp32", "w4+kv4"), device: str = "cpu", data_dir: Path = DATA,
        log=print) -> list[AccuracyResult]:
    from localgen.api import LLM
    from localgen.models.sources import resolve_model
    from localgen.policy.policy import Policy
    from localgen.runtime.engine import EngineConfig

    src = resolve_model(model)
    tok = src.tokenizer
    text = (Path(data_dir) / "wikitext2_test.raw").read_text(encoding="utf-8")
    tokens = tok(text[: max_tokens * 8], add_special_tokens=False)["input_ids"][:max_tokens]
    lines = (Path(data_dir) / "lambada_test.jsonl").read_text(encoding="utf-8").splitlines()
    examples = [json.loads(x)["text"] for x in lines[:max_examples]]
    longest = max([window] + [len(tok(e, add_special_tokens=False)["input_ids"]) for e in examples])
    policies = {"fp32": None,
                "w4+kv4": Policy(compress_weight=True, compress_cache=True),
                "w4": Policy(compress_weight=True), "kv4": Policy(compress_cache=True),
                "w4native+kv4": Policy(compress_weight=True, compress_cache=True)}
    out = []
    for name in configs:
        t0 = time.perf_counter()
        ecfg = EngineConfig(block_size=16, max_num_seqs=1, enable_prefix_caching=False,
                            kv_cache_memory=src.config.kv_bytes_per_token(4) * (longest + 32))
        llm = LLM.from_parts(src.config, src.weights, tok, ecfg, device=device, dtype=torch.float32,
                             name=src.name, policy=policies[name], gguf_native=name.startswith("w4native"))
        ppl, n = perplexity(llm, tokens, window)
        acc = lambada(llm, tok, examples)
        r = AccuracyResult(name, ppl, n, acc, len(examples), time.perf_counter() - t0)
        log(f"{name:14s} WikiText-2 ppl {ppl:8.3f} ({n} tokens)   LAMBADA acc {100 * acc:5.1f}% "
            f"({len(examples)} examples)   {r.seconds:.0f} s")
        out.append(r)
    base = out[0]
    for r in out[1:]:
        log(f"{r.config:14s} vs {base.config}: perplexity {100 * (r.perplexity / base.perplexity - 1):+.2f}%, "
            f"LAMBADA {100 * (r.lambada_accuracy - base.lambada_accuracy):+.1f} points")
    return out


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="4-bit compression accuracy (WikiText-2 ppl, LAMBADA)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--max-examples", type=int, default=200)
    ap.add_argument("--configs", default="fp32,w4+kv4")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    res = run(a.model, max_tokens=a.max_tokens, window=a.window, max_examples=a.max_examples,
              configs=tuple(a.configs.split(",")))
    if a.out:
        Path(a.out).write_text(json.dumps([asdict(r) for r in res], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
