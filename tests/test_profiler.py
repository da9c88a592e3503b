"""HardwareProfile round trips, shipped profiles, and the probes on a CPU-only machine."""

import dataclasses
import os

import pytest
import torch

from localgen.profiler.hardware import (HardwareProfile, ProfileNotFoundError, load_profile,
                                        shipped_profile_names)
from localgen.profiler import probes
from tests.conftest import KERNEL_DEVICE


@pytest.fixture(autouse=True)
def config_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALGEN_CONFIG_DIR", str(tmp_path / "cfg"))
    return tmp_path / "cfg"


def test_shipped_profiles_load_and_cite_sources():
    assert {"flexgen_t4", "h200", "cpu_2core"} <= set(shipped_profile_names())
    for name in shipped_profile_names():  # the GEMM tables and softmax calibrations are not listed
        assert load_profile(name).name
    t4 = load_profile("flexgen_t4")
    assert t4.has_gpu and t4.gpu_mem == 15843721216 and t4.dtoc_bdw == 2e9 and t4.ctod_bdw == 1e9
    h200 = load_profile("h200")
    assert h200.gpu_mem_bdw == 4.24e12 and h200.ctog_bdw == 55e9 and h200.ctog_bdw_pageable == 22e9
    assert h200.mm_flops == 767e12
    cpu = load_profile("cpu_2core")
    assert not cpu.has_gpu and cpu.compute_device == "cpu" and cpu.cpu_cores == 2
    for p in (t4, h200):
        for f in ("ctog_bdw", "gtoc_bdw", "dtoc_bdw", "ctod_bdw", "mm_flops", "cpu_flops", "gpu_mem"):
            assert f in p.source, f"{p.name}: no source for {f}"


def test_json_round_trip_and_save_load(config_dir):
    p = load_profile("flexgen_t4")
    assert HardwareProfile.from_json(p.to_json()) == p
    q = dataclasses.replace(p, name="mine")
    path = q.save()
    assert path == config_dir / "hardware.json"
    assert load_profile(None) == q and load_profile(str(path)) == q


def test_missing_profile_errors(config_dir):
    with pytest.raises(ProfileNotFoundError, match="flexgen_t4"):
        load_profile("no_such_machine")
    with pytest.raises(ProfileNotFoundError, match="localgen profile"):
        load_profile(None)


def test_validation_names_the_field():
    d = load_profile("flexgen_t4").to_dict()
    d["ctog_bdw"] = None
    with pytest.raises(ValueError, match="ctog_bdw"):
        HardwareProfile.from_dict(d)
    d = load_profile("cpu_2core").to_dict()
    d["cpu_flops"] = 0
    with pytest.raises(ValueError, match="cpu_flops"):
        HardwareProfile.from_dict(d)


def test_best_time_takes_the_minimum():
    calls = iter([0.0, 0.05, 0.01, 0.03])  # warm-up, then three timed runs

    import time
    def fn():
        time.sleep(next(calls))
    assert 0.009 <= probes.best_time(fn, repeats=3) < 0.03


def test_disk_probe_bypasses_the_page_cache(tmp_path):
    dtoc, ctod, method = probes.probe_disk_bdw(tmp_path / "off", 4 << 20, repeats=2)
    assert dtoc > 0 and ctod > 0 and method in ("O_DIRECT", "fadvise")
    assert not list((tmp_path / "off").iterdir())  # the scratch file is removed


def test_disk_probe_falls_back_without_o_direct(tmp_path, monkeypatch):
    monkeypatch.delattr(os, "O_DIRECT", raising=False)
    _, _, method = probes.probe_disk_bdw(tmp_path, 1 << 20, repeats=1)
    assert method == "fadvise"


def test_cpu_only_profile_run(tmp_path, config_dir):
    steps = []
    hw = probes.run_profile(tmp_path / "off", sizes=probes.QUICK, use_gpu=False,
                            progress=lambda s, i, n: steps.append((s, i, n)))
    assert not hw.has_gpu and hw.ctog_bdw is None and hw.gpu_mem == 0
    for f in ("dtoc_bdw", "ctod_bdw", "mm_flops", "mm_flops_gen", "bmm_flops", "bmm_flops_gen", "cpu_flops",
              "cpu_mem_bdw", "cpu_mem", "disk_mem"):
        assert getattr(hw, f) > 0, f
    assert steps[0][0] == "capacities" and steps[-1] == ("done", steps[-1][2], steps[-1][2])
    assert HardwareProfile.from_json(hw.to_json()) == hw


def test_mm_probe_counts_flops(monkeypatch):
    monkeypatch.setattr(probes, "best_time", lambda fn, repeats=5, sync=None: 2.0)
    assert probes.probe_mm_flops("cpu", (4, 8, 16)) == 2 * 4 * 8 * 16 / 2.0
    assert probes.probe_bmm_flops("cpu", (3, 1, 8, 16)) == 2 * 3 * 8 * 16 / 2.0


