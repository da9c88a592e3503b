"""`localgen pull` and `--model REPO[:QUANT]` against a hub on 127.0.0.1 (tests/fake_hub.py).

huggingface_hub's real code paths (model_info, snapshot_download, its cache layout) talk to the
fake hub through HF_ENDPOINT; the models it serves are tiny ones made here: GGUFs written with
gguf's writer (one split into parts) and a safetensors directory from transformers.
"""

from __future__ import annotations

import hashlib
import socket
import sys
from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("huggingface_hub")

sys.path.insert(0, str(Path(__file__).parent))
import tiny_models as tm  # noqa: E402
from fake_hub import TOKEN, FakeHub  # noqa: E402
from test_gguf_packed import Q4_K_M, write_random_gguf  # noqa: E402

from localgen.hub.cache import find_cached, repo_folder  # noqa: E402
from localgen.hub.pull import PullError, pull  # noqa: E402
from localgen.hub.refs import ModelRef, parse_ref  # noqa: E402
from localgen.models.sources import ModelNotFoundError, resolve_model  # noqa: E402

GGUF_REPO, SPLIT_REPO, HF_REPO = "tiny-org/tiny-GGUF", "tiny-org/split-GGUF", "tiny-org/tiny"
README = b"# tiny\n"


class _SplitWriter(gguf.GGUFWriter):
    """gguf's writer cutting the file into parts of 8 tensors (NAME-0000k-of-0000n.gguf)."""

    def __init__(self, path, arch, **kw):
        super().__init__(path, arch, split_max_tensors=8)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("pull_models")
    hf = tm.make_hf_model(d, "smollm")
    out = {"hf": hf}
    for q in ("Q8_0", "F16"):
        out[q] = tm.write_gguf(d / f"tiny-{q}.gguf", hf, q)
    out["Q4_K_M"] = write_random_gguf(d / "tiny-Q4_K_M.gguf", Q4_K_M)
    (d / "split").mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFWriter", _SplitWriter)
        tm.write_gguf(d / "split" / "tiny-Q8_0.gguf", hf, "Q8_0")
    out["parts"] = sorted((d / "split").glob("*.gguf"))
    return out


