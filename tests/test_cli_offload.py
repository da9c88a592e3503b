"""`localgen chat` and `localgen batch` under an offloading policy (issue 6): the policy `localgen
tune` saved, or FlexGen's flags over it, printed with its predicted peak per tier before loading
and handed to the loader; chat's memory panel gets the prediction. Loaders are faked; the
prediction is the cost model's for the embedded model's real config."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from localgen.cli import batch_cmd, chat_cmd
from localgen.cli.main import app
from localgen.policy.policy import Policy
from localgen.policy.store import save_policy


@pytest.fixture
def config_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALGEN_CONFIG_DIR", str(tmp_path / "config"))
    return tmp_path


@pytest.fixture
def chat_calls(monkeypatch):
    """``make_service``'s keywords for each chat run; the app itself does not open."""
    calls = []

    class Service:
        state, error = "ready", None

    def make_service(model, **kw):
        calls.append(dict(kw, model=model))
        return Service()

    monkeypatch.setattr(chat_cmd, "make_service", make_service)
    from localgen.tui import chat

    monkeypatch.setattr(chat.ChatApp, "run", lambda self: None)
    return calls


def test_chat_takes_the_flags_prints_the_prediction_and_feeds_the_panel(config_dir, chat_calls):
    res = CliRunner().invoke(app, ["chat", "--percent", "0", "100", "0", "100", "100", "0",
                                   "--gpu-batch-size", "1", "--compress-cache", "--gpu-memory", "2GiB"])
    assert res.exit_code == 0, res.output
    assert "policy: gbs 1 x 1" in res.output and "predicted peak memory (prompt 512 + 512 tokens)" in res.output
    (kw,) = chat_calls
    pol = kw["offload"]["policy"]
    assert (pol.wg, pol.wc, pol.cg, pol.cc, pol.compress_cache) == (0, 1, 0, 1, True)
    assert kw["offload"]["gpu_memory"] == 2 << 30
    peak = kw["predicted_peak"]
    assert set(peak) == {"gpu", "cpu", "disk"} and peak["cpu"] > 0 and peak["disk"] == 0


def test_chat_uses_the_saved_policy_and_nothing_without_one(config_dir, chat_calls):
    res = CliRunner().invoke(app, ["chat"])
    assert res.exit_code == 0, res.output
    assert chat_calls[-1]["offload"] == {} and chat_calls[-1]["predicted_peak"] is None
    assert "policy:" not in res.output
    save_policy("smollm2-135m", Policy(gbs=2, num_gpu_batches=1, wg=0.5, wc=0.5, wd=0.0))
    res = CliRunner().invoke(app, ["chat"])
    assert res.exit_code == 0, res.output
    pol = chat_calls[-1]["offload"]["policy"]
    assert (pol.gbs, pol.wg) == (2, 0.5) and chat_calls[-1]["predicted_peak"]["gpu"] >= 0


def test_batch_passes_the_flags_to_the_loader(config_dir, monkeypatch, tmp_path):
    seen = {}

    def load(model, **kw):
        seen.update(kw)
        raise SystemExit(3)  # the policy reached the loader: stop here

    monkeypatch.setattr(batch_cmd, "load_llm", load)
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "hi"}\n')
    res = CliRunner().invoke(app, ["batch", str(src), "-o", str(tmp_path / "out.jsonl"),
                                   "--percent", "50", "50", "100", "0", "100", "0", "--num-gpu-batches", "2"])
    assert res.exit_code == 3
    assert "predicted peak memory (prompt 512 + 256 tokens)" in res.stderr
    pol = seen["policy"]
    assert (pol.wg, pol.wc, pol.num_gpu_batches) == (0.5, 0.5, 2)


def test_bench_kernels_forwards_its_options(monkeypatch, tmp_path):
    """`localgen bench kernels` hands every option to the typer-free benchmark, and on a machine
    without CUDA the benchmark says so."""
    import torch

    from localgen.bench import kernels_bench
    seen = {}
    monkeypatch.setattr(kernels_bench, "main", lambda argv: seen.setdefault("argv", argv))
    out = tmp_path / "k.json"
    res = CliRunner().invoke(app, ["bench", "kernels", "--out", str(out), "--batches", "8",
                                   "--block-size", "64", "--no-int4", "--dtype", "float16"])
    assert res.exit_code == 0, res.output
    argv = seen["argv"]
    assert argv[argv.index("--block-size") + 1] == "64" and "--no-int4" in argv
    assert argv[argv.index("--dtype") + 1] == "float16"
    assert argv[argv.index("--batches") + 1] == "8" and "--no-ref" not in argv
    monkeypatch.undo()
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            kernels_bench.main(["--out", str(out)])
