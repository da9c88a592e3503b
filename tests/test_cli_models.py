"""`localgen models` and `localgen rm` against a Hugging Face cache made in the test (tiny
safetensors repos and GGUF repos with several quants, laid out as huggingface_hub lays them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from localgen.cli.main import app
from localgen.hub.cache import NotCachedError, cached_models, plan_removal, repo_folder
from localgen.hub.refs import ModelRef
from localgen.models.sources import EMBEDDED_NAME, embedded_gguf_path
from tests import tiny_models as tm

REV = "1" * 40
FAMILIES = Path(__file__).parent / "fixtures" / "families"


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """tiny-org/llama (safetensors), tiny-org/llama-GGUF (Q8_0 and F32), tiny-org/gpt2ish
    (safetensors of an architecture localgen does not run)."""
    root = tmp_path_factory.mktemp("models")
    cache = tmp_path_factory.mktemp("hub")
    llama = tm.make_hf_model(root, "llama2")
    tm.make_hub_cache(cache, "tiny-org/llama", llama, REV)
    ggufs = root / "ggufs"
    ggufs.mkdir()
    for q in ("Q8_0", "F32"):
        tm.write_gguf(ggufs / f"llama-{q}.gguf", llama, q, with_tokenizer=False)
    tm.make_hub_cache(cache, "tiny-org/llama-GGUF", ggufs, "2" * 40)
    gpt2 = root / "gpt2"
    from transformers import GPT2Config

    GPT2Config(n_embd=32, n_layer=1, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(gpt2)
    (gpt2 / "model.safetensors").write_bytes(b"x" * 100)
    tm.make_hub_cache(cache, "tiny-org/gpt2ish", gpt2, "3" * 40)
    return cache


def _env(cache: Path) -> dict:
    return {"HF_HUB_CACHE": str(cache), "HF_HOME": str(cache.parent / "hf"), "COLUMNS": "250",
            "LOCALGEN_DEBUG": None}


def _rows(cache: Path, *args: str) -> dict:
    res = CliRunner().invoke(app, ["models", "--json", *args], env=_env(cache))
    assert res.exit_code == 0, res.output
    return {r["name"]: r for r in json.loads(res.stdout)}


def _copy(cache: Path, tmp_path: Path) -> Path:
    import shutil

    dst = tmp_path / "hub"
    shutil.copytree(cache, dst, symlinks=True)
    return dst


def test_models_json_lists_the_embedded_model_the_cache_and_given_paths(cache, tmp_path):
    missing = tmp_path / "missing.gguf"
    rows = _rows(cache, str(missing))
    assert list(rows) == [EMBEDDED_NAME, "tiny-org/gpt2ish", "tiny-org/llama",
                          "tiny-org/llama-GGUF:F32", "tiny-org/llama-GGUF:Q8_0", "missing.gguf"]
    emb = rows[EMBEDDED_NAME]
    assert emb["kind"] == "embedded" and emb["architecture"] == "LlamaForCausalLM"
    assert emb["size_bytes"] == embedded_gguf_path().stat().st_size and emb["runnable"]
    local = _rows(cache, str(tmp_path / "missing.gguf"), str(FAMILIES / "mixtral_top1"))["mixtral_top1"]
    assert (local["kind"], local["format"], local["quant"], local["family"]) == (
        "local", "safetensors", "F16", "Mixtral")
    assert local["runnable"] and local["size_bytes"] == (FAMILIES / "mixtral_top1" / "model.safetensors").stat().st_size
    bad = rows["missing.gguf"]
    assert bad["error"] == "no such file or directory" and bad["size_bytes"] == 0
    assert not bad["runnable"]


def test_cached_models_have_format_quant_family_size_and_file(cache):
    rows = _rows(cache)
    st = rows["tiny-org/llama"]
    snap = repo_folder("tiny-org/llama", cache) / "snapshots" / REV
    assert (st["repo"], st["format"], st["quant"], st["family"]) == ("tiny-org/llama", "safetensors", "F32", "Llama")
    assert st["file"] == "model.safetensors"  # its size: weights, config and tokenizer
    assert st["size_bytes"] == sum(f.stat().st_size for f in snap.iterdir())
    assert st["runnable"] and st["error"] is None and st["path"] == str(snap)
    q8 = rows["tiny-org/llama-GGUF:Q8_0"]
    gsnap = repo_folder("tiny-org/llama-GGUF", cache) / "snapshots" / ("2" * 40)
    assert (q8["format"], q8["quant"], q8["family"], q8["file"]) == ("gguf", "Q8_0", "Llama", "llama-Q8_0.gguf")
    assert q8["size_bytes"] == (gsnap / "llama-Q8_0.gguf").stat().st_size
    assert q8["size_bytes"] < rows["tiny-org/llama-GGUF:F32"]["size_bytes"]


def test_a_cached_model_localgen_cannot_run_says_why(cache):
    row = _rows(cache)["tiny-org/gpt2ish"]
    assert not row["runnable"] and row["family"] is None
    assert "'GPT2LMHeadModel'" in row["error"] and "Llama" in row["error"]


def test_models_table_is_the_default(cache):
    res = CliRunner().invoke(app, ["models"], env=_env(cache))
    assert res.exit_code == 0 and "Local models" in res.stdout
    assert "tiny-org/llama-GGUF:Q8_0" in res.stdout and "GPT2LMHeadModel" in res.stdout
    assert not res.stdout.lstrip().startswith("[")


def test_rm_one_quant_keeps_the_others_and_says_what_it_freed(cache, tmp_path):
    hub = _copy(cache, tmp_path)
    blob = (repo_folder("tiny-org/llama-GGUF", hub) / "snapshots" / ("2" * 40) / "llama-Q8_0.gguf").resolve()
    size = blob.stat().st_size
    res = CliRunner().invoke(app, ["rm", "tiny-org/llama-GGUF:q8_0", "--yes"], env=_env(hub))
    assert res.exit_code == 0, res.output
    assert "tiny-org/llama-GGUF:Q8_0" in res.stdout and "freed" in res.stdout
    assert f"{size / 1024:.1f} KiB" in res.stdout
    assert not blob.exists()
    assert [m.name for m in cached_models(hub) if m.repo_id == "tiny-org/llama-GGUF"] == [
        "tiny-org/llama-GGUF:F32"]


def test_rm_the_last_quant_or_a_whole_repo_removes_the_repo_folder(cache, tmp_path):
    hub = _copy(cache, tmp_path)
    for argv in (["tiny-org/llama-GGUF:Q8_0"], ["tiny-org/llama-GGUF:llama-F32.gguf"], ["tiny-org/llama"]):
        assert CliRunner().invoke(app, ["rm", *argv, "-y"], env=_env(hub)).exit_code == 0
    assert not repo_folder("tiny-org/llama-GGUF", hub).exists()
    assert not repo_folder("tiny-org/llama", hub).exists()
    assert [m.repo_id for m in cached_models(hub)] == ["tiny-org/gpt2ish"]


def test_rm_asks_first_and_a_no_keeps_everything(cache, tmp_path):
    hub = _copy(cache, tmp_path)
    res = CliRunner().invoke(app, ["rm", "tiny-org/llama"], input="n\n", env=_env(hub))
    assert res.exit_code == 1 and "remove tiny-org/llama (" in res.stdout and "nothing removed" in res.stdout
    assert repo_folder("tiny-org/llama", hub).exists()
    res = CliRunner().invoke(app, ["rm", "tiny-org/llama"], input="y\n", env=_env(hub))
    assert res.exit_code == 0 and not repo_folder("tiny-org/llama", hub).exists()


def test_rm_of_what_the_cache_lacks_names_it_and_what_is_there(cache):
    with pytest.raises(NotCachedError, match=r"tiny-org/llama-GGUF:Q4_K_M .*F32, Q8_0"):
        plan_removal(ModelRef("tiny-org/llama-GGUF", "Q4_K_M"), cache)
    res = CliRunner().invoke(app, ["rm", "tiny-org/absent", "-y"], env=_env(cache))
    assert res.exit_code == 1 and res.stderr.startswith("error: tiny-org/absent is not in the Hugging Face cache")
    assert "Traceback" not in res.output


def test_a_split_gguf_is_one_row_and_rm_takes_all_its_parts(tmp_path):
    files = tmp_path / "files"
    (files / "Q8_0").mkdir(parents=True)
    for i in (1, 2):
        (files / "Q8_0" / f"m-Q8_0-0000{i}-of-00002.gguf").write_bytes(bytes([i]) * 1000)
    (files / "m-F16.gguf").write_bytes(b"f" * 3000)
    hub = tmp_path / "hub"
    snap = tm.make_hub_cache(hub, "org/split-GGUF", files, REV)
    rows = {m.name: m for m in cached_models(hub)}
    assert set(rows) == {"org/split-GGUF:Q8_0", "org/split-GGUF:F16"}
    assert rows["org/split-GGUF:Q8_0"].files == ("Q8_0/m-Q8_0-00001-of-00002.gguf",
                                                 "Q8_0/m-Q8_0-00002-of-00002.gguf")
    assert rows["org/split-GGUF:Q8_0"].size_bytes == 2000
    plan = plan_removal(ModelRef("org/split-GGUF", "Q8_0"), hub)
    assert plan.strategy.expected_freed_size == 2000
    plan.strategy.execute()
    assert not (snap / "Q8_0" / "m-Q8_0-00002-of-00002.gguf").exists() and (snap / "m-F16.gguf").exists()
    assert [m.name for m in cached_models(hub)] == ["org/split-GGUF:F16"]