@pytest.fixture
def hub(models, tmp_path, monkeypatch) -> FakeHub:
    """A fresh fake hub serving the three repos, and an empty hub cache under tmp_path."""
    h = FakeHub()
    h.add(GGUF_REPO, {"README.md": README, "tiny-Q8_0.gguf": models["Q8_0"],
                      "tiny-F16.gguf": models["F16"], "tiny-Q4_K_M.gguf": models["Q4_K_M"],
                      "mmproj-tiny-F16.gguf": b"not a model"})
    n = len(models["parts"])
    h.add(SPLIT_REPO, {f"Q8_0/{p.name}": p for p in models["parts"]}
          | {"tiny-F16.gguf": models["F16"]}, commit="d" * 40)
    assert n >= 3 and models["parts"][0].name == f"tiny-Q8_0-00001-of-{n:05d}.gguf"
    hf = models["hf"]
    h.add(HF_REPO, {p.name: p for p in hf.iterdir() if p.is_file()}
          | {"README.md": README, "pytorch_model.bin": b"\0" * 64,
             "consolidated.safetensors": b"\0" * 64, "original/params.json": b"{}",
             "tiny-Q8_0.gguf": models["Q8_0"]}, commit="e" * 40)
    h.start()
    monkeypatch.setenv("HF_ENDPOINT", h.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    for var in ("HF_HUB_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_TOKEN_PATH", str(tmp_path / "no-token"))  # a login on this machine must not count
    yield h
    h.stop()


def _pull(text: str, **kw):
    return pull(parse_ref(text), log=lambda line: None, **kw)


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


# ---- pulling GGUF repos ----------------------------------------------------------------------


def test_pull_gguf_by_quant_tag_into_the_hf_cache(hub, models, tmp_path):
    got = _pull(GGUF_REPO + ":q8_0")  # the tag is case-insensitive
    assert got.format == "gguf" and got.files == ("tiny-Q8_0.gguf",)
    assert hub.gets(GGUF_REPO) == ["tiny-Q8_0.gguf"]  # no other quant, no README
    assert [m for m, p, _ in hub.requests if p.startswith("/cdn/")] == ["GET"]  # the hub's redirect
    repo = tmp_path / "hub" / "models--tiny-org--tiny-GGUF"
    assert got.path == repo / "snapshots" / ("c" * 40) / "tiny-Q8_0.gguf"
    assert got.path.is_symlink() and got.path.resolve().parent == repo / "blobs"
    assert _sha(got.path) == _sha(models["Q8_0"])
    assert (repo / "refs" / "main").read_text() == "c" * 40
    before = len(hub.requests)
    assert find_cached(ModelRef(GGUF_REPO, "Q8_0")).path == got.path  # offline lookup, no request
    assert len(hub.requests) == before


def test_default_quant_is_q4_k_m(hub, models):
    got = _pull(GGUF_REPO)
    assert got.files == ("tiny-Q4_K_M.gguf",) and hub.gets(GGUF_REPO) == ["tiny-Q4_K_M.gguf"]
    assert _sha(got.path) == _sha(models["Q4_K_M"])


def test_split_gguf_downloads_every_part_and_loads_as_one_file(hub, models):
    got = _pull(SPLIT_REPO + ":Q8_0")
    names = [f"Q8_0/{p.name}" for p in models["parts"]]
    assert got.files == tuple(names) and sorted(hub.gets(SPLIT_REPO)) == names
    assert got.path.name == models["parts"][0].name
    src = resolve_model(SPLIT_REPO + ":Q8_0")  # from the cache: no new download
    whole = resolve_model(str(models["Q8_0"]))
    assert sorted(hub.gets(SPLIT_REPO)) == names
    assert src.config == whole.config and src.weights.names() == whole.weights.names()
    for name in whole.weights.names():
        assert (src.weights.get(name) == whole.weights.get(name)).all(), name
    text = "the quick brown fox"
    assert src.tokenizer.encode(text) == whole.tokenizer.encode(text)  # read from part 1


def test_safetensors_repo_downloads_config_tokenizer_and_weights_only(hub, models):
    got = _pull(HF_REPO)
    assert got.format == "hf" and got.path.name == "e" * 40
    want = sorted(p.name for p in models["hf"].iterdir() if p.is_file())
    assert sorted(hub.gets(HF_REPO)) == want == sorted(got.files)
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(want)
    src = resolve_model(HF_REPO)
    assert src.kind == "hub" and src.path == got.path and src.config.num_kv_heads == 2


# ---- faults ------------------------------------------------------------------------------------


def test_a_dropped_connection_resumes_with_a_range_request(hub, models, monkeypatch):
    from huggingface_hub import constants

    # huggingface_hub keeps what whole chunks brought; chunks smaller than this tiny file let
    # the resume start past byte 0, as it does for a real model's 10 MiB chunks
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 16 << 10)
    hub.drop_once.add((GGUF_REPO, "tiny-Q8_0.gguf"))
    got = _pull(GGUF_REPO + ":Q8_0")
    ranges = hub.ranges(GGUF_REPO, "tiny-Q8_0.gguf")
    size = models["Q8_0"].stat().st_size
    assert ranges[0] is None and len(ranges) == 2
    start = int(ranges[1].removeprefix("bytes=").split("-")[0])
    assert 0 < start < size  # the second request asked only for the rest
    assert _sha(got.path) == _sha(models["Q8_0"])


def test_a_killed_pull_resumes_in_the_next_run(hub, models, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 16 << 10)
    key = (GGUF_REPO, "tiny-Q8_0.gguf")
    hub.drop_once.add(key)
    hub.fail_resume.add(key)  # the first run cannot continue after the drop and gives up
    with pytest.raises(PullError, match="run the pull again to resume it"):
        _pull(GGUF_REPO + ":Q8_0")
    partial = repo_folder(GGUF_REPO) / "blobs" / (_sha(models["Q8_0"]) + ".partial")
    kept = partial.stat().st_size
    assert 0 < kept < models["Q8_0"].stat().st_size
    assert find_cached(ModelRef(GGUF_REPO, "Q8_0")) is None  # a partial file is never loaded
    hub.fail_resume.clear()
    got = _pull(GGUF_REPO + ":Q8_0")
    ranges = hub.ranges(GGUF_REPO, "tiny-Q8_0.gguf")
    assert ranges[-1] == f"bytes={kept}-"  # the second run asked only for what was missing
    assert _sha(got.path) == _sha(models["Q8_0"]) and not partial.exists()


