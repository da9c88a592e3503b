"""`localgen bench accuracy`: what 4-bit compression (FlexGen §5) costs in accuracy on a real model.

Compares configurations of the same model, loaded like ``LLM.load`` (default: the embedded
SmolLM2-135M-Instruct, whose GGUF weights are Q4_1; "uncompressed" means those weights dequantized
to fp32, the plain path), all in float32 on ``device``:

- ``fp32``: the plain resident path (the baseline every other row is compared with);
- ``w4``: 4-bit weights through the offloading runtime. For a GGUF model its Q4_1 tensors are
  imported bit-exactly (32-groups along the input channels, ``localgen.quant.gguf_import``):
  re-quantizing weights that are already 4-bit onto another grid would quantize them twice. Other
  models: FlexGen's groups of 64 along the output channels;
- ``w4g64``: FlexGen's g=64 re-quantization forced, also for a GGUF model (what double
  quantization costs);
- ``kv4``: 4-bit KV (groups of 64 along head_dim) with the runtime's defaults: K/V rotated by a
  Hadamard matrix before quantizing (QuaRot) and each query's own block read in fp from the
  recent-block pool (``localgen.runtime.offload.kv``);
- ``kv4-norot`` / ``kv4-norecent`` / ``kv4-plain``: the same without the rotation / without the
  recent-block pool / without either (FlexGen's plain 4-bit KV);
- ``w4+kv4`` (the target row), ``w4g64+kv4``: both compressions.

Metrics:
- WikiText-2 perplexity over the first ``max_tokens`` tokens of ``wikitext2_test.raw``, read as
  stored (the raw file's own "\\n" line ends, " = Title = " headers kept; no re-joining), tokenized
  once without special tokens, scored in non-overlapping windows of ``window`` tokens (each window
  from an empty cache; the first token of each window is not scored);
- LAMBADA last-word accuracy on the first ``max_examples`` lines of ``lambada_test.jsonl``: the
  context is the text up to the last space, the target the last word with its leading space; an
  example counts when greedy argmax predicts every target token. Every config scores the same
  examples, so differences are paired: ``lambada_lost``/``lambada_gained`` count the examples the
  baseline got right and the config wrong, and the reverse.
With compressed KV every prompt token's attention already reads the compressed cache, as it would
when decoding token by token (stricter than compressing only for later decode steps).

Targets (issue 6): ``w4+kv4`` within +3% of the baseline's perplexity and within 1 point of its
LAMBADA accuracy; ``run`` logs PASS/FAIL for every compressed row.
"""

from __future__ import annotations

import json
import math
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from localgen.bench.data import data_dir
from localgen.fileio import atomic_write_json

DATA = data_dir()
PPL_TARGET = 0.03  # relative perplexity increase allowed
LAMBADA_TARGET = 0.01  # LAMBADA accuracy drop allowed (1 point)

# name -> (compress_weight, compress_cache, gguf_native, kv rotation, kv recent-block pool)
CONFIGS = {
    "fp32": (False, False, True, True, True),
    "w4": (True, False, True, True, True),
    "w4g64": (True, False, False, True, True),
    "kv4": (False, True, True, True, True),
    "kv4-norot": (False, True, True, False, True),
    "kv4-norecent": (False, True, True, True, False),
    "kv4-plain": (False, True, True, False, False),
    "w4+kv4": (True, True, True, True, True),
    "w4g64+kv4": (True, True, False, True, True),
}
ALIASES = {"w4native": "w4", "w4native+kv4": "w4+kv4"}


@dataclass
class AccuracyResult:
    config: str
    perplexity: float
    scored_tokens: int
    lambada_accuracy: float
    lambada_examples: int
    seconds: float
    ppl_delta_pct: float = 0.0
    lambada_delta_points: float = 0.0
    lambada_lost: int = 0
    lambada_gained: int = 0
    passed: bool | None = None
    weights: str = ""  # "dense", "gguf-native" (Q4_1 kept bit-exact), "int4-g64" (re-quantized)
    kv_cache: str = ""  # "dense", or "int4" plus "+rotation" / "+recent-block"


