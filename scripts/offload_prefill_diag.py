"""Why an offloaded prefill takes longer than its terms measured alone: one model build, then

1. prefills in a row (the first one cold: warmed up on 8-token prompts only, as the bench did
   before the seventh session), with the
   activation copies on side streams (``ActivationTier.overlap_enabled``) on and off, alternating;
2. the bench's timed run (each term alone, ``Timers``) for the per-term breakdown;
3. a torch.profiler trace of one warm prefill per setting: busy time per CUDA stream, copies by
   direction, top kernels, the runtime calls that block the host or allocate; the trace of the
   first setting is written to ``--trace`` (gzip) for a closer look.

    python scripts/offload_prefill_diag.py --preset opt-30b --gpu-memory 16GiB \
        --policy 8,7,0,100,99,1,0,100,w4,kv4 [--trace out.json.gz]

Written for the OPT-30B 4-bit 8 x 7 prefill on an H100 (7.6 s measured, 3.42 s predicted,
FlexGen §4.3's cost model; docs/results/offload_h100.md, seventh session).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_selftest import _alias_kernels  # noqa: E402
from offload_profile import alloc_counts  # noqa: E402

BLOCKING = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMalloc",
            "cudaFree", "cudaHostAlloc", "cudaHostRegister", "cuMemMap", "cuMemCreate", "cuMemUnmap",
            "cuMemRelease", "cuMemSetAccess", "cudaMemcpy")


def build(preset: str, spec: str, gpu_memory, prompt_len: int):
    from localgen.bench.offload_bench import generate_random, policy_from_args, policy_llm
    from localgen.policy.presets import preset_config

    cfg = preset_config(preset)
    pol = policy_from_args(spec)
    t0 = time.perf_counter()
    llm = policy_llm(cfg, pol, pol.bls, prompt_len, 2, gpu_memory=gpu_memory, name="diag",
                     offload_dir=os.path.join(tempfile.gettempdir(), "lg_diag_off"))
    print(f"== {preset} [{pol.describe()}] built in {time.perf_counter() - t0:.1f} s", flush=True)
    generate_random(llm, pol.bls, 8, 2, seed=1)  # the bench's warm-up until the seventh session
    return cfg, pol, llm


def one_prefill(llm, pol, prompt_len: int, seed: int) -> tuple[float, float, dict, float]:
    """(prefill s, decode s of one step, allocator counter deltas, peak allocated GiB)."""
    from localgen.bench.offload_bench import generate_random

    torch.cuda.reset_peak_memory_stats()
    before = alloc_counts("cuda")
    pre, dec = generate_random(llm, pol.bls, prompt_len, 2, seed=seed)
    after = alloc_counts("cuda")
    return pre, dec, {k: after[k] - before[k] for k in after}, torch.cuda.max_memory_allocated() / 2**30


def summarize_trace(path: str, layers: int) -> None:
    """Per-stream busy time (union of intervals), copies by kind, top kernels, blocking calls."""
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        ev = json.load(f)["traceEvents"]
    gpu = [e for e in ev if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not gpu:
        print("   no GPU events in the trace", flush=True)
        return
    t0 = min(e["ts"] for e in gpu)
    t1 = max(e["ts"] + e["dur"] for e in gpu)
    print(f"   GPU span {(t1 - t0) / 1e3:.1f} ms ({(t1 - t0) / 1e3 / layers:.1f} ms a layer)", flush=True)
    by_stream = defaultdict(list)
    for e in gpu:
        by_stream[e.get("args", {}).get("stream", -1)].append(e)
    for s, es in sorted(by_stream.items(), key=lambda kv: -len(kv[1])):
        kinds = defaultdict(float)
        for e in es:
            kinds[e["cat"] if e["cat"] != "gpu_memcpy" else "memcpy " + e["name"].split(" ")[1]] += e["dur"]
        print(f"   stream {s}: {len(es)} ops, busy {_union(es) / 1e3:.1f} ms; "
              + ", ".join(f"{k} {v / 1e3:.1f} ms" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])),
              flush=True)
    comp = max(by_stream.values(), key=lambda es: sum(e["dur"] for e in es if e["cat"] == "kernel"))
    print(f"   busiest kernel stream idle within the span: {(t1 - t0 - _union(comp)) / 1e3:.1f} ms", flush=True)
    tops = defaultdict(lambda: [0, 0.0])
    for e in gpu:
        if e["cat"] == "kernel":
            t = tops[e["name"][:90]]
            t[0] += 1
            t[1] += e["dur"]
    for name, (n, us) in sorted(tops.items(), key=lambda kv: -kv[1][1])[:14]:
        print(f"     {us / 1e3:9.1f} ms {n:6d}x  {name}", flush=True)
    calls = defaultdict(lambda: [0, 0.0])
    for e in ev:
        if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver"):
            if any(e["name"].startswith(b) for b in BLOCKING):
                c = calls[e["name"]]
                c[0] += 1
                c[1] += e.get("dur", 0)
    print("   host calls that block or allocate: " + (", ".join(
        f"{k} {n}x {us / 1e3:.1f} ms" for k, (n, us) in sorted(calls.items(), key=lambda kv: -kv[1][1]))
        or "none"), flush=True)


def _union(es) -> float:
    """Microseconds covered by at least one of the events."""
    total, end = 0.0, None
    for s, d in sorted((e["ts"], e["dur"]) for e in es):
        if end is None or s > end:
            total += d
            end = s + d
        elif s + d > end:
            total += s + d - end
            end = s + d
    return total


def profiled_prefill(llm, pol, prompt_len: int, layers: int, trace: str | None) -> None:
    from torch.profiler import ProfilerActivity, profile

    from localgen.bench.offload_bench import add_random_requests

    add_random_requests(llm, pol.bls, prompt_len, 2, seed=7)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        llm.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    while llm.has_unfinished():
        llm.step()
    print(f"   profiled prefill {wall * 1e3:.0f} ms ({wall * 1e3 / layers:.1f} ms a layer)", flush=True)
    path = trace or os.path.join(tempfile.mkdtemp(), "trace.json")
    raw = path[:-3] if path.endswith(".gz") else path
    prof.export_chrome_trace(raw)
    if raw != path:
        with open(raw, "rb") as f, gzip.open(path, "wb", compresslevel=5) as g:
            g.write(f.read())
        os.remove(raw)
    summarize_trace(path, layers)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="opt-30b")
    ap.add_argument("--policy", default="8,7,0,100,99,1,0,100,w4,kv4")
    ap.add_argument("--gpu-memory", default="16GiB")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--order", default="on,on,off,on,off", help="overlap settings of the timed prefills")
    ap.add_argument("--profile", default="on,off", help="settings to profile (one prefill each)")
    ap.add_argument("--trace", default=None, help="write the first profiled prefill's trace here (.json.gz)")
    a = ap.parse_args(argv)
    _alias_kernels()
    from localgen.bench.offload_bench import generate_random, parse_size

    cfg, pol, llm = build(a.preset, a.policy, parse_size(a.gpu_memory), a.prompt_len)
    runner, L = llm.engine.runner, cfg.num_layers
    for i, setting in enumerate(a.order.split(",")):
        runner.acts.overlap_enabled = setting == "on"
        pre, dec, alloc, peak = one_prefill(llm, pol, a.prompt_len, seed=10 + i)
        print(f"   prefill {i} (overlap {setting}{', cold' if i == 0 else ''}): {pre:.3f} s "
              f"({pre * 1e3 / L:.1f} ms a layer), decode step {dec * 1e3:.0f} ms; peak {peak:.2f} GiB; "
              + ", ".join(f"{k} {v}" for k, v in alloc.items()), flush=True)
    timers = llm.engine.model.timers
    timers.reset()
    timers.enabled = True
    pre, _ = generate_random(llm, pol.bls, a.prompt_len, 2, seed=5)
    timers.enabled = False
    print(f"   timed prefill (each term alone): {pre:.3f} s; ms a layer: "
          + "  ".join(f"{k} {v * 1e3 / L:.2f}" for k, v in timers.terms("prefill").items()), flush=True)
    for j, setting in enumerate(a.profile.split(",")):
        runner.acts.overlap_enabled = setting == "on"
        print(f"-- profile, overlap {setting}", flush=True)
        profiled_prefill(llm, pol, a.prompt_len, L, a.trace if j == 0 else None)
    llm.engine.model.layers.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
