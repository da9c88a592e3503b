"""Property tests (hypothesis): capacities respected, fractions sum to 1, more memory never slower."""

import dataclasses

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from localgen.policy.cost_model import Workload
from localgen.policy.presets import preset_config
from localgen.policy.search import NoFeasiblePolicyError, search
from localgen.profiler.hardware import GiB, load_profile

T4 = load_profile("flexgen_t4")
SMALL = dict(gbs_choices=(1, 4, 16, 64), nb_choices=(1, 2, 4, 8))
models = st.sampled_from(["opt-6.7b", "opt-30b", "llama-2-7b", "llama-2-70b"])
machines = st.fixed_dictionaries({"gpu_mem": st.integers(4, 80), "cpu_mem": st.integers(16, 512),
                                  "disk_mem": st.integers(100, 4000)})
SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def hw_with(gib):
    return dataclasses.replace(T4, **{k: v * GiB for k, v in gib.items()})


def run(model, hw, wl, compression="off", tiers="any"):
    try:
        return search(preset_config(model), hw, wl, compression=compression, tiers=tiers, **SMALL)
    except NoFeasiblePolicyError:
        return None


@SETTINGS
@given(models, machines, st.integers(64, 1024), st.integers(8, 128), st.sampled_from(["off", "auto"]),
       st.sampled_from(["any", "fewest"]))
def test_policies_fit_and_sum_to_one(model, gib, s, n, compression, tiers):
    res = run(model, hw_with(gib), Workload(s, n), compression, tiers)
    if res is None:
        return
    for cand in [res.best] + res.alternatives:
        assert cand.prediction.fits()
        f = cand.policy.fractions()
        assert all(abs(sum(f[i:i + 3]) - 1) < 1e-9 for i in (0, 3, 6))
        assert all(0 <= v <= 1 for v in f)


@SETTINGS
@given(models, machines, st.integers(64, 1024), st.sampled_from(["off", "auto"]))
# "any"'s raw best once finished (its tie-break LP) below the all-GPU policy "fewest" found
@example("opt-6.7b", {"gpu_mem": 23, "cpu_mem": 16, "disk_mem": 100}, 954, "auto")
def test_fewest_tiers_never_slower_tiers_nor_faster_than_any(model, gib, s, compression):
    """``tiers="fewest"`` searches a subset of what "any" searches, level by level: its slowest tier
    is never slower than that of "any"'s policy and its prediction never higher."""
    hw, wl = hw_with(gib), Workload(s, 32)
    fewest, anyt = run(model, hw, wl, compression, "fewest"), run(model, hw, wl, compression)
    assert (fewest is None) == (anyt is None)
    if fewest is None:
        return
    assert fewest.throughput <= anyt.throughput * (1 + 1e-9)
    assert slowest_tier(fewest.policy) <= slowest_tier(anyt.policy)


def slowest_tier(p) -> int:
    """0 GPU, 1 CPU, 2 disk: the slowest tier holding any share of anything (above 1e-6)."""
    f = p.fractions()
    return max(i for i in range(3) if max(f[i], f[3 + i], f[6 + i]) > 1e-6)


@SETTINGS
@given(models, machines, st.integers(64, 1024), st.sampled_from(["gpu_mem", "cpu_mem", "disk_mem"]),
       st.floats(1.0, 4.0))
def test_more_memory_never_predicts_lower_throughput(model, gib, s, tier, factor):
    """The search over every tier (``tiers="any"``, the default). The paper's rule (``"fewest"``) is
    not monotone by design: a GPU grown to hold the whole model drops the CPU's help."""
    wl = Workload(s, 32)
    small = run(model, hw_with(gib), wl)
    bigger = dict(gib, **{tier: gib[tier] * factor})
    big = run(model, hw_with(bigger), wl)
    if small is None:
        return
    assert big is not None, "more memory made the problem infeasible"
    assert big.throughput >= small.throughput * (1 - 1e-5)
