"""Policy dataclass validation and JSON round trips; saved per-model defaults."""

import json

import pytest

from localgen.policy import Policy, load_saved_policy, save_policy
from localgen.policy.store import policy_path


@pytest.fixture(autouse=True)
def config_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALGEN_CONFIG_DIR", str(tmp_path))
    return tmp_path


def test_policy_json_round_trip():
    p = Policy(gbs=48, num_gpu_batches=3, wg=0.2, wc=0.8, wd=0, cg=0, cc=1, cd=0, hg=0, hc=1, hd=0,
               compress_cache=True, cpu_cache_compute=True)
    q = Policy.from_json(p.to_json())
    assert q == p and q.bls == 144
    assert p.percent_str() == "20 80 0 100 0 100"


@pytest.mark.parametrize("bad,match", [
    (dict(gbs=0), "gbs"), (dict(num_gpu_batches=1.5), "num_gpu_batches"),
    (dict(wg=0.5, wc=0.4), "weights"), (dict(cg=1.2, cc=-0.2), "cg"), (dict(hg=0.0), "activations"),
])
def test_policy_validation(bad, match):
    with pytest.raises(ValueError, match=match):
        Policy(**bad).validate()


def test_from_fractions_cleans_solver_noise():
    p = Policy.from_fractions([0.2, 0.8 + 1e-12, -1e-12, 0, 1, 0, 0, 1, 0], gbs=2)
    assert p.wd == 0 and abs(p.wg + p.wc + p.wd - 1) < 1e-15


def test_save_and_load_policy(config_dir):
    assert load_saved_policy("facebook/opt-30b") is None
    p = Policy(gbs=4, wg=0.5, wc=0.5)
    path = save_policy("facebook/opt-30b", p, {"predicted_throughput": 1.5})
    assert path == policy_path("facebook/opt-30b") and path.parent == config_dir / "policies"
    assert "/" not in path.name
    assert load_saved_policy("facebook/opt-30b") == p
    path.write_text(json.dumps({"policy": {"gbs": 1, "wg": 2.0}}))
    with pytest.raises(ValueError):
        load_saved_policy("facebook/opt-30b")


def test_describe_names_cpu_attention_only_where_some_cache_is_off_the_gpu():
    from localgen.policy import Policy

    on_gpu = Policy(gbs=4, num_gpu_batches=4, cg=1, cc=0, cpu_cache_compute=True).validate()
    split = Policy(gbs=4, num_gpu_batches=4, cg=0.5, cc=0.5, cpu_cache_compute=True).validate()
    assert not on_gpu.delegates_attention and "CPU attention" not in on_gpu.describe()
    assert split.delegates_attention and split.describe().endswith("CPU attention")