def test_cpu_attention_probe_counts_kv_bytes_and_runs_the_runtime_path(monkeypatch):
    """``cpu_flops`` comes from the delegated decode attention itself: the probe's timed step
    gathers blocks through a shuffled block table and returns what ``paged_decode_attention``
    computes (checked here against float64 attention over the unshuffled sequences); the rate is
    K/V bytes at 2 bytes an element (= MHA FLOPs, App. A.3) over the best time."""
    import torch

    monkeypatch.setattr(probes, "best_time", lambda fn, repeats=5, sync=None: 0.5)
    seqs, kvh, d, ctx = 3, 2, 16, 37
    rate = probes.probe_cpu_attention((seqs, kvh, d, ctx), dtype=torch.float32)
    assert rate == 2 * 2 * seqs * kvh * d * ctx / 0.5
    run, (q, k, v, tables) = probes.cpu_attention_case((seqs, kvh, d, ctx), torch.float32)
    out = run()
    for i in range(seqs):
        kk = k[tables[i]].flatten(0, 1)[:ctx].double()  # [ctx, kvh, d]
        vv = v[tables[i]].flatten(0, 1)[:ctx].double()
        p = torch.softmax(torch.einsum("hd,thd->ht", q[i].double(), kk) * d ** -0.5, dim=-1)
        assert torch.allclose(out[i].double(), torch.einsum("ht,thd->hd", p, vv), atol=1e-5)


def test_cpu_only_profile_takes_cpu_flops_from_the_attention_probe(tmp_path, monkeypatch):
    monkeypatch.setattr(probes, "probe_cpu_attention", lambda shape, dtype=None, repeats=5: 1234.0)
    hw = probes.run_profile(tmp_path / "off", sizes=probes.QUICK, use_gpu=False)
    assert hw.cpu_flops == 1234.0 and "delegated CPU decode attention" in hw.source["cpu_flops"]


def test_gpu_kernel_probes_time_the_runtime_kernels(monkeypatch):
    """The two probes for localgen's own GPU kernels, run on the kernels' device (the CPU under
    TRITON_INTERPRET=1, else the GPU) with the graph timer replaced: the floor is the replay time over the kernels it holds (three
    a round), the int4 rate the codes + scale/min bytes the calls read over their time."""
    pytest.importorskip("triton")
    dev = str(KERNEL_DEVICE)
    fns = probes.small_kernel_case(dev, tokens=3, hidden=64, inter=96, kv_heads=2, head_dim=64)
    for f in fns:  # each kernel runs at these sizes
        f()
    call, nbytes = probes.int4_attention_case((2, 2, 64, 40), dev)
    out = call()
    assert out.shape == (2, 2, 64) and torch.isfinite(out).all()
    assert nbytes == 2 * 2 * 40 * 2 * (32 + 4)  # K and V: 32 code bytes + scale and min a token
    timed = []
    from localgen.kernels import dispatch

    # cuda_timer's per-call time when the whole replay takes 6e-5 s
    monkeypatch.setattr(dispatch, "cuda_timer",
                        lambda f, warmup=3, repeat=20: timed.append(len(f)) or 6e-5 / len(f))
    monkeypatch.setattr(probes, "small_kernel_case", lambda dev: fns)
    assert probes.probe_kernel_floor(rounds=4) == pytest.approx(6e-5 / 12)
    made = []  # the int4 calls each get a cache of their own (no L2 reuse between them)
    monkeypatch.setattr(probes, "int4_attention_case", lambda shape, dev: made.append(shape) or (call, 1000))
    assert probes.probe_int4_attention(calls=5) == pytest.approx(5 * 1000 / 6e-5)
    assert timed == [12, 5] and len(made) == 5


def test_layer_host_probe_is_the_slope_over_the_layer_count(monkeypatch):
    """The eager-layer host probe runs the offloaded runtime's decode path (4-bit weights
    streamed, 4-bit KV; on the CPU here) and reports the slope of a step's time over the layer
    count: per-step work, the same for both models, cancels. With the runtime replaced by a
    clock of 3 ms a step plus 0.5 ms a layer, the slope is 0.5 ms."""
    decode = probes.layer_host_case(2, "cpu", batch=2, prompt_len=4)
    assert decode(2) > 0  # two real decode steps of the tiny model
    monkeypatch.setattr(probes, "layer_host_case",
                        lambda n, dev: lambda steps: steps * (3e-3 + n * 5e-4))
    assert probes.probe_layer_host("cpu", layers=(2, 10), steps=4, repeats=2) == pytest.approx(5e-4)
