"""The policies `localgen tune` would pick, as `offload_bench --policy` arguments: for each
(preset, GPU cap, compression) the search's best under localgen's runtime on a hardware profile,
optionally with a freshly measured eager-layer host time (`--layer-host-s`). One line each:
``PRESET CAP_GIB SPEC PREDICTED_TOK_S``, for `scripts/offload_gpu_runs.sh search_picks` to run.

    python scripts/search_picks.py --profile h100 --layer-host-s 0.0015 \
        --case opt-30b:16:on --case llama-2-7b:6:off
"""

from __future__ import annotations

import argparse
import dataclasses

from localgen.bench.offload_bench import policy_to_args
from localgen.policy.cost_model import Workload
from localgen.policy.presets import preset_config
from localgen.policy.search import search
from localgen.profiler.hardware import load_profile

GiB = 1 << 30


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="h100")
    ap.add_argument("--layer-host-s", type=float, default=None,
                    help="HardwareProfile.gpu_layer_host_s to search with (default: the profile's)")
    ap.add_argument("--case", action="append", required=True, help="PRESET:CAP_GIB:COMPRESSION")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=32)
    a = ap.parse_args(argv)
    base = load_profile(a.profile)
    if a.layer_host_s is not None:
        base = dataclasses.replace(base, gpu_layer_host_s=a.layer_host_s)
    for case in a.case:
        preset, cap, compression = case.split(":")
        hw = dataclasses.replace(base, gpu_mem=min(base.gpu_mem, int(float(cap) * GiB)))
        res = search(preset_config(preset), hw, Workload(a.prompt_len, a.gen_len),
                     compression=compression, runtime="localgen")
        print(preset, cap, policy_to_args(res.policy), f"{res.throughput:.2f}", flush=True)


if __name__ == "__main__":
    main()
