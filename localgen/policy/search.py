"""Policy search: enumerate (gbs, num_gpu_batches), solve an LP over the 9 fractions for each
(FlexGen §4.3 "Policy search", App. A.3), keep the best and the runners-up.

For fixed batch shape and options, ``min T/bls`` subject to ``wg+wc+wd = cg+cc+cd = hg+hc+hd = 1``,
the peak-memory rows <= capacity and ``T_pre >= each prefill term``, ``T_gen >= each decode term``
(the max terms linearized with the auxiliary variables T_pre, T_gen) is a linear program, solved
with ``scipy.optimize.linprog(method="highs")``. Among policies of equal predicted time a second LP
keeps weights nearest the GPU, then the cache, then activations (FlexGen leaves ties to the solver).
``tiers="fewest"`` runs the enumeration level by level (GPU; GPU and CPU; all three), the fractions of
the tiers left out held at 0, and stops at the first level where a policy fits (FlexGen's tuning rule);
``tiers="any"`` runs that first level and every tier, and keeps the best of both. The candidates are
ranked by ``CostModel.predict`` once finished (the tie-break LP), as the runtime would run them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from itertools import product
from typing import Callable, Iterable, Literal

import numpy as np

from localgen.models.config import ModelConfig
from localgen.policy.cost_model import (CC, CD, CG, HC, HD, HG, NVARS, WC, WD, WG, CostModel, Prediction,
                                        StoredWeights, Terms, Workload, evaluate_terms)
from localgen.policy.policy import Policy
from localgen.profiler.hardware import HardwareProfile

Compression = Literal["off", "on", "auto"]
Objective = Literal["throughput", "latency"]
Tiers = Literal["any", "fewest"]
WeightGranularity = Literal["tensor", "none"]
MAX_GBS = 1 << 16  # FlexGen's loop is unbounded (it stops when nothing fits); a guard
MAX_NB = 1 << 14
_TIE_REL = 1e-6  # second LP may cost this much relative time to move fewer bytes


_TIER_FRACTIONS = {"gpu": (WG, CG, HG), "cpu": (WC, CC, HC), "disk": (WD, CD, HD)}


def tier_levels(has_gpu: bool) -> list[tuple[str, ...]]:
    """The levels of the memory hierarchy, fastest first, each as the tiers a policy at that level
    may use: GPU; GPU and CPU; GPU, CPU and disk (without a GPU the CPU is the compute device: CPU;
    CPU and disk)."""
    tiers = ("gpu", "cpu", "disk") if has_gpu else ("cpu", "disk")
    return [tiers[:i] for i in range(1, len(tiers) + 1)]


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


def flexgen_gbs_choices() -> Iterable[int]:
    """GPU batch sizes in FlexGen's order: 1, 2, 3, 4, then doubling (8, 16, 32, 64, ...), as in
    FlexGen experimental/cost_model.py ``solve``: ``if gbs < 4: gbs += 1 else: gbs *= 2``."""
    gbs = 1
    while gbs <= MAX_GBS:
        yield gbs
        gbs = gbs + 1 if gbs < 4 else gbs * 2


def solve_lp(terms: Terms, latency_bound: float | None = None, tie_break: bool = False,
             bounds_override: dict[int, tuple[float, float]] | None = None):
    """Solve the App. A.3 LP for one batch shape. Returns fractions (9,) or None if infeasible.

    Variables: the 9 fractions, T_pre, T_gen (seconds per layer). Memory rows are divided by the
    capacity so every row is O(1) for the solver. ``bounds_override``: fraction index -> (lo, hi)
    (fractions in ``terms.fixed_zero`` stay 0).
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
        # a tier with no room (a full disk) still takes a policy that puts nothing there
        scale = cap if cap > 0 else max(np.abs(vec).max(), 1.0)
        row = np.zeros(nv)
        row[:NVARS] = vec[:NVARS] / scale
        a_ub.append(row)
        b_ub.append(max(cap, 0.0) / scale - vec[NVARS] / scale)
    total = np.zeros(nv)
    total[NVARS], total[NVARS + 1] = l, l * (n - 1)
    if latency_bound is not None:
        a_ub.append(total.copy())
        b_ub.append(latency_bound)
    a_eq = np.zeros((3, nv))
    for g in range(3):
        a_eq[g, 3 * g:3 * g + 3] = 1.0
    over = bounds_override or {}
    bounds = [(0.0, 0.0) if i in terms.fixed_zero else over.get(i, (0.0, 1.0)) for i in range(NVARS)] + [(0, None)] * 2
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
           mem_fraction: float | dict[str, float] | None = None, form: str = "released",
           gbs_choices: Iterable[int] | None = None, nb_choices: Iterable[int] | None = None,
           weight_granularity: WeightGranularity = "tensor", num_alternatives: int = 4,
           runtime: str = "flexgen", tiers: Tiers = "any",
           progress: Callable[[float, str], None] | None = None,
           stored: StoredWeights | None = None) -> SearchResult:
    """Find the policy with the highest predicted throughput (FlexGen §4.3).

    Enumeration as FlexGen experimental/cost_model.py ``solve``: GPU batch sizes 1, 2, 3, 4, 8, 16, ...
    until none fits; for each, num_gpu_batches = 1, 2, 3, ... until it no longer fits or the predicted
    throughput drops (FlexGen: ``if throughput < prev_throughput: break``). Explicit ``gbs_choices`` /
    ``nb_choices`` replace those sequences (an explicit nb list is scanned until infeasible, no early stop).
    ``objective="latency"`` (chat): one sequence (gbs = num_gpu_batches = 1), minimum time.
    ``latency_bound``: seconds for one zig-zag block to finish prefill + ``gen_len`` tokens.
    ``compression``: 4-bit weights and KV off, on, or whichever is faster ("auto").
    ``form``: the cost model's overlap form (see ``CostModel``); ``mem_fraction``: usable share of
    each capacity (float, or dict per tier; default GPU 0.9, CPU and disk 0.8).
    ``weight_granularity="tensor"``: the GPU weight share is 0, 1, or leaves at least one whole weight
    matrix of a layer on each side (``CostModel.min_gpu_weight_share``, ``min_offload_weight_share``:
    1/12 of the bytes for OPT), as FlexGen's runtime places weights; "none": any fraction.
    ``runtime``: whose runtime the policy is for (``CostModel``): "flexgen" reproduces the paper,
    "localgen" (what ``localgen tune`` plans for) reads a pinned CPU-held cache in place.
    ``tiers``: "any" searches every tier at once (beside the first level that fits, so it never
    predicts less than "fewest"); "fewest" is the rule FlexGen's authors tuned their
    benchmark policies by (FlexGen benchmark/batch_size_table.md: "Find a level of memory hierarchy
    that can hold all tensors for generation. Avoid unnecessary offloading to slower storage", then
    the largest batch): the fastest policy of the first level of ``tier_levels`` where one fits. It
    gives up predicted throughput for using less of the host's RAM and SSD, and unlike "any" it can
    predict less for more memory (a model that just fits the GPU leaves the CPU's help unused).
    ``stored``: the weights' bytes as the file keeps them (a GGUF's blocks, ``CostModel``),
    which every placement then counts instead of ``dtype_bytes`` per parameter.
    ``progress(fraction, what)``: called before each batch shape is solved, ``fraction`` in [0, 1)
    an estimate of the enumeration done; an exception it raises (a user's cancel) ends the search.
    Raises NoFeasiblePolicyError when nothing fits.
    """
    if tiers not in ("any", "fewest"):
        raise ValueError(f"tiers must be 'any' or 'fewest', got {tiers!r}")
    cm = CostModel(cfg, hw, wl, form=form, mem_fraction=mem_fraction, runtime=runtime, stored=stored)
    early_stop = nb_choices is None
    if objective == "latency":
        gbs_choices, nb_choices, early_stop = (1,), (1,), False
    gbs_choices = list(flexgen_gbs_choices() if gbs_choices is None else gbs_choices)
    nb_seq = (lambda: range(1, MAX_NB + 1)) if nb_choices is None else (lambda: list(nb_choices))
    tensor = weight_granularity == "tensor" and hw.has_gpu
    bounds = (cm.min_gpu_weight_share() if tensor else 0.0, cm.min_offload_weight_share() if tensor else 0.0)
    levels = tier_levels(hw.has_gpu)
    counter = [0]
    found: list = []
    for li, allowed in enumerate(levels):
        if found and (tiers == "fewest" or li < len(levels) - 1):
            # "fewest" stops at the first level that fits. "any" goes on to every tier, keeping
            # that level's policies too: each shape's LP sees only time per layer, and its
            # placement over every tier can rank below the same shape held to fewer tiers once
            # predicted as the runtime runs it (``_as_run``)
            continue
        excluded = tuple(i for t, fr in _TIER_FRACTIONS.items() if t not in allowed for i in fr)
        report = None if progress is None else (
            lambda f, what, _li=li: progress((_li + f) / len(levels), what))
        found += _enumerate(cm, compression, gbs_choices, nb_seq, early_stop, latency_bound,
                            bounds, excluded, counter, report)
    if not found:
        fr = cm.mem_fraction
        raise NoFeasiblePolicyError(
            f"no policy fits {hw.name} for this model and workload (usable capacity GPU x {fr['gpu']}, "
            f"CPU x {fr['cpu']}, disk x {fr['disk']})" + (f" within {latency_bound} s" if latency_bound else ""))
    found.sort(key=lambda f: -f[0])
    cands = _distinct_candidates(found, num_alternatives, latency_bound, cm)
    # finishing (the tie-break LP) can move a placement and its prediction: the best finished
    cands.sort(key=lambda c: -c.throughput)
    return SearchResult(cands[0], cands[1:], counter[0])


