"""The error table of the `localgen` command: each error a user can cause prints one or two lines
on stderr (``error: …`` then ``fix: …``) and exits 1 (2 for a mistyped flag value or command),
with no traceback unless --debug or LOCALGEN_DEBUG=1."""

from __future__ import annotations

import errno
import json

import gguf
import pytest
from typer.testing import CliRunner

from localgen.cli import errors, generate_cmd
from localgen.cli.main import app
from localgen.models.config import supported_list
from localgen.runtime.request import KVBudgetError, PromptTooLongError


def _run(argv, **env):
    return CliRunner().invoke(app, argv, env={"LOCALGEN_DEBUG": None, **env})


def _check(res, code: int, *needles: str):
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == code, res.output
    assert 1 <= len(lines) <= 2, res.stderr
    assert lines[0].startswith("error: ") and all(ln.startswith(("error: ", "fix: ")) for ln in lines)
    assert "Traceback" not in res.output and res.stdout == ""
    for n in needles:
        assert n in res.stderr, (n, res.stderr)


@pytest.fixture
def no_torch_import(monkeypatch):
    """Errors found before the model loads: the fake loader must never be reached."""
    def load(*a, **kw):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(generate_cmd, "load_llm", load)


@pytest.fixture
def unsupported_gguf(tmp_path):
    path = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# -- the model the user names: real resolution, no fake ------------------------------------------

def test_a_missing_gguf_path(tmp_path):
    _check(_run(["generate", "hi", "--model", str(tmp_path / "none.gguf")]), 1, "none.gguf", "not found")


def test_a_file_that_is_not_a_model(tmp_path):
    bad = tmp_path / "notes.gguf"
    bad.write_text("just some notes\n")
    _check(_run(["generate", "hi", "--model", str(bad)]), 1, "notes.gguf", "not a GGUF file")


def test_a_folder_without_a_model(tmp_path):
    _check(_run(["generate", "hi", "--model", str(tmp_path)]), 1, str(tmp_path), "config.json")


def test_an_unsupported_architecture(unsupported_gguf):
    _check(_run(["generate", "hi", "--model", str(unsupported_gguf)]), 1, "mamba.gguf", "'mamba'",
           supported_list(), "(GGUF archs ", " llama, ")


@pytest.mark.parametrize("config", [{"architectures": ["MambaForCausalLM"], "model_type": "mamba"},
                                    {"model_type": "mamba"}])
def test_an_unsupported_hf_architecture_names_it_and_the_families(tmp_path, config):
    (tmp_path / "config.json").write_text(json.dumps(config))
    res = _run(["generate", "hi", "--model", str(tmp_path)])
    named = "'MambaForCausalLM'" if "architectures" in config else "model_type 'mamba'"
    _check(res, 1, str(tmp_path / "config.json"), named, supported_list())
    assert len(res.stderr.strip().splitlines()) == 1


def test_the_supported_families_are_listed_by_their_names():
    names = supported_list().split(", ")
    assert {"Llama", "Mistral", "Qwen2", "OPT"} <= set(names) and "ForCausalLM" not in supported_list()


@pytest.mark.parametrize("name", ["llama3", "qwen2.5:7b", "mistral:latest"])
def test_an_ollama_name_says_how_to_get_such_a_model(name):
    res = _run(["generate", "hi", "--model", name])
    _check(res, 1, f"'{name}'", "Ollama", ".gguf", "localgen pull")
    assert res.stderr.splitlines()[1].startswith("fix: ")


def test_a_hub_model_not_in_the_cache_while_offline(tmp_path):
    res = _run(["generate", "hi", "--model", "nobody-here/no-such-model"],
               HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"), HF_HUB_CACHE=str(tmp_path / "hf" / "hub"))
    _check(res, 1, "nobody-here/no-such-model")


# -- flags --------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, needle", [
    (["generate", "hi", "--temperature", "warm"], "'--temperature'"),
    (["generate", "hi", "--kv-cache-memory", "lots"], "--kv-cache-memory"),
    (["generate", "hi", "--top-p", "7"], "--top-p"),
    (["generate", "hi", "--no-such-flag"], "--no-such-flag"),
    (["genrate", "hi"], "genrate"),
])
def test_a_bad_flag_or_command(argv, needle, no_torch_import):
    res = _run(argv)
    _check(res, 2, needle, "--help")