@torch.inference_mode()
def full_logits(llm, ids: list[int]) -> torch.Tensor:
    """float32 logits ``[len(ids), vocab]`` of one sequence, from an empty cache (blocks 0..n-1).
    Raises ValueError when the KV cache has too few blocks for ``len(ids)`` tokens."""
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
    return eng.model.logits(h).float()


def perplexity(llm, tokens: list[int], window: int) -> tuple[float, int]:
    """(exp of the mean next-token NLL, number of scored tokens) over windows of ``window``."""
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


def lambada_hits(llm, tok, examples: list[str]) -> list[bool]:
    """Per example: does greedy argmax predict every token of the last word?"""
    hits = []
    for text in examples:
        ctx, word = text.rsplit(" ", 1)
        c = tok(ctx, add_special_tokens=False)["input_ids"]
        full = tok(ctx + " " + word, add_special_tokens=False)["input_ids"]
        if full[:len(c)] != c:  # tokenization merged across the boundary: score the tail of full
            c = full[:len(c) - 1]
        target = full[len(c):]
        logits = full_logits(llm, full[:-1])
        hits.append(logits[len(c) - 1:].argmax(-1).tolist() == target)
    return hits


def lambada(llm, tok, examples: list[str]) -> float:
    """LAMBADA last-word accuracy in [0, 1]."""
    hits = lambada_hits(llm, tok, examples)
    return sum(hits) / len(hits)


def build(src, name: str, longest: int, device: str = "cpu"):
    """The ``LLM`` of config ``name`` (a key of ``CONFIGS``; ValueError otherwise) over ``src``,
    one sequence, block size 16, a KV cache for ``longest`` tokens."""
    from localgen.api import LLM
    from localgen.policy.policy import Policy
    from localgen.runtime.engine import EngineConfig

    key = ALIASES.get(name, name)
    if key not in CONFIGS:
        raise ValueError(f"unknown config {name!r}; choose from {', '.join(CONFIGS)}")
    cw, cc, native, rotate, recent = CONFIGS[key]
    policy = Policy(compress_weight=cw, compress_cache=cc) if (cw or cc) else None
    ecfg = EngineConfig(block_size=16, max_num_seqs=1, enable_prefix_caching=False,
                        kv_cache_memory=src.config.kv_bytes_per_token(4) * (longest + 32))
    llm = LLM.from_parts(src.config, src.weights, src.tokenizer, ecfg, device=device,
                         dtype=torch.float32, name=src.name, policy=policy, gguf_native=native)
    if cc:
        for view in llm.engine.runner.kv.views:  # the cache is empty: safe to switch
            if not rotate:
                view.set_rotation(None)
            if not recent:
                view.recent_blocks = 0
    return llm


