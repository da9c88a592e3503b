"""One plain sentence on why a searched policy wins, read off the cost model's own numbers:
what fits where (weights at 16 or 4 bits against the compute device's usable memory), which of
the step's terms bounds decoding at the chosen batch (FlexGen App. A.3's ctog, gtoc, dtoc, ctod,
comp, plus the host overhead localgen adds), and how far ahead of the next kind of policy it is.

Used by the `localgen tune` wizard and ``tune --yes`` alike, so both say the same thing.
"""

from __future__ import annotations

import dataclasses

from localgen.policy.cost_model import CostModel
from localgen.policy.policy import Policy
from localgen.policy.search import SearchResult
from localgen.profiler.hardware import GiB, HardwareProfile

_LINKS = {"ctog": "copying from RAM to the GPU", "gtoc": "copying from the GPU back to RAM",
          "dtoc": "reading from disk", "ctod": "writing to disk",
          "host": "the host's per-layer overhead (Python and kernel launches)"}


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n < 10 * GiB else f"{n / GiB:.0f} GiB"


def _rate(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _compute_words(cm: CostModel, policy: Policy, seconds: float) -> str:
    """What the decode ``comp`` term is made of: reading the weights (bandwidth) or arithmetic."""
    hw = cm.hw
    dev, mem = ("GPU", "GPU memory") if hw.has_gpu else ("CPU", "RAM")
    bdw = hw.gpu_mem_bdw if hw.has_gpu else hw.cpu_mem_bdw
    if bdw:
        ratio = cm.total_weight_bytes(policy.compress_weight) / cm.total_weight_bytes(False)
        layer_bytes = cm.layer_weight_elems() * cm.wl.dtype_bytes * ratio
        if layer_bytes / bdw >= 0.5 * seconds:  # the roofline's bandwidth side dominates
            return f"reading the weights from {mem} at {bdw / 1e9:.0f} GB/s"
    kind = "4-bit " if policy.compress_weight else ""
    return f"the {dev}'s compute (its {kind}matrix multiplies)"


def _placement(cm: CostModel, policy: Policy, capacity: dict[str, float]) -> str:
    """Where the weights are and why they could not be nearer the compute device."""
    hw = cm.hw
    tier, mem = ("gpu", "GPU memory") if hw.has_gpu else ("cpu", "RAM")
    near = policy.wg if hw.has_gpu else policy.wc
    w16, w4 = cm.total_weight_bytes(False), cm.total_weight_bytes(True)
    cap = capacity.get(tier, 0.0)
    if near >= 1 - 1e-3:
        if not policy.compress_weight:
            return f"all the weights ({_gib(w16)}) fit in {mem} ({_gib(cap)} usable) at 16 bits"
        as16 = cm.predict(dataclasses.replace(policy, compress_weight=False))
        if not as16.fits():
            return (f"the weights fit in {mem} ({_gib(cap)} usable) only at 4 bits ({_gib(w4)}; "
                    f"{_gib(w16)} at 16 bits)")
        return (f"the weights fit in {mem} at 16 bits too, but at 4 bits ({_gib(w4)} instead of "
                f"{_gib(w16)}) a step reads fewer bytes")
    size = _gib(w4 if policy.compress_weight else w16) + (" at 4 bits" if policy.compress_weight else "")
    parts = [f"{p:.0%} {where}" for p, where in ((policy.wg, "on the GPU"), (policy.wc, "in RAM"),
                                                 (policy.wd, "on disk")) if p > 5e-3]
    return (f"the weights ({size}) do not fit in {mem} ({_gib(cap)} usable) beside the KV cache, "
            f"so they sit {', '.join(parts)}")


def _differs(best: Policy, alt: Policy) -> str:
    """What the runner-up does differently, in a few words."""
    out = []
    if alt.compress_weight != best.compress_weight:
        out.append("4-bit weights" if alt.compress_weight else "16-bit weights")
    if alt.compress_cache != best.compress_cache:
        out.append("a 4-bit KV cache" if alt.compress_cache else "a 16-bit KV cache")
    if alt.delegates_attention != best.delegates_attention:
        out.append("attention on the CPU" if alt.delegates_attention else "attention on the GPU")
    for name, a, b in (("on disk", alt.wd, best.wd), ("in RAM", alt.wc, best.wc)):
        if (a > 5e-3) != (b > 5e-3):
            out.append(f"weights {name}" if a > 5e-3 else f"no weights {name}")
            break
    if not out:
        out.append(f"zig-zag block {alt.bls}")
    return ", ".join(out)


def why_sentence(cm: CostModel, res: SearchResult) -> str:
    """One sentence: what fits where, what bounds a decode step at the chosen batch, and the
    margin over the best policy of another kind. ``cm``: the cost model the search used."""
    p, pr = res.policy, res.prediction
    term = pr.decode_bottleneck
    secs = pr.decode_terms[term]
    bound = _compute_words(cm, p, secs) if term == "comp" else _LINKS.get(term, term)
    text = (f"This policy wins because {_placement(cm, p, pr.capacity)}, and at batch {p.bls} "
            f"decoding is bound by {bound} ({secs * 1e3:.3g} ms per layer a step)")
    if res.alternatives:
        alt = res.alternatives[0]
        ratio = pr.throughput / alt.throughput if alt.throughput > 0 else float("inf")
        text += (f", predicting {_rate(pr.throughput)} tokens/s, {ratio:.2f}x the next best kind "
                 f"({_differs(p, alt.policy)})")
    return text + "."


def cost_model_for(model: str, hw: HardwareProfile, prompt_len: int, gen_len: int) -> CostModel:
    """The cost model ``tuning.run_search`` prices policies with (localgen's runtime)."""
    from localgen.policy.cost_model import Workload
    from localgen.policy.presets import resolve_model_weights

    cfg, stored = resolve_model_weights(model)
    return CostModel(cfg, hw, Workload(prompt_len, gen_len), runtime="localgen", stored=stored)


def undo_hint(model: str) -> str:
    """The command that takes back the policy saved for ``model``."""
    import shlex

    return f"To undo: localgen tune --reset --model {shlex.quote(model)}"
