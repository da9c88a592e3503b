"""The steps `localgen tune` runs, shared by the Textual wizard and the plain ``--yes`` mode."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from localgen.policy.cost_model import Workload
from localgen.policy.presets import resolve_model_weights
from localgen.policy.search import SearchResult, search
from localgen.policy.store import save_policy
from localgen.profiler.hardware import GiB, HardwareProfile, ProfileNotFoundError, load_profile

DEFAULT_MODEL = "smollm2-135m"  # the embedded default, SmolLM2-135M-Instruct
CHAT = Workload(prompt_len=512, gen_len=256)


@dataclass
class TuneRequest:
    """What the user chose: model spec, workload kind and lengths, compression, latency bound (s),
    and which tiers the search may fill (``search``'s ``tiers``: "any", or "fewest" to keep off RAM
    and SSD unless the model needs them)."""

    model: str = DEFAULT_MODEL
    workload: str = "chat"  # "chat" | "batch"
    prompt_len: int = 512
    gen_len: int = 32
    compression: str = "auto"
    latency_bound: float | None = None
    tiers: str = "any"

    def to_workload(self) -> Workload:
        return Workload(self.prompt_len, self.gen_len)


def get_profile(name: str | None, offload_dir: str, measure: Callable[[], HardwareProfile]) -> HardwareProfile:
    """A named/path profile; else the saved one; else ``measure()`` (and save it)."""
    if name:
        return load_profile(name)
    try:
        return load_profile(None)
    except ProfileNotFoundError:
        hw = measure()
        hw.save()
        return hw


def run_search(req: TuneRequest, hw: HardwareProfile,
               progress: Callable[[float, str], None] | None = None) -> SearchResult:
    """Search the policy for ``req`` on ``hw``: chat -> latency objective (batch 1).
    ``progress``: ``search``'s (an exception it raises ends the search)."""
    cfg, stored = resolve_model_weights(req.model)
    objective = "latency" if req.workload == "chat" else "throughput"
    return search(cfg, hw, req.to_workload(), compression=req.compression, objective=objective,
                  latency_bound=req.latency_bound, runtime="localgen", tiers=req.tiers,
                  progress=progress, stored=stored)


def save_result(req: TuneRequest, hw: HardwareProfile, res: SearchResult):
    meta = {"workload": req.workload, "prompt_len": req.prompt_len, "gen_len": req.gen_len, "tiers": req.tiers,
            "profile": hw.name, "predicted_throughput": res.throughput,
            "predicted_peak_mem": res.prediction.peak_mem}
    return save_policy(req.model, res.policy, meta)


def result_lines(res: SearchResult) -> list[str]:
    """Human-readable summary: the policy, its prediction, memory per tier, the alternatives."""
    pr = res.prediction
    mem = ", ".join(f"{t} {pr.peak_mem[t] / GiB:.2f} / {pr.capacity.get(t, 0) / GiB:.1f} GiB"
                    for t in ("gpu", "cpu", "disk") if t in pr.capacity)
    out = [f"Policy: {res.policy.describe()}",
           f"Predicted: {pr.throughput:.3g} tokens/s (prefill {pr.prefill_time:.3g} s, decode {pr.decode_time:.3g} s "
           f"per zig-zag block); bottlenecks: prefill {pr.prefill_bottleneck}, decode {pr.decode_bottleneck}",
           f"Peak memory: {mem}"]
    out += [f"  alternative: {a.explain()}" for a in res.alternatives]
    return out