@pytest.mark.parametrize("fault", ["corrupt", "short"])
def test_a_damaged_download_is_an_error_and_leaves_nothing_to_load(hub, models, fault):
    getattr(hub, fault).add((GGUF_REPO, "tiny-Q8_0.gguf"))
    msg = "arrived damaged .* and was deleted" if fault == "corrupt" else "should be of size"
    with pytest.raises(PullError, match=msg):
        _pull(GGUF_REPO + ":Q8_0")
    repo, sha = repo_folder(GGUF_REPO), _sha(models["Q8_0"])
    assert not list(repo.rglob("tiny-Q8_0.gguf")) and not (repo / "blobs" / sha).exists()
    assert (repo / "blobs" / f"{sha}.partial").exists() == (fault == "short")  # a prefix: kept
    assert find_cached(ModelRef(GGUF_REPO, "Q8_0")) is None
    getattr(hub, fault).clear()  # the hub serves it right now: the next pull gets it whole
    got = _pull(GGUF_REPO + ":Q8_0")
    assert _sha(got.path) == _sha(models["Q8_0"]) and hub.gets(GGUF_REPO).count("tiny-Q8_0.gguf") == 2


def test_a_damaged_small_file_is_removed_too(hub, models):
    hub.corrupt.add((HF_REPO, "config.json"))
    with pytest.raises(PullError, match=r"tiny-org/tiny/config.json arrived damaged .*removed"):
        _pull(HF_REPO)
    assert find_cached(ModelRef(HF_REPO)) is None


def test_a_download_the_disk_cannot_hold_is_refused_before_it_starts(hub, monkeypatch):
    import shutil

    usage = shutil.disk_usage("/")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=1000))
    with pytest.raises(PullError, match=r"tiny-Q8_0.gguf needs \d+ more bytes in .*, where 1000 are free"):
        _pull(GGUF_REPO + ":Q8_0")
    assert hub.gets(GGUF_REPO) == []


def test_missing_repo_says_not_found(hub):
    with pytest.raises(PullError, match=r"^tiny-org/absent was not found on http://127\.0\.0\.1:\d+$"):
        _pull("tiny-org/absent:Q8_0")


def test_missing_quant_lists_the_quants_the_repo_has(hub):
    with pytest.raises(PullError, match=r"has no Q2_K GGUF; its quants: F16, Q4_K_M, Q8_0$"):
        _pull(GGUF_REPO + ":Q2_K")
    assert hub.gets(GGUF_REPO) == []


def test_gated_and_private_repos_say_how_to_pass_a_token(hub, monkeypatch):
    hub.repos[GGUF_REPO].gated = True
    with pytest.raises(PullError, match=r"is gated: accept its terms at .*, then set HF_TOKEN"):
        _pull(GGUF_REPO + ":Q8_0")
    hub.repos[HF_REPO].private = True
    with pytest.raises(PullError, match=r"was not found .*\(or it is private: set HF_TOKEN"):
        _pull(HF_REPO)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert _pull(GGUF_REPO + ":Q8_0").path.is_file() and _pull(HF_REPO).format == "hf"


