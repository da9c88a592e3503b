"""Property tests (hypothesis): capacities respected, fractions sum to 1, more memory never slower."""

import dataclasses

from hypothesis import HealthCheck, given, settings
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


def run(model, hw, wl, compression="off"):
    try:
        return search(preset_config(model), hw, wl, compression=compression, **SMALL)
    except NoFeasiblePolicyError:
        return None


@SETTINGS
@given(models, machines, st.integers(64, 1024), st.integers(8, 128), st.sampled_from(["off", "auto"]))
def test_policies_fit_and_sum_to_one(model, gib, s, n, compression):
    res = run(model, hw_with(gib), Workload(s, n), compression)
    if res is None:
        return
    for cand in [res.best] + res.alternatives:
        assert cand.prediction.fits()
        f = cand.policy.fractions()
        assert all(abs(sum(f[i:i + 3]) - 1) < 1e-9 for i in (0, 3, 6))
        assert all(0 <= v <= 1 for v in f)


@SETTINGS
@given(models, machines, st.integers(64, 1024), st.sampled_from(["gpu_mem", "cpu_mem", "disk_mem"]),
       st.floats(1.0, 4.0))
def test_more_memory_never_predicts_lower_throughput(model, gib, s, tier, factor):
    wl = Workload(s, 32)
    small = run(model, hw_with(gib), wl)
    bigger = dict(gib, **{tier: gib[tier] * factor})
    big = run(model, hw_with(bigger), wl)
    if small is None:
        return
    assert big is not None, "more memory made the problem infeasible"
    assert big.throughput >= small.throughput * (1 - 1e-5)