def _enumerate(cm: CostModel, compression: Compression, gbs_choices: list[int], nb_seq, early_stop: bool,
               latency_bound, bounds: tuple[float, float], excluded: tuple[int, ...], counter: list,
               progress=None) -> list:
    """Every batch shape's best placements (``search``'s loop), with the fractions in ``excluded``
    held at 0: ``[(throughput, shape, terms, x, over)]``, [] when nothing fits. ``progress``:
    ``search``'s, with the fraction of this enumeration."""
    wg_min, off_min = bounds
    found: list[tuple[float, tuple, Terms, np.ndarray, dict | None]] = []
    options = _options(cm.hw, compression)
    for oi, opts in enumerate(options):
        for gi, gbs in enumerate(gbs_choices):
            feasible_any, prev = False, 0.0
            for nb in nb_seq():
                if progress is not None:
                    # how many batch sizes fit is unknown: each one closes half the option's gap
                    progress((oi + 1 - 0.5 ** gi) / len(options),
                             f"options {oi + 1}/{len(options)}, GPU batch {gbs} x {nb}, "
                             f"{counter[0]} LPs solved")
                terms = _without(cm.terms(gbs, nb, *opts), excluded)
                sol = _solve_granular(terms, latency_bound, wg_min, counter, off_min)
                if sol is None:
                    break  # memory and time only grow with the zig-zag block size
                feasible_any = True
                shape = (gbs, nb, opts)
                here = _as_run(cm, shape, terms, *sol)
                if cm.graphs:  # the decode forms only localgen's runtime has
                    here += _one_batch(cm, shape, latency_bound, wg_min, counter, off_min, excluded)
                    here += _all_gpu_graphed(cm, shape, latency_bound)
                found += here
                thr = max((f[0] for f in here), default=0.0)
                if early_stop and thr < prev:
                    break  # FlexGen solve(): stop growing the zig-zag block once throughput drops
                prev = thr
            if not feasible_any:
                break  # a larger GPU batch needs more working memory still
    return found


