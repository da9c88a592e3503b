"""Where a decode step of the offloading runtime spends its time: torch.profiler over a few decode
steps of one policy (dummy weights of a preset's shapes), top ops by self device time and by self
host time, plus the wall time of a step.

    python scripts/offload_profile.py --preset llama-2-7b --gpu-memory 6GiB \
        --policy 2,4,100,0,100,0,100,0,w4,kv4 [--policy ...] [--device cuda] [--steps 3]

Use it when a policy's measured step is far above the cost model's prediction: the top ops say
whether the GPU, the copies or the host's launches take the time.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_selftest import _alias_kernels  # noqa: E402  (localgen.kernels -> kernels/ in a checkout)


def profile_policy(preset: str, spec: str, device: str, gpu_memory, prompt_len: int, steps: int,
                   rows: int, phase: str = "decode", sync_debug: bool = False,
                   sync_stacks: bool = False, py_profile: bool = False) -> None:
    from torch.profiler import ProfilerActivity, profile

    from localgen.bench.offload_bench import (add_random_requests, generate_random, policy_from_args,
                                              policy_llm)
    from localgen.policy.presets import preset_config

    cfg = preset_config(preset)
    pol = policy_from_args(spec)
    llm = policy_llm(cfg, pol, pol.bls, prompt_len, steps + 1, device=device, gpu_memory=gpu_memory,
                     offload_dir=os.path.join(tempfile.gettempdir(), "lg_prof_off"), name="profile")
    generate_random(llm, pol.bls, prompt_len, 2, seed=1)  # warm-up: kernels, allocator, decode graph
    pre, dec = generate_random(llm, pol.bls, prompt_len, steps + 1, seed=2)
    print(f"\n== {preset} [{pol.describe()}]\n   unprofiled: prefill {pre * 1e3:.1f} ms, "
          f"decode {dec / steps * 1e3:.1f} ms/step ({pol.bls * steps / dec:.1f} tok/s)", flush=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    add_random_requests(llm, pol.bls, prompt_len, steps + 1, seed=3)
    if phase == "decode":
        llm.step()  # prefill outside the profile
    if py_profile:
        python_profile(llm, phase, rows)
        return
    before = alloc_counts(device)
    if before:
        torch.cuda.reset_peak_memory_stats()
    with profile(activities=acts, with_stack=sync_stacks) as prof:
        t0 = time.perf_counter()
        while llm.has_unfinished():
            llm.step()
            if phase == "prefill":
                break
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    per = wall * 1e3 if phase == "prefill" else wall / steps * 1e3
    print(f"   profiled {phase}: {per:.1f} ms{'' if phase == 'prefill' else '/step'}", flush=True)
    after = alloc_counts(device)
    if after:
        print("   allocator during it: " + ", ".join(f"{k} {after[k] - before[k]}" for k in after)
              + f"; peak allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB, reserved "
              f"{torch.cuda.memory_reserved() / 2**30:.2f} GiB", flush=True)
    dev_key = "self_device_time_total" if device.startswith("cuda") else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=dev_key, row_limit=rows), flush=True)
    if device.startswith("cuda"):
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows), flush=True)
    if sync_stacks and device.startswith("cuda"):
        sites = host_wait_sites(prof.events())
        print(f"   host waits on the GPU in the profiled {phase}: {sum(n for n, _ in sites.values())}", flush=True)
        for site, (n, us) in sorted(sites.items(), key=lambda kv: -kv[1][1])[:12]:
            print(f"     {n:5d} {us / 1e3:8.2f} ms  {site}", flush=True)
    if sync_debug and device.startswith("cuda"):
        add_random_requests(llm, pol.bls, prompt_len, 3, seed=4)
        for what in ("prefill", "decode"):
            sites = sync_sites(llm.step)
            print(f"   host syncs in one {what} step: {sum(sites.values())}", flush=True)
            for site, n in sites.most_common(12):
                print(f"     {n:5d}  {site}", flush=True)
        while llm.has_unfinished():
            llm.step()
    llm.engine.model.layers.close()


def python_profile(llm, phase: str, rows: int) -> None:
    """The steps under cProfile: the Python functions that take the host's time (a decode step
    of an offloaded policy is host-bound when its per-layer Python outlasts the weight load)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    t0 = time.perf_counter()
    steps = 0
    prof.enable()
    while llm.has_unfinished():
        llm.step()
        steps += 1
        if phase == "prefill":
            break
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    prof.disable()
    print(f"   cProfile over {steps} {phase} step(s): {(time.perf_counter() - t0) * 1e3:.1f} ms "
          "(cProfile's own overhead included)", flush=True)
    out = io.StringIO()
    st = pstats.Stats(prof, stream=out)
    st.sort_stats("tottime").print_stats(rows)
    st.sort_stats("cumulative").print_stats(rows)
    print(relative_paths(out.getvalue()), flush=True)
    while llm.has_unfinished():
        llm.step()


