"""Where a decode step's time goes on CUDA (issue 7), for a dummy-weight preset or a model file.

Builds the model as ``localgen bench decode`` does (dummy weights of a real shape, or the file:
a GGUF, a Hugging Face folder), prefills ``--batch`` prompts, runs decode steps through the
engine, then reports:

* the host-side phases of one engine step (schedule, input fill, graph replay launch, sampling
  with its device sync, advance), in µs, median of ``--steps`` steps;
* the GPU kernels of one decode-graph replay from ``torch.profiler`` (CUPTI sees the kernels
  inside a graph), grouped by kernel name, with the µs per step and the share of the step,
  beside the replay's own time (CUDA events): the difference is the GPU's time between kernels.

    python3 scripts/decode_profile.py --model llama-2-7b --batch 1 --out prof.txt
    python3 scripts/decode_profile.py --model m7b.gguf --batch 16 --json prof.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build(spec: str, batch: int, max_model_len: int):
    from localgen.api import LLM

    if Path(spec).exists():
        return LLM.load(spec, device="cuda", max_num_seqs=max(batch, 1), max_model_len=max_model_len)
    from localgen.models.dummy import DummyStore
    from localgen.models.model import family_of
    from localgen.policy.presets import preset_config
    from localgen.runtime.engine import EngineConfig

    cfg = preset_config(spec)
    per_tok = cfg.kv_bytes_per_token(2)
    ecfg = EngineConfig(max_num_seqs=max(batch, 1), max_model_len=max_model_len,
                        kv_cache_memory=batch * (max_model_len + 32) * per_tok)
    store = DummyStore(cfg, family_of(cfg), dtype=torch.bfloat16)
    return LLM.from_parts(cfg, store, None, ecfg, device="cuda", dtype=torch.bfloat16, name=spec)


@torch.inference_mode()
def host_phases(llm, steps: int) -> dict[str, float]:
    """Median µs of each phase of ``steps`` decode steps, timed around the engine's pieces."""
    from localgen.runtime.sampling import sample

    eng = llm.engine
    times = defaultdict(list)
    for _ in range(steps):
        t0 = time.perf_counter()
        batch = eng.scheduler.schedule()
        t1 = time.perf_counter()
        runner, seqs = eng.runner, batch.seqs
        n = len(seqs)
        g = runner.graph_for(seqs)
        runner._fill(g, seqs)
        t2 = time.perf_counter()
        g.graph.replay()
        t3 = time.perf_counter()
        torch.cuda.synchronize()
        t4 = time.perf_counter()
        toks = sample(g.logits[:n], [s.sampling for s in seqs], [s.token_ids for s in seqs],
                      [s.generator for s in seqs])
        t5 = time.perf_counter()
        for s, tok in zip(seqs, toks):
            eng._advance(s, tok, t5)
        t6 = time.perf_counter()
        for k, a, z in (("schedule", t0, t1), ("fill", t1, t2), ("replay launch", t2, t3),
                        ("gpu wait", t3, t4), ("sample", t4, t5), ("advance", t5, t6)):
            times[k].append((z - a) * 1e6)
    return {k: statistics.median(v) for k, v in times.items()}


def kernel_table(llm, replays: int) -> list[tuple[str, float, int]]:
    """(kernel name, µs per replay, launches per replay), longest first."""
    from torch.profiler import ProfilerActivity, profile

    g = list(llm.engine.runner.graphs.values())[-1]
    for _ in range(3):
        g.graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            g.graph.replay()
        torch.cuda.synchronize()
    agg = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            a = agg[e.name[:90]]
            a[0] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            a[1] += 1
    rows = [(k, v[0] / replays, round(v[1] / replays)) for k, v in agg.items()]
    return sorted(rows, key=lambda r: -r[1])


def main() -> None:
    from localgen.api import Request, SamplingParams

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-2-7b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default=None, help="the replay time and the kernel table, as JSON")
    a = ap.parse_args()
    llm = build(a.model, a.batch, a.prompt_len + 2 * a.steps + 64)
    g = torch.Generator().manual_seed(0)
    top = min(30000, llm.config.vocab_size)  # random prompt ids of any vocabulary
    sp = SamplingParams(temperature=0.0, max_tokens=2 * a.steps + 40, ignore_eos=True)
    # warm-up generation (captures the graph bucket), then a fresh batch left mid-decode
    llm.generate([Request(prompt_token_ids=torch.randint(10, top, (a.prompt_len,), generator=g).tolist(),
                          sampling=SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
                  for _ in range(a.batch)])
    for _ in range(a.batch):
        llm.engine.add_request(Request(prompt_token_ids=torch.randint(10, top, (a.prompt_len,),
                                                                      generator=g).tolist(), sampling=sp))
    while not any(s.num_output_tokens >= 2 for s in llm.engine.seqs.values()):
        llm.engine.step()
    lines = [f"{a.model} batch {a.batch} prompt {a.prompt_len} on {torch.cuda.get_device_name()}"]
    ph = host_phases(llm, a.steps)
    lines.append("host phases of one decode step (median µs): " +
                 ", ".join(f"{k} {v:.1f}" for k, v in ph.items()))
    from localgen.bench.decode_bench import graph_replay_ms

    replay_us = graph_replay_ms(llm) * 1e3
    rows = kernel_table(llm, 10)
    total = sum(r[1] for r in rows)
    lines.append(f"GPU kernels of one replay: {total:.1f} µs in {sum(r[2] for r in rows)} launches; "
                 f"the replay {replay_us:.1f} µs")
    for name, us, n in rows[:25]:
        lines.append(f"{us:9.1f} us {100 * us / total:5.1f}%  x{n:<4d} {name}")
    text = "\n".join(lines)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    if a.json:
        Path(a.json).write_text(json.dumps({
            "model": Path(a.model).name, "batch": a.batch, "host_phases_us": ph,
            "replay_us": replay_us, "kernels_us": total,
            "kernels": [{"name": n, "us": us, "launches": c} for n, us, c in rows]}, indent=1))


if __name__ == "__main__":
    main()
