"""Policy search on the FlexGen paper's T4 machine (Table 1) against its Tables 2 and 5, and LP checks."""

from itertools import islice

import numpy as np
import pytest

from localgen.policy.cost_model import CostModel, Workload
from localgen.policy.presets import preset_config
from localgen.policy.search import NoFeasiblePolicyError, flexgen_gbs_choices, search, solve_lp
from localgen.profiler.hardware import load_profile

# FlexGen Table 2, "FlexGen" row (no compression), tokens/s on the T4 machine, gen_len 32. The prompt-512
# cells match FlexGen's benchmark/batch_size_table.md; the prompt-1024 cells could not be checked against a
# stored copy of the paper (no source reachable) and are kept as recalled.
PAPER_TABLE2 = {("opt-6.7b", 512): 25.26, ("opt-30b", 512): 7.32, ("opt-175b", 512): 0.69,
                ("opt-6.7b", 1024): 13.72, ("opt-30b", 1024): 3.50, ("opt-175b", 1024): 0.35}

_cache = {}


def paper_search(model, prompt_len=512):
    key = (model, prompt_len)
    if key not in _cache:
        _cache[key] = search(preset_config(model), load_profile("flexgen_t4"), Workload(prompt_len, 32))
    return _cache[key]


def test_opt30b_matches_table5():
    """Paper/released run: weights 20% GPU / 80% CPU, cache and activations on CPU, CPU attention,
    48 x 3 (FlexGen benchmark/flexgen/bench_suite.py, suite_30b_1x1); the issue asks for 64 x 2.
    The search gets GPU batch 64 (FlexGen's fitted CPU-attention rate penalizes smaller GPU batches)
    and 3 GPU batches: 64 x 3 predicts 7.40 tokens/s against 64 x 2's lower figure, so FlexGen's
    enumeration (every num_gpu_batches until throughput drops) keeps going to 3. With CPU RAM usable
    at 0.8 (FlexGen's alpha_c) block 192's cache no longer fits in RAM beside the weights: ~15% of it
    goes to disk, whose reads hide under the decode step's CPU attention (same predicted time)."""
    p = paper_search("opt-30b").policy
    assert 0.1 <= p.wg <= 0.3 and p.wc >= 0.7 and p.wd == 0
    assert p.cg == 0 and p.cc >= 0.8 and p.hc >= 0.99
    assert p.cpu_cache_compute
    assert p.gbs == 64 and p.num_gpu_batches in (2, 3)


def test_opt175b_matches_table5():
    """Paper: no weights on GPU, half CPU half disk, cache on disk, activations on CPU.
    wg == 0 now holds (FlexGen's runtime cannot place a share below one whole matrix on the GPU).
    Not reproduced: wc ~0.5. The model prefers ~8% of the (1.1 TB) cache in RAM over weights there
    and keeps ~1% of the cache (and 0.2% of the activations) in spare GPU memory, so wc is ~0.22 with RAM usable at 0.8."""
    p = paper_search("opt-175b").policy
    assert p.wg == 0 and p.wc >= 0.15 and p.wd >= 0.3
    assert p.cg <= 0.02 and p.cd >= 0.8 and p.hc >= 0.99


def test_opt67b_matches_table5():
    """Paper: everything on the GPU (the search keeps ~11% of the cache in RAM for a larger GPU batch)."""
    p = paper_search("opt-6.7b").policy
    assert p.wg >= 0.999 and p.hg >= 0.999 and p.cg >= 0.8


def test_gbs_enumeration_is_flexgens():
    """FlexGen experimental/cost_model.py solve(): 1, 2, 3, 4, then doubling."""
    assert list(islice(flexgen_gbs_choices(), 9)) == [1, 2, 3, 4, 8, 16, 32, 64, 128]


def test_usable_capacity_fractions_per_tier():
    """GPU 0.9; CPU RAM and disk 0.8 (FlexGen's alpha_c, alpha_n); a float applies to every tier."""
    hw = load_profile("flexgen_t4")
    cm = CostModel(preset_config("opt-30b"), hw, Workload(512, 32))
    cap = cm.terms(8, 1).capacity
    assert cap["gpu"] == pytest.approx(0.9 * hw.gpu_mem)
    assert cap["cpu"] == pytest.approx(0.8 * hw.cpu_mem) and cap["disk"] == pytest.approx(0.8 * hw.disk_mem)
    cap = CostModel(preset_config("opt-30b"), hw, Workload(512, 32), mem_fraction=0.5).terms(8, 1).capacity
    assert all(cap[t] == pytest.approx(0.5 * getattr(hw, f"{t}_mem")) for t in ("gpu", "cpu", "disk"))