def relative_paths(text: str) -> str:
    """File paths in profiler output as the repo and packages name them (``localgen/...``,
    ``site-packages/triton/...``), not as the machine that ran them does."""
    text = text.replace(str(Path(__file__).resolve().parents[1]) + "/", "")
    return re.sub(r"\S*/site-packages/", "site-packages/", text)


def alloc_counts(device: str) -> dict[str, int]:
    """The caching allocator's counters that mean a device synchronization (a retry frees cached
    blocks; device allocs and frees call cudaMalloc/cudaFree), or {} off CUDA."""
    if not device.startswith("cuda"):
        return {}
    st = torch.cuda.memory_stats()
    return {k: st.get(k, 0) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free",
                                       "num_sync_all_streams")}


WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def host_wait_sites(events) -> dict:
    """Each CUDA runtime call that blocks the host until the GPU catches up (a profile taken
    with ``with_stack``), by the project frames of its nearest op with a Python stack:
    site -> (count, host microseconds spent waiting). Catches waits the sync debug mode does
    not flag (a blocking host-to-device copy's stream synchronize)."""
    out: dict = {}
    for e in events:
        if e.name not in WAITS:
            continue
        p = e
        while p is not None and not p.stack:
            p = p.cpu_parent
        frames = [f for f in (p.stack if p is not None else [])
                  if "localgen" in f or "/kernels/" in f or "scripts/" in f][:4]
        site = " <- ".join(frames) or "(no stack)"
        n, us = out.get(site, (0, 0.0))
        out[site] = (n + 1, us + e.cpu_time_total)
    return out


def sync_sites(fn) -> Counter:
    """Run ``fn`` with torch's CUDA sync debug mode on; count each synchronizing call by its
    innermost project frames (file:line, innermost first)."""
    import traceback
    import warnings

    sites: Counter = Counter()

    def record(*_args, **_kw):
        frames = [f for f in traceback.extract_stack()[:-1]
                  if "localgen" in f.filename or "/kernels/" in f.filename]
        sites[" <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames[-4:]))] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record  # restored when the block exits
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sites


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama-2-7b")
    ap.add_argument("--policy", action="append", required=True,
                    help="gbs,ngb,wg,wc,cg,cc,hg,hc[,w4][,kv4][,cpuattn] (percent), repeatable")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--gpu-memory", default=None, help="GPU cap, e.g. 6GiB (default: none)")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--phase", choices=("decode", "prefill"), default="decode",
                    help="profile the decode steps (default) or the prefill step")
    ap.add_argument("--sync-debug", action="store_true",
                    help="also list where a prefill and a decode step synchronize with the GPU")
    ap.add_argument("--sync-stacks", action="store_true",
                    help="profile with Python stacks and list where the host waited on the GPU")
    ap.add_argument("--py-profile", action="store_true",
                    help="cProfile the steps instead (the host's Python time by function)")
    a = ap.parse_args(argv)
    _alias_kernels()
    from localgen.bench.offload_bench import parse_size

    cap = parse_size(a.gpu_memory) if a.gpu_memory else None
    for spec in a.policy:
        try:
            profile_policy(a.preset, spec, a.device, cap, a.prompt_len, a.steps, a.rows, a.phase, a.sync_debug,
                            a.sync_stacks, a.py_profile)
        except Exception as e:  # noqa: BLE001  (report and go on with the next policy)
            print(f"   {spec}: {e!r}"[:400], flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
