"""`localgen bench batch`: generation throughput of `localgen batch`-style work vs Hugging Face
transformers ``generate`` on the same prompts, weights, settings and machine, in one run.

Both sides get the same prompt token ids (the model's chat template), greedy decoding, the same
``max_tokens`` and EOS ids. Tokens/s counts generated tokens (EOS included) over generation wall
time, model loading excluded.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from localgen.api import LLM, Request, SamplingParams


@dataclass
class SideResult:
    name: str
    seconds: float
    generated_tokens: int
    tokens_per_s: float
    outputs: list[list[int]]


@dataclass
class BatchBenchResult:
    model: str
    num_prompts: int
    max_tokens: int
    localgen: SideResult
    transformers: SideResult | None
    ratio: float | None  # localgen tokens/s ÷ transformers tokens/s
    identical_outputs: int | None  # prompts whose greedy tokens agree exactly
    threads: int

    def to_json(self) -> dict:
        d = asdict(self)
        for side in ("localgen", "transformers"):
            if d[side]:
                d[side].pop("outputs")
        return d


def read_prompts(path: Path, limit: int) -> list[str]:
    """``prompt`` fields (or the first user turn of MT-Bench ``turns``) of the first ``limit`` lines."""
    out = []
    for line in path.read_text(encoding="utf-8-sig").splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        out.append(rec["prompt"] if "prompt" in rec else rec["turns"][0])
        if len(out) == limit:
            break
    return out


def run_localgen(llm: LLM, prompt_ids: list[list[int]], max_tokens: int) -> SideResult:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    t0 = time.perf_counter()
    outs = llm.generate([Request(prompt_token_ids=p, sampling=sp) for p in prompt_ids])
    dt = time.perf_counter() - t0
    n = sum(o.completion_tokens for o in outs)
    return SideResult("localgen", dt, n, n / dt, [o.token_ids for o in outs])


def load_transformers_model(llm: LLM):
    """The same weights through transformers (GGUF dequantized by transformers itself), fp32."""
    from transformers import AutoModelForCausalLM

    src = llm.source
    if src is None:
        raise ValueError("the transformers peer needs a model loaded by LLM.load")
    path = Path(src.path)
    if path.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                    dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def run_transformers(model, prompt_ids: list[list[int]], max_tokens: int, eos_ids: list[int],
                     pad_id: int, batch_size: int) -> SideResult:
    """Static batches of ``batch_size``, left-padded, greedy, stopping at EOS."""
    outputs: list[list[int]] = []
    t0 = time.perf_counter()
    for i in range(0, len(prompt_ids), batch_size):
        chunk = prompt_ids[i:i + batch_size]
        width = max(map(len, chunk))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.inference_mode():
            gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                                 do_sample=False, eos_token_id=eos_ids, pad_token_id=pad_id)
        for row in gen[:, width:].tolist():
            outputs.append(_until_eos(row, eos_ids))
    dt = time.perf_counter() - t0
    n = sum(map(len, outputs))
    return SideResult("transformers", dt, n, n / dt, outputs)


def _until_eos(row: list[int], eos_ids: list[int]) -> list[int]:
    for j, tok in enumerate(row):
        if tok in eos_ids:
            return row[:j + 1]
    return row


def run(model: str | None, prompts_path: Path, limit: int, max_tokens: int, *,
        peer: bool = True, peer_batch_size: int = 16, max_num_seqs: int = 64,
        kv_cache_memory: int | None = None, dtype: str | None = "float32",
        log=print) -> BatchBenchResult:
    """``dtype`` float32 matches the transformers peer exactly (identical greedy outputs expected);
    None takes localgen's default (bf16 + int4 kernel for a Q4_1 GGUF on bf16-capable CPUs)."""
    llm = LLM.load(model, device="cpu", max_num_seqs=max_num_seqs, kv_cache_memory=kv_cache_memory,
                   dtype=dtype)
    log(f"localgen dtype: {llm.engine.model.dtype}")
    prompts = read_prompts(prompts_path, limit)
    prompt_ids = [llm.engine.tokenize(Request(messages=[{"role": "user", "content": p}]))
                  for p in prompts]
    log(f"localgen: {len(prompts)} prompts, max_tokens {max_tokens}, max_num_seqs {max_num_seqs}")
    ours = run_localgen(llm, prompt_ids, max_tokens)
    log(f"localgen: {ours.generated_tokens} tokens in {ours.seconds:.1f} s = {ours.tokens_per_s:.1f} tokens/s")
    theirs = ratio = same = None
    if peer:
        eos = sorted(llm.engine.eos_token_ids)
        pad = llm.tokenizer.pad_token_id if llm.tokenizer.pad_token_id is not None else eos[0]
        theirs = run_transformers(load_transformers_model(llm), prompt_ids, max_tokens, eos, pad,
                                  peer_batch_size)
        log(f"transformers: {theirs.generated_tokens} tokens in {theirs.seconds:.1f} s = "
            f"{theirs.tokens_per_s:.1f} tokens/s")
        ratio = ours.tokens_per_s / theirs.tokens_per_s
        same = sum(a == b for a, b in zip(ours.outputs, theirs.outputs))
    return BatchBenchResult(llm.model_name, len(prompts), max_tokens, ours, theirs, ratio, same,
                            torch.get_num_threads())
