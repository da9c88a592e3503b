"""The llama.cpp peer through its own tools: the command lines it runs and how it reads their
output, with stand-in tools (shell scripts) that print what llama-bench and llama-batched-bench
print and record their arguments."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from localgen.bench import llama_cpp_peer as lp

BENCH_JSON = [
    {"n_prompt": 128, "n_gen": 0, "avg_ts": 2000.5, "model_size": 96577536},
    {"n_prompt": 0, "n_gen": 64, "avg_ts": 85.25, "model_size": 96577536},
]
BATCHED = ("main: n_kv_max = 3328 ...\n"
           '{"n_kv_max": 3328, "pp": 128, "tg": 64, "pl": 16, "n_kv": 3072, "t_pp": 1.0, '
           '"speed_pp": 2048.0, "t_tg": 2.0, "speed_tg": 512.0, "t": 3.0, "speed": 1024.0}\n')


def fake_tool(folder: Path, name: str, output: str) -> Path:
    path = folder / name
    out = folder / f"{name}.out"
    out.write_text(output)
    path.write_text(f'#!/bin/sh\necho "$@" > "{folder}/{name}.args"\ncat "{out}"\n')
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def test_parsers_read_the_tools_output():
    assert lp.parse_llama_bench("build: x\n" + json.dumps(BENCH_JSON)) == (2000.5, 85.25, 96577536)
    assert lp.parse_batched_bench(BATCHED) == {16: (2048.0, 512.0)}
    with pytest.raises(lp.PeerError, match="no JSON"):
        lp.parse_llama_bench("error: failed to load model")
    with pytest.raises(lp.PeerError, match="pp or a tg"):
        lp.parse_llama_bench(json.dumps(BENCH_JSON[:1]))
    with pytest.raises(lp.PeerError, match="no result"):
        lp.parse_batched_bench("| PP | TG |\n")


def test_run_peer_command_lines(tmp_path, monkeypatch):
    fake_tool(tmp_path, "llama-bench", json.dumps(BENCH_JSON))
    fake_tool(tmp_path, "llama-batched-bench", BATCHED)
    monkeypatch.delenv(lp.BIN_ENV, raising=False)
    runs = lp.run_peer("m.gguf", [1, 16], 128, 64, threads=2, gpu=True, where=tmp_path, repeat=3)
    assert runs == [lp.PeerRun(1, 2000.5, 85.25, 96577536), lp.PeerRun(16, 2048.0, 512.0)]
    bench = (tmp_path / "llama-bench.args").read_text().split()
    assert bench == ["-m", "m.gguf", "-t", "2", "-ngl", "99", "-p", "128", "-n", "64", "-r", "3",
                     "-o", "json"]
    batched = (tmp_path / "llama-batched-bench.args").read_text().split()
    assert batched[batched.index("-npl") + 1] == "16" and batched[batched.index("-ngl") + 1] == "99"
    assert int(batched[batched.index("-c") + 1]) >= 16 * (128 + 64)


def test_tools_found_through_the_environment_and_missing_ones_named(tmp_path, monkeypatch):
    fake_tool(tmp_path, "llama-bench", json.dumps(BENCH_JSON))
    monkeypatch.setenv(lp.BIN_ENV, str(tmp_path))
    monkeypatch.setenv("PATH", os.defpath)
    assert lp.find_tool("llama-bench") == tmp_path / "llama-bench"
    assert lp.run_peer("m.gguf", [1], 8, 8, threads=1, gpu=False)[0].decode_tokens_per_s == 85.25
    with pytest.raises(lp.PeerError, match="llama-batched-bench not found"):
        lp.run_peer("m.gguf", [4], 8, 8, threads=1, gpu=False)


def test_a_failing_tool_says_so(tmp_path):
    tool = tmp_path / "llama-bench"
    tool.write_text("#!/bin/sh\necho 'error: unknown model architecture' >&2\nexit 1\n")
    tool.chmod(0o755)
    with pytest.raises(lp.PeerError, match="exited with 1: error: unknown model architecture"):
        lp.run_peer("m.gguf", [1], 8, 8, threads=1, gpu=False, where=tmp_path)