def test_gpu_weight_share_is_zero_or_a_whole_matrix():
    """FlexGen flex_opt.py init_weight_list/get_choice: OPT's last attention matrix (w_out) reaches the
    GPU at wg > 1/8; smaller shares are realized as none, so the search never returns 0 < wg < 1/8."""
    cm = CostModel(preset_config("opt-175b"), load_profile("flexgen_t4"), Workload(512, 32))
    assert cm.min_gpu_weight_share() == pytest.approx(1 / 8)
    for model in ("opt-30b", "opt-175b", "opt-6.7b"):
        res = paper_search(model)
        for cand in [res.best] + res.alternatives:
            assert cand.policy.wg == 0 or cand.policy.wg >= 1 / 8 - 1e-9
    free = search(preset_config("opt-175b"), load_profile("flexgen_t4"), Workload(512, 32),
                  weight_granularity="none", gbs_choices=(8,))
    assert free.throughput >= paper_search("opt-175b").throughput * 0.9  # the rule costs little


def test_six_cell_table(capsys):
    """Predicted vs paper for all six cells of Table 2 (printed; run with -s to see it)."""
    rows = []
    for (model, s), paper in sorted(PAPER_TABLE2.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        r = paper_search(model, s)
        rows.append(f"{model:9s} s={s:<5d} predicted {r.throughput:7.3f}  paper {paper:6.2f}  "
                    f"ratio {r.throughput / paper:5.2f}  {r.policy.describe()}")
    with capsys.disabled():
        print("\n" + "\n".join(rows))
    assert len(rows) == 6


@pytest.mark.parametrize("model,prompt_len", sorted(PAPER_TABLE2))
def test_throughput_within_2x_of_table2(model, prompt_len):
    got, paper = paper_search(model, prompt_len).throughput, PAPER_TABLE2[(model, prompt_len)]
    assert paper / 2 <= got <= paper * 2, f"{model} s={prompt_len}: predicted {got:.3f}, paper {paper}"


def test_returned_policies_satisfy_the_lp_constraints():
    res = paper_search("opt-175b")
    for cand in [res.best] + res.alternatives:
        p = cand.policy
        for g in (p.fractions()[0:3], p.fractions()[3:6], p.fractions()[6:9]):
            assert sum(g) == pytest.approx(1, abs=1e-9) and min(g) >= 0
        assert cand.prediction.fits()
    assert res.alternatives and all(a.throughput <= res.throughput * (1 + 1e-9) for a in res.alternatives)


def test_lp_solution_is_no_worse_than_a_hand_policy():
    cm = CostModel(preset_config("opt-30b"), load_profile("flexgen_t4"), Workload(512, 32))
    terms = cm.terms(48, 3, cpu_cache_compute=True)
    x = solve_lp(terms)
    from localgen.policy.cost_model import evaluate_terms
    paper_x = np.array([0.2, 0.8, 0, 0, 1, 0, 0, 1, 0])
    hand = evaluate_terms(terms, paper_x)
    if hand.fits():
        assert evaluate_terms(terms, x).throughput >= hand.throughput * (1 - 1e-6)


def test_latency_objective_is_batch_one_on_gpu():
    res = search(preset_config("opt-6.7b"), load_profile("flexgen_t4"), Workload(512, 32), objective="latency")
    assert res.policy.bls == 1 and res.policy.wg >= 0.999 and res.policy.cg >= 0.999


def test_latency_bound_is_respected():
    free = paper_search("opt-30b")
    bound = free.prediction.total_time / 3
    res = search(preset_config("opt-30b"), load_profile("flexgen_t4"), Workload(512, 32), latency_bound=bound)
    assert res.prediction.total_time <= bound * (1 + 1e-6)
    assert res.throughput <= free.throughput * (1 + 1e-6)
    with pytest.raises(NoFeasiblePolicyError):
        search(preset_config("opt-30b"), load_profile("flexgen_t4"), Workload(512, 32), latency_bound=1.0)


def test_compression_auto_is_at_least_as_fast_as_off():
    off = paper_search("opt-175b")
    auto = search(preset_config("opt-175b"), load_profile("flexgen_t4"), Workload(512, 32), compression="auto")
    assert auto.throughput >= off.throughput * (1 - 1e-6)
    assert auto.policy.compress_weight or auto.policy.compress_cache  # 4-bit pays off for 175B


def test_cpu_only_search():
    res = search(preset_config("smollm2-135m"), load_profile("cpu_2core"), Workload(128, 32))
    p = res.policy
    assert p.wg == p.cg == p.hg == 0 and not p.cpu_cache_compute
    assert res.throughput > 0 and "gpu" not in res.prediction.capacity


def test_nothing_fits():
    hw = load_profile("flexgen_t4")
    hw.disk_mem, hw.cpu_mem = 10**9, 10**9
    with pytest.raises(NoFeasiblePolicyError):
        search(preset_config("opt-175b"), hw, Workload(512, 32))
