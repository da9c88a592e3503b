"""Where a graphed decode step's GPU time goes, kernel by kernel (CUDA only).

    python scripts/decode_step_profile.py --model FILE.gguf --batch 1 [--json OUT]

Loads the model, decodes one batch of ``--batch`` sequences a few tokens (capturing the decode
graph of that batch and context bucket), then replays that graph ``--replays`` times under
torch.profiler and prints, per kernel name, its launches and GPU microseconds per step, beside
the replay's own time (CUDA events). The replay time less the kernels' sum is the time the GPU
spends between kernels (each node's launch latency inside the graph).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a bare checkout: localgen beside


def _short(name: str) -> str:
    """A kernel's name without its template arguments and parameter list."""
    for cut in ("<", "("):
        name = name.split(cut)[0]
    return name[:70]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--json")
    a = p.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    from localgen.api import LLM
    from localgen.bench.decode_bench import graph_replay_ms, run_localgen

    llm = LLM.load(a.model, max_num_seqs=max(a.batch, 1), max_model_len=a.prompt_len + 64)
    run_localgen(llm, a.batch, a.prompt_len, 8, seed=1)  # captures the step's graph
    replay_ms = graph_replay_ms(llm)
    g = list(llm.engine.runner.graphs.values())[-1]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(a.replays):
            g.graph.replay()
        torch.cuda.synchronize()
    per = defaultdict(lambda: [0, 0.0])  # name -> [launches, µs] over all replays
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time_total > 0:
            row = per[_short(ev.name)]
            row[0] += 1
            row[1] += ev.device_time_total
    rows = sorted(((n, c / a.replays, us / a.replays) for n, (c, us) in per.items()),
                  key=lambda r: -r[2])
    total = sum(r[2] for r in rows)
    print(f"batch {a.batch}, graph {g.batch} x {g.max_context}: replay {replay_ms * 1e3:.0f} µs, "
          f"kernels {total:.0f} µs ({sum(r[1] for r in rows):.0f} launches), between kernels "
          f"{replay_ms * 1e3 - total:.0f} µs")
    for name, calls, us in rows[:30]:
        print(f"  {us:8.1f} µs {us / total:6.1%} {calls:6.0f}x  {name}")
    if a.json:
        Path(a.json).write_text(json.dumps({
            "batch": a.batch, "replay_us": replay_ms * 1e3, "kernels_us": total,
            "kernels": [{"name": n, "launches": c, "us": us} for n, c, us in rows]}, indent=1))


if __name__ == "__main__":
    main()