def _without(terms: Terms, excluded: tuple[int, ...]) -> Terms:
    """``terms`` with the fractions in ``excluded`` also held at 0 (tiers the policy may not use);
    ``terms`` itself when they already are (every call of the "any" search)."""
    if set(excluded) <= set(terms.fixed_zero):
        return terms
    return dataclasses.replace(terms, fixed_zero=tuple(sorted(set(terms.fixed_zero) | set(excluded))))


def _policy(shape: tuple, x: np.ndarray) -> Policy:
    """The Policy of a found entry's ``shape`` ``(gbs, nb, (cw, ck, deleg))`` and fractions."""
    gbs, nb, (cw, ck, deleg) = shape
    return Policy.from_fractions(x, gbs=gbs, num_gpu_batches=nb, compress_weight=cw,
                                 compress_cache=ck, cpu_cache_compute=deleg)


def _as_run(cm: CostModel, shape: tuple, terms: Terms, x: np.ndarray, over: dict | None) -> list:
    """``[(throughput, shape, terms, x, over)]``, the found entry for fractions ``x`` solved under
    ``terms``, ranked as the runtime would run them (``CostModel.predict``: one decode batch, or
    CUDA graphs, where the placement allows; the per-GPU-batch LP does not see that). ``[]``
    when the policy as run needs more memory than a tier has (a one-batch decode stages a whole
    step's 4-bit KV blocks of a host layer on the GPU)."""
    pred = cm.predict(_policy(shape, x))
    return [(pred.throughput, shape, terms, x, over)] if pred.fits() else []


def _one_batch(cm: CostModel, shape: tuple, latency_bound, wg_min: float, counter: list,
               off_min: float, excluded: tuple[int, ...]) -> list:
    """The best placement of this shape among those localgen decodes as one batch a step
    (``CostModel.one_batch_decode``: the GPU's kernels read every cache layer in place): the
    cache kept off the disk, not delegated; [] when none fits. A delegated cache on the GPU is
    the undelegated case, searched with its options."""
    gbs, nb, (cw, ck, deleg) = shape
    if deleg:
        return []
    terms = _without(cm.terms(gbs, nb, cw, ck, deleg, one_batch=True), excluded)
    sol = _solve_granular(terms, latency_bound, wg_min, counter, off_min, {CD: (0.0, 0.0)})
    return [] if sol is None else _as_run(cm, shape, terms, *sol)


