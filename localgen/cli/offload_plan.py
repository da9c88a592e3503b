"""The CLI's offload flags (``--percent``, ``--gpu-batch-size``…) over the saved policy -> a
``Policy``, and the predicted peak memory per tier printed before a model loads (FlexGen's cost
model, ``localgen.policy.cost_model``). No torch import here beyond what the cost model needs, so
the CLI stays light."""

from __future__ import annotations

from typing import Sequence

from localgen.policy.policy import Policy
from localgen.policy.store import load_saved_policy

EMBEDDED_NAMES = ("smollm2-135m", "embedded")  # the names `localgen tune` saves the default under


def saved_policy_for(model: str | None) -> Policy | None:
    """The policy `localgen tune` saved for ``model`` (None: the embedded default), if any."""
    for name in ([model] if model else list(EMBEDDED_NAMES)):
        p = load_saved_policy(name)
        if p is not None:
            return p
    return None


def policy_from_options(model: str | None, percent: Sequence[float] | None = None,
                        gpu_batch_size: int | None = None, num_gpu_batches: int | None = None,
                        compress_weight: bool | None = None, compress_cache: bool | None = None,
                        cpu_cache_compute: bool | None = None, use_saved: bool = True) -> Policy | None:
    """FlexGen-style flags over the saved policy. ``percent``: wg wc cg cc hg hc in percent (disk
    takes the rest of each group). Returns None (the plain resident path) when no flag is given and
    no policy was saved. Raises ValueError for fractions that do not form a valid policy."""
    base = saved_policy_for(model) if use_saved else None
    flags = (percent, gpu_batch_size, num_gpu_batches, compress_weight, compress_cache, cpu_cache_compute)
    if base is None and all(f is None for f in flags):
        return None
    d = (base or Policy()).to_dict()
    if percent is not None:
        if len(percent) != 6:
            raise ValueError(f"--percent takes 6 numbers (wg wc cg cc hg hc), got {len(percent)}")
        wg, wc, cg, cc, hg, hc = (float(x) / 100 for x in percent)
        d.update(wg=wg, wc=wc, wd=1 - wg - wc, cg=cg, cc=cc, cd=1 - cg - cc, hg=hg, hc=hc, hd=1 - hg - hc)
        for k in ("wd", "cd", "hd"):
            if abs(d[k]) < 1e-9:
                d[k] = 0.0
    for k, v in (("gbs", gpu_batch_size), ("num_gpu_batches", num_gpu_batches),
                 ("compress_weight", compress_weight), ("compress_cache", compress_cache),
                 ("cpu_cache_compute", cpu_cache_compute)):
        if v is not None:
            d[k] = v
    return Policy.from_dict(d)


def _machine_profile(gpu_memory: int | None, cpu_memory: int | None, offload_dir: str | None):
    """The saved hardware profile, else one describing this machine's capacities with nominal
    speeds (peak memory does not depend on speeds); caps replace the capacities."""
    import dataclasses
    import shutil

    from localgen.profiler.hardware import HardwareProfile, load_profile

    try:
        hw = load_profile()
    except Exception:
        import psutil
        import torch

        gpu = torch.cuda.is_available()
        hw = HardwareProfile(
            name="this machine (nominal speeds)", date="", cpu_name="cpu",
            cpu_mem=int(psutil.virtual_memory().total), disk_mem=int(shutil.disk_usage(offload_dir or ".").free),
            dtoc_bdw=1e9, ctod_bdw=1e9, mm_flops=1e12, mm_flops_gen=1e12, bmm_flops=1e12,
            bmm_flops_gen=1e12, cpu_flops=1e11,
            gpu_name=torch.cuda.get_device_name() if gpu else None,
            gpu_mem=torch.cuda.get_device_properties(0).total_memory if gpu else 0,
            ctog_bdw=2e10 if gpu else None, gtoc_bdw=2e10 if gpu else None)
    repl = {}
    if gpu_memory is not None and hw.has_gpu:
        repl["gpu_mem"] = gpu_memory
    if cpu_memory is not None:
        repl["cpu_mem"] = cpu_memory
    return dataclasses.replace(hw, **repl) if repl else hw


def predicted_peaks(cfg, policy: Policy, prompt_len: int, gen_len: int, *, gpu_memory=None,
                    cpu_memory=None, offload_dir=None, hw=None, dtype_bytes: int = 2, stored=None):
    """Cost-model Prediction for ``policy`` as localgen's runtime runs it (peak_mem/capacity per
    tier, times, throughput); ``stored``: the file's weight bytes (``CostModel``)."""
    from localgen.policy.cost_model import CostModel, Workload

    hw = hw or _machine_profile(gpu_memory, cpu_memory, offload_dir)
    return CostModel(cfg, hw, Workload(prompt_len, gen_len, dtype_bytes), runtime="localgen",
                     stored=stored).predict(policy)


def predicted_for(model: str | None, policy: Policy, prompt_len: int, gen_len: int, *,
                  gpu_memory=None, cpu_memory=None, offload_dir=None):
    """``predicted_peaks`` for ``model`` (a path, hub id or GGUF; None: the embedded default)."""
    from localgen.models.sources import resolve_model
    from localgen.policy.presets import stored_weights

    src = resolve_model(model)
    return predicted_peaks(src.config, policy, prompt_len, gen_len, gpu_memory=gpu_memory,
                           cpu_memory=cpu_memory, offload_dir=offload_dir, stored=stored_weights(src))


def peak_lines(policy: Policy, pred, prompt_len: int, gen_len: int) -> list[str]:
    """Human lines: the policy and its predicted peak per tier (GiB, ``pred`` from
    ``predicted_for``), printed before loading."""
    gib = 2 ** 30
    tiers = ", ".join(f"{t} {pred.peak_mem[t] / gib:.2f} GiB" + (
        f" of {pred.capacity[t] / gib:.1f}" if t in pred.capacity else "") for t in ("gpu", "cpu", "disk"))
    lines = [f"policy: {policy.describe()}",
             f"predicted peak memory (prompt {prompt_len} + {gen_len} tokens): {tiers}"]
    if not pred.fits():
        lines.append("warning: the predicted peak exceeds a tier's capacity")
    return lines
