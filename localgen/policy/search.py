"""Policy search: enumerate (gbs, num_gpu_batches), solve an LP over the 9 fractions for each
(FlexGen §4.3 "Policy search", App. A.3), keep the best and the runners-up.

For fixed batch shape and options, ``min T/bls`` subject to ``wg+wc+wd = cg+cc+cd = hg+hc+hd = 1``,
the peak-memory rows <= capacity and ``T_pre >= each prefill term``, ``T_gen >= each decode term``
(the max terms linearized with the auxiliary variables T_pre, T_gen) is a linear program, solved
with ``scipy.optimize.linprog(method="highs")``. Among policies of equal predicted time a second LP
keeps weights nearest the GPU, then the cache, then activations (FlexGen leaves ties to the solver).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import product
from typing import Iterable, Literal

import numpy as np

from localgen.models.config import ModelConfig
from localgen.policy.cost_model import CC, CD, HC, HD, NVARS, WC, WD, TERMS, CostModel, Prediction, Terms, Workload, evaluate_terms
from localgen.policy.policy import Policy
from localgen.profiler.hardware import HardwareProfile

Compression = Literal["off", "on", "auto"]
Objective = Literal["throughput", "latency"]
GBS_CHOICES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
NB_CHOICES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
_TIE_REL = 1e-6  # second LP may cost this much relative time to move fewer bytes


class NoFeasiblePolicyError(RuntimeError):
    """No batch shape fits the memory capacities (and the latency bound, if one was given)."""


@dataclass
class Candidate:
    """One solved LP: a policy and its prediction."""

    policy: Policy
    prediction: Prediction

    @property
    def throughput(self) -> float:
        return self.prediction.throughput

    def explain(self) -> str:
        """One sentence: what it does and what limits it."""
        p, pr = self.policy, self.prediction
        return (f"{pr.throughput:.3g} tokens/s with {p.describe()}; prefill bound by "
                f"{pr.prefill_bottleneck}, decode bound by {pr.decode_bottleneck}.")


@dataclass
class SearchResult:
    """The chosen policy with its prediction, and the best of the other kinds of policy."""

    best: Candidate
    alternatives: list[Candidate] = field(default_factory=list)
    num_lps: int = 0

    @property
    def policy(self) -> Policy:
        return self.best.policy

    @property
    def prediction(self) -> Prediction:
        return self.best.prediction

    @property
    def throughput(self) -> float:
        return self.best.throughput


def solve_lp(terms: Terms, latency_bound: float | None = None, tie_break: bool = False):
    """Solve the App. A.3 LP for one batch shape. Returns fractions (9,) or None if infeasible.

    Variables: the 9 fractions, T_pre, T_gen (seconds per layer). Memory rows are divided by the
    capacity so every row is O(1) for the solver.
    """
    from scipy.optimize import linprog

    l, n = terms.num_layers, terms.gen_len
    nv = NVARS + 2
    a_ub, b_ub = [], []
    for k, col in ((0, NVARS), (1, NVARS + 1)):  # T_pre >= term, T_gen >= term
        for vec in (terms.pre_rows, terms.gen_rows)[k]:
            row = np.zeros(nv)
            row[:NVARS], row[col] = vec[:NVARS], -1.0
            a_ub.append(row)
            b_ub.append(-vec[NVARS])
    for tier, vec in terms.memory:
        cap = terms.capacity.get(tier)
        if cap is None:
            continue
        if cap <= 0:
            return None
        row = np.zeros(nv)
        row[:NVARS] = vec[:NVARS] / cap
        a_ub.append(row)
        b_ub.append(1.0 - vec[NVARS] / cap)
    total = np.zeros(nv)
    total[NVARS], total[NVARS + 1] = l, l * (n - 1)
    if latency_bound is not None:
        a_ub.append(total.copy())
        b_ub.append(latency_bound)
    a_eq = np.zeros((3, nv))
    for g in range(3):
        a_eq[g, 3 * g:3 * g + 3] = 1.0
    bounds = [(0.0, 0.0) if i in terms.fixed_zero else (0.0, 1.0) for i in range(NVARS)] + [(0, None)] * 2
    res = linprog(total, A_ub=np.array(a_ub), b_ub=np.array(b_ub), A_eq=a_eq, b_eq=np.ones(3),
                  bounds=bounds, method="highs")
    if res.status != 0:
        return None
    if tie_break:
        x = _nearest_first(res, total, np.array(a_ub), np.array(b_ub), a_eq, bounds)
        if x is not None:
            return x
    return res.x[:NVARS]


def _nearest_first(res, total, a_ub, b_ub, a_eq, bounds):
    """Among fractions within _TIE_REL of the optimal time, keep weights nearest the compute device,
    then the cache, then activations (a lexicographic preference through weights 100 : 10 : 1)."""
    from scipy.optimize import linprog

    cost = np.zeros(len(total))
    cost[[WC, WD, CC, CD, HC, HD]] = [100, 200, 10, 20, 1, 2]
    a2 = np.vstack([a_ub, total])
    b2 = np.append(b_ub, res.fun * (1 + _TIE_REL))
    res2 = linprog(cost, A_ub=a2, b_ub=b2, A_eq=a_eq, b_eq=np.ones(3), bounds=bounds, method="highs")
    return res2.x[:NVARS] if res2.status == 0 else None


def _options(hw: HardwareProfile, compression: Compression) -> list[tuple[bool, bool, bool]]:
    comp = {"off": [(False, False)], "on": [(True, True)],
            "auto": [(False, False), (True, False), (False, True), (True, True)]}[compression]
    deleg = [True, False] if hw.has_gpu else [False]
    return [(w, c, d) for (w, c), d in product(comp, deleg)]


def search(cfg: ModelConfig, hw: HardwareProfile, wl: Workload, *, compression: Compression = "off",
           objective: Objective = "throughput", latency_bound: float | None = None,
           mem_fraction: float | None = None, form: str = "released", gbs_choices: Iterable[int] = GBS_CHOICES,
           nb_choices: Iterable[int] = NB_CHOICES, num_alternatives: int = 4) -> SearchResult:
    """Find the policy with the highest predicted throughput (FlexGen §4.3).

    ``objective="latency"`` (chat): one sequence (gbs = num_gpu_batches = 1), minimum time.
    ``latency_bound``: seconds for one block to finish prefill + ``gen_len`` tokens.
    ``compression``: 4-bit weights and KV off, on, or whichever is faster ("auto").
    ``form``: the cost model's overlap form (see ``CostModel``); ``mem_fraction``: usable share of
    each capacity.
    Raises NoFeasiblePolicyError when nothing fits.
    """
    kw = {} if mem_fraction is None else {"mem_fraction": mem_fraction}
    cm = CostModel(cfg, hw, wl, form=form, **kw)
    if objective == "latency":
        gbs_choices, nb_choices = (1,), (1,)
    found: list[tuple[float, tuple, Terms, np.ndarray]] = []
    num_lps = 0
    for opts in _options(hw, compression):
        for gbs in gbs_choices:
            feasible_any = False
            for nb in nb_choices:
                terms = cm.terms(gbs, nb, *opts)
                x = solve_lp(terms, latency_bound)
                num_lps += 1
                if x is None:
                    break  # memory and time only grow with the block size
                feasible_any = True
                found.append((evaluate_terms(terms, x).throughput, (gbs, nb, opts), terms, x))
            if not feasible_any:
                break  # a larger GPU batch needs more working memory still
    if not found:
        raise NoFeasiblePolicyError(
            f"no policy fits {hw.name} for this model and workload (capacities x {cm.mem_fraction})"
            + (f" within {latency_bound} s" if latency_bound else ""))
    found.sort(key=lambda f: -f[0])
    picked = [found[0]] + _distinct_runners_up(found, num_alternatives)
    cands = [_finish(f, latency_bound) for f in picked]
    return SearchResult(cands[0], cands[1:], num_lps)


def _kind(f) -> tuple:
    """What makes two policies different in kind: the options and the slowest tier holding weights."""
    (_, _, opts), x = f[1], f[3]
    return opts + (max((i for i in range(3) if x[i] > 1e-3), default=0),)


def _distinct_runners_up(found, k):
    seen, out = {_kind(found[0])}, []
    for f in found[1:]:
        if _kind(f) not in seen:
            seen.add(_kind(f))
            out.append(f)
        if len(out) == k:
            break
    return out


def _finish(f, latency_bound) -> Candidate:
    _, (gbs, nb, (cw, ck, deleg)), terms, _ = f
    x = solve_lp(terms, latency_bound, tie_break=True)
    policy = Policy.from_fractions(x, gbs=gbs, num_gpu_batches=nb, compress_weight=cw,
                                   compress_cache=ck, cpu_cache_compute=deleg)
    return Candidate(policy, evaluate_terms(terms, np.array(policy.fractions())))
