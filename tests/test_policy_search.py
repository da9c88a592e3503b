"""Policy search on the FlexGen paper's T4 machine (Table 1) against its Tables 2 and 5, and LP checks."""

import numpy as np
import pytest

from localgen.policy.cost_model import CostModel, Workload
from localgen.policy.presets import preset_config
from localgen.policy.search import NoFeasiblePolicyError, search, solve_lp
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
    48 x 3 (FlexGen benchmark/flexgen/bench_suite.py, suite_30b_1x1). The search gets GPU batch 64
    (FlexGen's fitted CPU-attention rate penalizes smaller GPU batches) and block 192 rather than 144."""
    p = paper_search("opt-30b").policy
    assert 0.1 <= p.wg <= 0.3 and p.wc >= 0.7 and p.wd == 0
    assert p.cc >= 0.99 and p.hc >= 0.99
    assert p.cpu_cache_compute
    assert p.gbs == 64 and p.num_gpu_batches in (2, 3)


def test_opt175b_matches_table5():
    """Paper: no weights on GPU, half CPU half disk, cache on disk, activations on CPU."""
    p = paper_search("opt-175b").policy
    assert p.wg <= 0.05 and p.wc >= 0.25 and p.wd >= 0.3
    assert p.cg == 0 and p.cd >= 0.8 and p.hc == pytest.approx(1)


def test_opt67b_matches_table5():
    """Paper: everything on the GPU."""
    p = paper_search("opt-6.7b").policy
    assert p.wg >= 0.999 and p.hg >= 0.999 and p.cg >= 0.8


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