def test_offline_mode_and_no_network_each_fail_in_one_line(hub, monkeypatch):
    _pull(GGUF_REPO + ":Q8_0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    before = len(hub.requests)
    with pytest.raises(PullError, match="HF_HUB_OFFLINE is set"):
        _pull(GGUF_REPO + ":F16")
    assert _pull(GGUF_REPO + ":Q8_0").files == ("tiny-Q8_0.gguf",)  # cached: nothing to fetch
    with pytest.raises(ModelNotFoundError, match=r"not in the local hub cache .* HF_HUB_OFFLINE is set"):
        resolve_model(GGUF_REPO + ":F16")
    assert resolve_model(GGUF_REPO + ":Q8_0").name == GGUF_REPO + ":Q8_0"  # cached: fine offline
    assert len(hub.requests) == before  # offline never touched the network
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setenv("HF_ENDPOINT", closed)
    with pytest.raises(PullError) as e:
        _pull(GGUF_REPO + ":F16")
    assert str(e.value).startswith(f"cannot reach the Hugging Face hub at {closed} ")
    assert "\n" not in str(e.value)


# ---- --model REPO[:QUANT] --------------------------------------------------------------------


def test_model_option_pulls_once_then_loads_from_the_cache(hub, models, capfd):
    from localgen.api import LLM, Request, SamplingParams

    def greedy(model):
        llm = LLM.load(model, device="cpu", dtype="float32", kv_cache_memory=1 << 22)
        sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        return llm.generate([Request(prompt_token_ids=[5, 9, 30, 41], sampling=sp)])[0].token_ids

    tokens = greedy(GGUF_REPO + ":Q8_0")
    assert f"{GGUF_REPO}:Q8_0 is not in the Hugging Face cache; downloading it" in capfd.readouterr().err
    assert tokens == greedy(str(models["Q8_0"])) and len(set(tokens)) > 2
    assert greedy(GGUF_REPO + ":Q8_0") == tokens
    assert "downloading" not in capfd.readouterr().err and hub.gets(GGUF_REPO) == ["tiny-Q8_0.gguf"]


def test_generate_command_takes_a_hub_reference(hub):
    from typer.testing import CliRunner

    from localgen.cli.main import app

    r = CliRunner().invoke(app, ["generate", "the quick", "--model", HF_REPO, "--temperature", "0",
                                 "--max-tokens", "4", "--dtype", "float32", "--device", "cpu"])
    assert r.exit_code == 0, r.output
    assert f"{HF_REPO} is not in the Hugging Face cache; downloading it" in r.stderr
    assert "model.safetensors" in hub.gets(HF_REPO) and r.stdout.strip()


def test_pull_command(hub):
    from typer.testing import CliRunner

    from localgen.cli.main import app

    r = CliRunner().invoke(app, ["pull", GGUF_REPO + ":F16"])
    assert r.exit_code == 0, r.output
    assert "tiny-F16.gguf" in r.stdout and f"localgen chat --model {GGUF_REPO}:F16" in r.stdout
    hub.add("tiny-org/gpt2ish", {"config.json": b'{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}',
                                 "model.safetensors": b"\0" * 16})
    r = CliRunner().invoke(app, ["pull", "tiny-org/gpt2ish"])
    assert r.exit_code == 0 and "note: localgen cannot run it: " in r.stderr and "GPT2" in r.stderr
    r = CliRunner().invoke(app, ["pull", GGUF_REPO + ":IQ1_S"])
    assert r.exit_code == 1 and "error: tiny-org/tiny-GGUF has no IQ1_S GGUF; its quants:" in r.stderr


def test_a_local_path_wins_over_a_hub_reference(hub, models, tmp_path, monkeypatch):
    local = tmp_path / "tiny-org" / "tiny"
    local.mkdir(parents=True)
    (local / "m.gguf").write_bytes(models["F16"].read_bytes())
    monkeypatch.chdir(tmp_path)
    src = resolve_model("tiny-org/tiny")
    assert src.kind == "gguf" and src.path == Path("tiny-org/tiny/m.gguf") and hub.requests == []


def test_a_cached_quant_serves_a_tagless_reference(hub):
    _pull(GGUF_REPO + ":F16")
    got = find_cached(ModelRef(GGUF_REPO))
    assert got is not None and got.files == ("tiny-F16.gguf",)


def test_pulled_models_are_listed_by_the_name_model_takes(hub, models):
    from localgen.models.sources import list_local_models

    _pull(GGUF_REPO + ":Q8_0")
    _pull(SPLIT_REPO + ":Q8_0")
    _pull(HF_REPO)
    rows = {i.name: i for i in list_local_models() if i.name.startswith("tiny-org/")}
    assert set(rows) == {GGUF_REPO + ":Q8_0", SPLIT_REPO + ":Q8_0", HF_REPO}
    assert rows[SPLIT_REPO + ":Q8_0"].size_bytes == sum(p.stat().st_size for p in models["parts"])
    assert rows[GGUF_REPO + ":Q8_0"].architecture == "LlamaForCausalLM"
    before = len(hub.requests)
    for name in rows:  # each name loads from the cache as it is
        assert resolve_model(name, offline=True).config.num_layers == 2
    assert len(hub.requests) == before


def test_chat_downloads_before_the_full_screen_app_starts(hub, monkeypatch):
    from typer.testing import CliRunner

    from localgen.cli import chat_cmd
    from localgen.cli.main import app

    seen = []

    def make_service(model, **kw):  # the app must find the model in the cache already
        seen.append(find_cached(parse_ref(model)))
        raise SystemExit(0)

    monkeypatch.setattr(chat_cmd, "make_service", make_service)
    r = CliRunner().invoke(app, ["chat", "--model", GGUF_REPO + ":Q8_0"])
    assert "downloading it" in r.stderr and seen and seen[0].files == ("tiny-Q8_0.gguf",)
    r = CliRunner().invoke(app, ["chat", "--model", GGUF_REPO + ":Q3_K"])
    assert r.exit_code == 1 and "error: tiny-org/tiny-GGUF has no Q3_K GGUF" in r.stderr