def _all_gpu_graphed(cm: CostModel, shape: tuple, latency_bound) -> list:
    """The all-GPU policy of this shape as localgen runs it (decode as CUDA graphs: each layer's
    weights read once a step, no host work per layer); [] when it does not fit."""
    gbs, nb, opts = shape
    terms = cm.terms(gbs, nb, *opts, one_batch=True, graphed=True)
    over = {WG: (1.0, 1.0), CG: (1.0, 1.0), HG: (1.0, 1.0)}
    x = solve_lp(terms, latency_bound, bounds_override=over)
    if x is None:
        return []
    return [(evaluate_terms(terms, x).throughput, shape, terms, x, over)]


def _solve_granular(terms: Terms, latency_bound, wg_min: float, counter: list, off_min: float = 0.0,
                    fixed: dict[int, tuple[float, float]] | None = None):
    """The LP with wg restricted to {0}, [wg_min, 1 - off_min] or {1} (a disjunction: the branches are
    solved when the plain LP lands in a gap, the fastest kept). Returns (fractions, bounds_override) or None.

    Why: FlexGen's runtime (flexgen/flex_opt.py ``init_weight_list`` with ``get_choice``) places whole
    weight tensors: each tensor of a sublayer goes to the tier where the midpoint of its cumulative
    byte range falls, tiers in the order disk, CPU, GPU. A GPU share below the smallest tail matrix
    (``CostModel.min_gpu_weight_share``) puts no matrix on the GPU (only biases and layer norms), and
    a CPU/disk share below the smallest head matrix (``min_offload_weight_share``) keeps every matrix on
    the GPU: "2% of the weights on the GPU" is realized as 0%, "1% on the CPU" as 100% on the GPU.
    ``fixed``: bounds every branch keeps (index -> (lo, hi)).
    """
    fixed = fixed or {}
    counter[0] += 1
    x = solve_lp(terms, latency_bound, bounds_override=fixed)
    if x is None or WG in terms.fixed_zero or (wg_min <= 0 and off_min <= 0):
        return None if x is None else (x, fixed or None)
    lo, hi = wg_min, 1.0 - off_min
    branches = [{**fixed, WG: b} for b in [(0.0, 0.0), (1.0, 1.0)] + ([(lo, hi)] if lo <= hi else [])]
    w = x[WG]
    # an allowed solution keeps its region as the override, so the tie-break LP (``_finish``) stays in it
    for over, inside in zip(branches, (w <= 1e-9, w >= 1 - 1e-9, lo - 1e-9 <= w <= hi + 1e-9)):
        if inside:
            return x, over
    best = None
    for over in branches:
        counter[0] += 1
        xb = solve_lp(terms, latency_bound, bounds_override=over)
        if xb is not None:
            thr = evaluate_terms(terms, xb).throughput
            if best is None or thr > best[0]:
                best = (thr, xb, over)
    return None if best is None else (best[1], best[2])


def _kind(policy: Policy) -> tuple:
    """What makes two policies different in kind: the options and the slowest tier holding weights."""
    p = policy
    slowest = max((i for i, w in enumerate((p.wg, p.wc, p.wd)) if w > 1e-3), default=0)
    return p.compress_weight, p.compress_cache, p.cpu_cache_compute, slowest


def _distinct_candidates(found, k: int, latency_bound, cm: CostModel) -> list[Candidate]:
    """The best found entry and up to ``k`` runners-up of other kinds (``_kind``), each
    finished (``_finish``: two LPs, so once per kind of the solved fractions); kinds are also
    told apart on the finished policies, which the tie-break may move (an entry solved as "some
    weights on the CPU" can finish all on the GPU)."""
    out: list[Candidate] = []
    seen: set = set()
    for f in found:
        raw = _kind(_policy(f[1], f[3]))
        if raw in seen:
            continue
        seen.add(raw)
        c = _finish(f, latency_bound, cm)
        if all(_kind(o.policy) != _kind(c.policy) for o in out):
            out.append(c)
        if len(out) == k + 1:
            break
    return out


def _finish(f, latency_bound, cm: CostModel) -> Candidate:
    """The candidate's policy (the tie-break LP in its region) with ``predict``'s prediction,
    by which the candidates were ranked."""
    _, shape, terms, _, over = f
    x = solve_lp(terms, latency_bound, tie_break=True, bounds_override=over)
    policy = _policy(shape, x)
    if policy.cpu_cache_compute and set(policy.cache_tiers(cm.cfg.num_layers)) == {"gpu"}:
        policy = dataclasses.replace(policy, cpu_cache_compute=False)  # no CPU layer to attend
    return Candidate(policy, cm.predict(policy))