def test_a_missing_batch_input(tmp_path):
    res = _run(["batch", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl")])
    _check(res, 2, "in.jsonl")


# -- errors while loading or running (the loader raises them) -----------------------------------

def _oom():
    import torch

    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


@pytest.mark.parametrize("make, needles", [
    (lambda: KVBudgetError("the KV cache budget (0.70 MiB: 1 block of 16 tokens) holds 16 tokens; "
                           "this prompt needs 43 (2.11 MiB): raise the KV cache budget "
                           "(--kv-cache-memory, kv_cache_memory=) to at least 2.11 MiB", 1, 2),
     ["--kv-cache-memory", "2.11 MiB"]),
    (lambda: PromptTooLongError("prompt of 9000 tokens does not fit the context of 8192 tokens"),
     ["9000 tokens", "8192"]),
    (_oom, ["out of memory", "--kv-cache-memory"]),
    (lambda: MemoryError(), ["out of memory", "smaller model"]),
    (lambda: PermissionError(errno.EACCES, "Permission denied", "/models/x.gguf"),
     ["permission denied", "/models/x.gguf"]),
    (lambda: OSError(errno.ENOSPC, "No space left on device", "/tmp/off"), ["no space", "/tmp/off"]),
    (lambda: ValueError("dtype 'fp8' is not one of float32, fp32"), ["dtype 'fp8'"]),
    (lambda: RuntimeError("index 7 out of range"), ["RuntimeError: index 7", "--debug"]),
])
def test_errors_raised_while_loading(monkeypatch, make, needles):
    def load(*a, **kw):
        raise make()

    monkeypatch.setattr(generate_cmd, "load_llm", load)
    _check(_run(["generate", "hi"]), 1, *needles)


def test_the_hub_unreachable(monkeypatch):
    import requests

    def load(*a, **kw):
        raise requests.ConnectionError("HTTPSConnectionPool(host='huggingface.co'): Max retries")

    monkeypatch.setattr(generate_cmd, "load_llm", load)
    _check(_run(["generate", "hi", "--model", "org/model"]), 1, "could not be reached",
           "HF_HUB_OFFLINE=1")


# -- the traceback on request --------------------------------------------------------------------

@pytest.mark.parametrize("argv, env", [
    (["--debug", "generate", "hi", "--model", "llama3"], {}),
    (["generate", "hi", "--model", "llama3"], {"LOCALGEN_DEBUG": "1"}),
])
def test_debug_lets_the_exception_through(argv, env):
    res = _run(argv, **env)
    assert res.exit_code == 1 and type(res.exception).__name__ == "ModelNotFoundError"


def test_describe_keeps_to_one_line_of_the_message():
    lines = errors.describe(ValueError("first line\nsecond line\nthird"))
    assert lines == ["error: first line"]


@pytest.mark.parametrize("name, tag", [("llama3", True), ("qwen2.5:7b", True), ("org/name", False),
                                       ("model.gguf", False), ("Org/Name:Q4_K_M", False)])
def test_ollama_names(name, tag):
    assert errors.looks_like_ollama_tag(name) is tag


# -- shell completion ----------------------------------------------------------------------------

def test_shell_completion_is_offered(monkeypatch):
    res = _run(["--help"])
    assert "--install-completion" in res.stdout and "--show-completion" in res.stdout
    # typer otherwise detects the shell from the parent processes, which a test runner may not
    # have; with detection off, --show-completion takes the shell's name
    monkeypatch.setenv("_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION", "1")
    res = _run(["--show-completion", "bash"])
    assert res.exit_code == 0 and "localgen" in res.stdout and "complete" in res.stdout, res.output


def test_chat_reports_a_missing_model_before_the_app_opens(monkeypatch):
    from localgen.cli import chat_cmd

    def service(*a, **kw):
        raise AssertionError("the app was started")

    monkeypatch.setattr(chat_cmd, "make_service", service)
    _check(_run(["chat", "--model", "llama3"]), 1, "Ollama")
