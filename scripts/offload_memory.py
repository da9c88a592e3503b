"""Where an offloaded policy's GPU memory goes, beside the cost model's peak: the bytes allocated
once the model is built (resident weights, streaming buffers, KV cache), the largest CUDA tensors
alive then, and the peak of a prefill step and of a decode step on their own (dummy weights of a
preset's shapes, prompt 512).

    python scripts/offload_memory.py --preset llama-2-7b --gpu-memory 12GiB --policy 4,85,38,62,0,100,0,100

Use it when a policy runs out of GPU memory that the cost model said it would fit in: the tensors
alive at the peak name what the model leaves out.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import tempfile
from collections import Counter

import torch

GiB = 1 << 30


def live_cuda_tensors(top: int) -> list[tuple[str, int, int]]:
    """(shape and dtype, count, bytes) of the CUDA tensors alive, largest total first."""
    by: Counter = Counter()
    count: Counter = Counter()
    seen = set()
    for o in gc.get_objects():
        try:
            if not (torch.is_tensor(o) and o.is_cuda):
                continue
            st = o.untyped_storage()
        except Exception:  # noqa: BLE001 - objects gc hands back may be half-built
            continue
        if st.data_ptr() in seen:
            continue
        seen.add(st.data_ptr())
        key = f"{tuple(o.shape)} {o.dtype}"
        by[key] += st.nbytes()
        count[key] += 1
    return [(k, count[k], b) for k, b in by.most_common(top)]


def live_at_peak(snapshot: dict, top: int) -> list[tuple[str, int]]:
    """Replay a ``torch.cuda.memory._snapshot()`` trace; at its highest point, the live bytes by
    the innermost localgen (or kernels) frame that allocated them, largest first."""
    live: dict = {}
    cur = peak = 0
    at_peak: dict = {}
    for ev in (snapshot.get("device_traces") or [[]])[0]:
        if ev["action"] == "alloc":
            frames = [f"{f['filename'].split('/')[-1]}:{f['line']} {f['name']}" for f in ev.get("frames", [])
                      if "localgen" in f["filename"] or "/kernels/" in f["filename"]]
            live[ev["addr"]] = (ev["size"], frames[0] if frames else "?")
            cur += ev["size"]
            if cur > peak:
                peak, at_peak = cur, dict(live)
        elif ev["action"] in ("free_requested", "free_completed") and ev["addr"] in live:
            if ev["action"] == "free_requested":
                cur -= live.pop(ev["addr"])[0]
    by: Counter = Counter()
    for size, where in at_peak.values():
        by[where] += size
    return by.most_common(top)


def main(argv=None) -> None:
    from localgen.bench.offload_bench import (add_random_requests, parse_size, policy_from_args,
                                              policy_llm)
    from localgen.policy.cost_model import CostModel, Workload
    from localgen.policy.presets import preset_config
    from localgen.profiler.hardware import load_profile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-2-7b")
    ap.add_argument("--policy", required=True)
    ap.add_argument("--gpu-memory", default="12GiB")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--profile", default="h100")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (no CUDA statistics)")
    a = ap.parse_args(argv)
    cfg, pol = preset_config(a.preset), policy_from_args(a.policy)
    cap = parse_size(a.gpu_memory)
    hw = dataclasses.replace(load_profile(a.profile), gpu_mem=cap)
    pred = CostModel(cfg, hw, Workload(a.prompt_len, 32), runtime="localgen").predict(pol)
    print(f"{a.preset} [{pol.describe()}], cap {cap / GiB:.1f} GiB; predicted peak GiB "
          f"{ {k: round(v / GiB, 3) for k, v in pred.peak_mem.items()} }", flush=True)
    llm = policy_llm(cfg, pol, pol.bls, a.prompt_len, 32, device=a.device, gpu_memory=cap,
                     offload_dir=os.path.join(tempfile.gettempdir(), "lg_mem_off"), name="memory")
    cuda = a.device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        print(f"built: {torch.cuda.memory_allocated() / GiB:.3f} GiB allocated; largest live tensors:")
        for key, n, b in live_cuda_tensors(a.top):
            print(f"   {b / GiB:8.3f} GiB  {n:4d} x {key}")
    add_random_requests(llm, pol.bls, a.prompt_len, 3, seed=1)
    for phase in ("prefill", "decode", "decode"):
        if not cuda:
            llm.step()
            print(phase, "ran")
            continue
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.memory._record_memory_history(max_entries=200000)
        llm.step()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        for where, b in live_at_peak(snap, a.top):
            print(f"   {b / GiB:8.3f} GiB allocated in this step, live at its peak: {where}")
        print(f"{phase}: peak {torch.cuda.max_memory_allocated() / GiB:.3f} GiB, after "
              f"{torch.cuda.memory_allocated() / GiB:.3f} GiB", flush=True)


if __name__ == "__main__":
    main()
