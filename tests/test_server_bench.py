"""`localgen bench serve`'s pieces: percentiles and summaries by hand, the report's ratios, and a
short real run that starts `localgen serve` as a process (a tiny model) and drives it."""

from __future__ import annotations

from pathlib import Path

import pytest

from localgen.bench import serve_bench
from localgen.bench.serve_bench import (LevelResult, RequestTiming, ServeBenchResult, percentile,
                                        summarize)
from tests.tiny_models import make_hf_model


def test_percentile_interpolates_between_ranks():
    assert percentile([], 0.5) is None
    assert percentile([3.0], 0.99) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5
    assert percentile([float(i) for i in range(101)], 0.99) == pytest.approx(99.0)


def test_summarize_pools_gaps_and_counts_tokens():
    timings = [RequestTiming(0.1, [0.01, 0.03], 3, 10), RequestTiming(0.3, [0.02], 2, 12)]
    r = summarize("x", 2, timings, seconds=0.5)
    assert (r.requests, r.output_tokens, r.prompt_tokens) == (2, 5, 11)
    assert r.tokens_per_s == 10.0
    assert r.ttft_p50 == pytest.approx(0.2) and r.itl_p50 == pytest.approx(0.02)


def test_report_prints_ratios_to_the_peer():
    res = ServeBenchResult("m", "m.gguf", 128, 64, (16,))
    res.localgen.append(LevelResult("localgen", 16, 32, 2.0, 3000, 300.0, 0.2, 0.4, 0.02, 0.05))
    res.llama_server.append(LevelResult("llama-server", 16, 32, 2.0, 1000, 300.0, 0.1, 0.2, 0.04, 0.05))
    lines = serve_bench.report(res)
    ratio = next(line for line in lines if "ratio" in line).split()
    assert ratio[1:] == ["3.00x", "2.00x", "2.00x", "0.50x", "1.00x"]
    assert "(300 tokens)" in lines[0]


def test_a_short_run_against_localgen_serve(tmp_path):
    model = make_hf_model(tmp_path, "smollm")
    res = serve_bench.run(str(model), None, levels=(1, 2), prompt_words=4, max_tokens=3,
                          requests_per_level=3)
    assert [r.concurrency for r in res.localgen] == [1, 2] and res.llama_server == []
    for r in res.localgen:
        assert (r.requests, r.errors, r.output_tokens) == (3, 0, 9)
        assert r.ttft_p50 > 0 and r.prompt_tokens >= 4
    assert any("no llama-server peer" in line for line in serve_bench.report(res))


def test_the_dtype_reaches_localgen_serve_and_the_report():
    assert serve_bench.localgen_cmd(None, 8000, 64)[-2:] != ["--dtype", "float32"]
    cmd = serve_bench.localgen_cmd("m.gguf", 8000, 64, "float32")
    assert cmd[-4:] == ["--model", "m.gguf", "--dtype", "float32"]
    res = ServeBenchResult("m", "m.gguf", 128, 64, (1,), dtype="float32")
    assert serve_bench.report(res)[0].startswith("model m (float32): prompt 128 words")
    assert res.to_json()["dtype"] == "float32"


def test_llama_server_takes_every_layer_to_the_gpu_only_when_asked():
    cpu = serve_bench.llama_server_cmd(Path("llama-server"), Path("m.gguf"), 8000, 16, 320)
    gpu = serve_bench.llama_server_cmd(Path("llama-server"), Path("m.gguf"), 8000, 16, 320, True)
    assert "-ngl" not in cpu and gpu[-2:] == ["-ngl", "99"]
    assert cpu[cpu.index("-c") + 1] == str(16 * 320) and cpu[cpu.index("--parallel") + 1] == "16"
