"""`localgen bench offload`'s measurement on the CPU: repeats, the reported median and the
end-to-end wall throughput, on a tiny Llama with dummy weights."""

from __future__ import annotations

import pytest
import torch

from localgen.bench.offload_bench import RunResult, print_result, run_localgen
from localgen.models.config import ModelConfig
from localgen.models.dummy import DummyStore
from localgen.models.model import family_of
from localgen.policy.presets import HF_CONFIGS
from tests.test_offload import P

TINY = {**HF_CONFIGS["llama-2-7b"], "vocab_size": 320, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


def test_repeats_report_the_median_run_and_the_wall():
    cfg = ModelConfig.from_hf_dict(TINY)
    batch, gen = 2, 4
    r = run_localgen(cfg, DummyStore(cfg, family_of(cfg)), P(gbs=2), batch, 8, gen, device="cpu",
                     dtype=torch.float32, timed_steps=0, repeats=3)
    assert len(r.repeats) == 3 and not r.error
    by_speed = sorted(r.repeats, key=lambda x: x[0] + x[1])
    assert [r.prefill_s, r.decode_s] == by_speed[1][:2]  # the median repeat, not the best
    assert r.tokens_per_s == batch * gen / (r.prefill_s + r.decode_s)
    for pre, dec, wall in r.repeats:
        assert wall >= pre + dec  # the wall counts the engine between the model steps too
    assert r.wall_tokens_per_s == batch * gen / by_speed[1][2] <= r.tokens_per_s


def test_print_result_shows_the_wall_line():
    lines = []
    r = RunResult("localgen", 2, 0.5, 1.5, 4.0, 3.0, "p", wall_tokens_per_s=3.5,
                  repeats=[[0.5, 1.5, 2.3]] * 3)
    print_result(r, out=lines.append)
    assert any("end to end" in s and "3.50 tokens/s" in s and "median of 3" in s for s in lines)


def test_isolated_runs_one_process_per_policy_and_peer_batch(monkeypatch, tmp_path):
    import json
    import subprocess

    from localgen.bench import offload_bench

    calls = []

    def fake_run(cmd):
        calls.append(cmd)
        args = cmd[cmd.index("localgen.bench.offload_bench") + 1:]
        out = args[args.index("--out") + 1]
        if "--policy" in args and args[args.index("--policy") + 1].startswith("9"):
            return subprocess.CompletedProcess(cmd, 1)  # a child that died before writing
        name = "localgen" if "--policy" in args else "accelerate"
        with open(out, "w") as f:
            json.dump([{"name": name, "batch": len(calls), "prefill_s": 1.0, "decode_s": 1.0,
                        "tokens_per_s": 1.0, "decode_tokens_per_s": 1.0}], f)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    res_file = tmp_path / "all.json"
    argv = ["--policy", "4,4,100,0,100,0,100,0,w4", "--policy", "9,1,100,0,100,0,100,0",
            "--peer-batches", "1,8", "--device", "cpu", "--isolate", "--repeats", "2",
            "--out", str(res_file)]
    assert offload_bench.main(argv) == 0
    jobs = [c[c.index("localgen.bench.offload_bench") + 1:] for c in calls]
    assert len(jobs) == 4
    for job in jobs:  # every child: one job, the shared options, never isolating again
        assert "--no-isolate" in job and "--isolate" not in job and job.count("--out") == 1
        assert job[job.index("--repeats") + 1] == "2" and str(res_file) not in job
    assert jobs[0][jobs[0].index("--policy") + 1] == "4,4,100,0,100,0,100,0,w4"
    assert jobs[0][jobs[0].index("--peer-batches") + 1] == ""
    assert [j[j.index("--peer-batches") + 1] for j in jobs[2:]] == ["1", "8"]
    assert all("--policy" not in j for j in jobs[2:])
    rows = json.loads(res_file.read_text())
    assert [r["name"] for r in rows] == ["localgen", "localgen", "accelerate", "accelerate"]
    assert "subprocess exit 1" in rows[1]["error"] and not rows[0]["error"]
    assert rows[1]["batch"] == 9 and rows[1]["policy"] == "9,1,100,0,100,0,100,0"


def test_engine_config_sizes_the_cache_in_its_storage_format():
    from localgen.runtime.offload.runner import plan_kv_blocks
    from localgen.runtime.offload.timed_run import engine_config

    cfg = ModelConfig.from_hf_dict(HF_CONFIGS["llama-2-7b"])
    need = 16 * -(-(512 + 32) // 16)  # 34 blocks a sequence
    for kv4 in (False, True):
        pol = P(gbs=4, ngb=4, compress_cache=kv4)
        ec = engine_config(cfg, pol, 16, 512, 32)
        n = plan_kv_blocks(cfg, pol, 16, torch.float16, torch.device("cpu"), ec.kv_cache_memory, 1)
        assert n == need + 16  # every sequence's blocks and one spare each, no more
    # 4-bit: 64 code bytes + 2 fp16 scale/min pairs per head and token, for K and V
    assert ec.kv_cache_memory == (need + 16) * 16 * 32 * 32 * 2 * (64 + 8)


def test_peer_ratios_against_the_best_and_the_best_within_the_cap():
    from localgen.bench.offload_bench import GiB, RunResult, peer_ratios

    def acc(batch, tps, peak):
        return RunResult("accelerate", batch, 1.0, 1.0, tps, tps,
                         memory_gib={"cuda_max_allocated": peak})

    lg = RunResult("localgen", 56, 1.0, 1.0, 93.0, 110.0)
    runs = [lg, acc(1, 0.2, 15.6), acc(8, 1.2, 20.6), acc(32, 4.65, 38.1),
            RunResult("accelerate", 64, 0, 0, 0, 0, error="OOM")]
    (line,) = peer_ratios(runs, 16 * GiB)
    assert "best (batch 32, 4.65 tok/s): 20.0x" in line
    assert "within the 16.0 GiB cap (batch 1, 0.20 tok/s): 465.0x" in line
    (line,) = peer_ratios(runs[:1] + runs[2:], 16 * GiB)
    assert "no accelerate batch stayed within the 16.0 GiB cap" in line
    assert peer_ratios([lg], 16 * GiB) == []


def test_accelerate_within_the_cap_leaves_room_for_its_cache_and_activations():
    """``--peer-fit``: accelerate's weights get the cap less its fp16 KV cache (every layer, prompt
    + generated tokens) and its prefill activations less 1 GiB; ``--peer-batches fit`` is the
    largest batch whose budget still holds the embeddings and the one offloaded layer accelerate
    reserves room for. OPT-30B at 16 GiB, hand-computed: 16 sequences."""
    from localgen.bench.offload_bench import GiB, accelerate_fit_batch, accelerate_weight_budget

    cfg = ModelConfig.from_hf_dict(HF_CONFIGS["opt-30b"])
    cache = 544 * 48 * 2 * 7168 * 2  # per sequence: 748,683,264 bytes
    acts = 512 * (4 * 7168 + 2 * 28672) * 2  # per sequence: 88,080,384 bytes
    assert accelerate_weight_budget(cfg, 16, 512, 32, 16 * GiB) == 16 * GiB - 16 * (cache + acts) - GiB
    need = (cfg.global_parameters() + cfg.layer_parameters()) * 2
    assert accelerate_weight_budget(cfg, 16, 512, 32, 16 * GiB) >= need  # 2.53 GiB
    assert accelerate_weight_budget(cfg, 17, 512, 32, 16 * GiB) < need  # 1.75 GiB < 1.85
    assert accelerate_fit_batch(cfg, 512, 32, 16 * GiB) == 16
    assert accelerate_fit_batch(cfg, 512, 32, 2 * GiB) == 0  # not even one sequence fits


def test_peer_batches_fit_resolves_to_the_largest_batch_within_the_cap():
    import argparse

    from localgen.bench.offload_bench import GiB, _peer_batches

    cfg = ModelConfig.from_hf_dict(HF_CONFIGS["opt-30b"])
    a = argparse.Namespace(peer_batches="1,fit", prompt_len=512, gen_len=32)
    assert _peer_batches(a, cfg, 16 * GiB) == [1, 16]
    with pytest.raises(ValueError, match="cap"):
        _peer_batches(a, cfg, None)
