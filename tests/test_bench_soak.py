"""`localgen bench soak` on a tiny real-architecture model: the constrained run preempts, and its
greedy outputs equal the unconstrained run's."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from localgen.cli.main import app
from tests.tiny_models import make_hf_model


def test_soak_preempts_and_matches_the_unconstrained_run(tmp_path):
    model = make_hf_model(tmp_path / "m", "smollm")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"question {i} " * (1 + i % 5)}) + "\n"
                               for i in range(12)))
    out = tmp_path / "soak.json"
    r = CliRunner().invoke(app, ["bench", "soak", "--prompts", str(prompts), "--model", str(model),
                                 "--requests", "40", "--max-tokens", "12", "--max-num-seqs", "16",
                                 "--out", str(out)])
    assert r.exit_code == 0, r.output
    res = json.loads(out.read_text())
    assert res["identical_outputs"] == 40 and res["mismatches"] == {}
    assert res["unconstrained"]["preemptions"] == 0 and res["constrained"]["preemptions"] > 0
    assert res["constrained"]["kv_blocks"] < res["unconstrained"]["kv_blocks"] / 5