def run(model: str | None = None, *, max_tokens: int = 8192, window: int = 512, max_examples: int = 500,
        configs: tuple[str, ...] = ("fp32", "w4", "kv4", "w4+kv4"), device: str = "cpu",
        data_dir: Path = DATA, log=print) -> list[AccuracyResult]:
    """Score every config (the first is the baseline); returns one ``AccuracyResult`` each, with
    deltas against the baseline and ``passed`` (None for the baseline and uncompressed rows).
    Raises ValueError for an unknown config name (before any work)."""
    from localgen.models.sources import resolve_model

    bad = [c for c in configs if ALIASES.get(c, c) not in CONFIGS]
    if bad:
        raise ValueError(f"unknown config {bad[0]!r}; choose from {', '.join(CONFIGS)}")

    src = resolve_model(model)
    tok = src.tokenizer
    text = (Path(data_dir) / "wikitext2_test.raw").read_text(encoding="utf-8")
    tokens = tok(text[: max_tokens * 8], add_special_tokens=False)["input_ids"][:max_tokens]
    lines = (Path(data_dir) / "lambada_test.jsonl").read_text(encoding="utf-8").splitlines()
    examples = [json.loads(x)["text"] for x in lines[:max_examples]]
    longest = max([window] + [len(tok(e, add_special_tokens=False)["input_ids"]) for e in examples])
    out, base_hits = [], None
    for name in configs:
        t0 = time.perf_counter()
        llm = build(src, name, longest, device)
        ppl, n = perplexity(llm, tokens, window)
        hits = lambada_hits(llm, tok, examples)
        r = AccuracyResult(name, ppl, n, sum(hits) / len(hits), len(hits), time.perf_counter() - t0)
        cw, cc, native, rotate, recent = CONFIGS[ALIASES.get(name, name)]
        r.weights = ("dense" if not cw else "gguf-native" if native and hasattr(src.weights, "reader")
                     else "int4-g64")
        r.kv_cache = "dense" if not cc else "int4" + "+rotation" * rotate + "+recent-block" * recent
        if base_hits is None:
            base, base_hits = r, hits
        else:
            r.ppl_delta_pct = 100 * (r.perplexity / base.perplexity - 1)
            r.lambada_delta_points = 100 * (r.lambada_accuracy - base.lambada_accuracy)
            r.lambada_lost = sum(b and not h for b, h in zip(base_hits, hits))
            r.lambada_gained = sum(h and not b for b, h in zip(base_hits, hits))
            if CONFIGS[ALIASES.get(name, name)][:2] != (False, False):
                r.passed = (r.ppl_delta_pct <= 100 * PPL_TARGET
                            and r.lambada_delta_points >= -100 * LAMBADA_TARGET)
        log(f"{name:13s} WikiText-2 ppl {ppl:8.3f} ({n} tokens)   LAMBADA acc {100 * r.lambada_accuracy:5.1f}% "
            f"({len(hits)} examples)   {r.seconds:.0f} s")
        out.append(r)
        del llm
    log(f"\nvs {out[0].config} (targets: perplexity <= +{100 * PPL_TARGET:.0f}%, "
        f"LAMBADA >= -{100 * LAMBADA_TARGET:.0f} point)")
    for r in out[1:]:
        verdict = "" if r.passed is None else ("PASS" if r.passed else "FAIL")
        log(f"{r.config:13s} perplexity {r.ppl_delta_pct:+6.2f}%   LAMBADA {r.lambada_delta_points:+5.1f} points "
            f"(-{r.lambada_lost}/+{r.lambada_gained} of {r.lambada_examples} paired)   {verdict}")
    return out


def main(argv=None) -> int:
    """CLI; exit status 0, or 1 when a compressed config misses a target (``--check``)."""
    import argparse

    ap = argparse.ArgumentParser(description="4-bit compression accuracy (WikiText-2 ppl, LAMBADA)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--max-examples", type=int, default=500)
    ap.add_argument("--configs", default="fp32,w4,kv4,w4+kv4",
                    help=f"comma-separated, the first is the baseline: {', '.join(CONFIGS)}")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None, help="write the results (JSON) here")
    ap.add_argument("--check", action="store_true", help="exit 1 when a compressed config fails")
    a = ap.parse_args(argv)
    args = dict(max_tokens=a.max_tokens, window=a.window, max_examples=a.max_examples,
                configs=tuple(c.strip() for c in a.configs.split(",")), device=a.device)
    res = run(a.model, **args)
    if a.out:
        import shlex
        import sys

        cmd = "python -m localgen.bench.accuracy " + shlex.join(sys.argv[1:] if argv is None else argv)
        doc = {"command": cmd, "model": a.model or "embedded (SmolLM2-135M-Instruct Q4_1 GGUF)",
               "settings": args, "dtype": "float32", "torch": torch.__version__,
               "machine": platform.processor() or platform.machine(),
               "targets": {"ppl_delta_pct_max": 100 * PPL_TARGET,
                           "lambada_delta_points_min": -100 * LAMBADA_TARGET},
               "results": [asdict(r) for r in res]}
        atomic_write_json(a.out, doc)
    return 1 if a.check and any(r.passed is False for r in res) else 0


if __name__ == "__main__":
    raise SystemExit(main())
