"""`localgen generate`: streaming to stdout, stats on stderr, stdin, chat template / --raw, flags."""

from __future__ import annotations

import pytest
from test_batch_fakes import FakeLLM
from typer.testing import CliRunner

from localgen.cli import generate_cmd
from localgen.cli.main import app
from localgen.runtime.request import Priority


class StreamingFake(FakeLLM):
    """Counts the steps so the test can see the text arrived in several pieces."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.deltas: list[str] = []

    def step(self):
        outs = super().step()
        self.deltas += [o.text_delta for o in outs if o.text_delta]
        return outs


@pytest.fixture
def engine(monkeypatch):
    made: list[StreamingFake] = []
    opts: dict = {}

    def load(model, **kw):
        opts.update(kw, model=model)
        llm = StreamingFake(**opts.get("fake", {}))
        made.append(llm)
        return llm

    monkeypatch.setattr(generate_cmd, "load_llm", load)
    return made, opts


def test_streams_answer_with_chat_template(engine):
    made, opts = engine
    res = CliRunner().invoke(app, ["generate", "one two three four", "--system", "be nice", "--temperature", "0", "--max-tokens", "3", "--stop", "zz", "--stop", "yy", "--model", "m", "--kv-cache-memory", "512MiB"])
    assert res.exit_code == 0, res.output
    assert res.stdout == "be nice one\n"  # the fake echoes the rendered prompt's words
    assert len(made[0].deltas) == 3  # streamed token by token
    req = next(iter(made[0].requests.values()))
    assert req.messages == [{"role": "system", "content": "be nice"}, {"role": "user", "content": "one two three four"}]
    assert req.prompt is None and req.priority == Priority.INTERACTIVE
    assert (req.sampling.temperature, req.sampling.max_tokens, req.sampling.stop) == (0.0, 3, ("zz", "yy"))
    assert opts == {"model": "m", "kv_cache_memory": 512 * 2**20, "dtype": None, "device": None}
    assert "3 tokens" in res.stderr and "tokens/s" in res.stderr and "time to first token" in res.stderr
    assert "finish length" in res.stderr


def test_raw_prompt_from_stdin(engine):
    made, _ = engine
    for argv in (["generate", "--raw"], ["generate", "-", "--raw"]):
        res = CliRunner().invoke(app, argv, input="alpha beta\n")
        assert res.exit_code == 0, res.output
        assert res.stdout == "alpha beta\n"
        req = next(iter(made[-1].requests.values()))
        assert req.prompt == "alpha beta\n" and req.messages is None
        assert "finish stop" in res.stderr


def test_defaults_are_the_chat_apps(engine):
    made, _ = engine
    assert CliRunner().invoke(app, ["generate", "x"]).exit_code == 0
    sp = next(iter(made[0].requests.values())).sampling
    assert (sp.temperature, sp.top_p) == (0.7, 0.95)


def test_sampling_flags_reach_the_request(engine):
    made, _ = engine
    res = CliRunner().invoke(app, ["generate", "x", "--top-p", "0.9", "--top-k", "5", "--min-p", "0.1", "--repetition-penalty", "1.2", "--seed", "7"])
    assert res.exit_code == 0, res.output
    sp = next(iter(made[0].requests.values())).sampling
    assert (sp.top_p, sp.top_k, sp.min_p, sp.repetition_penalty, sp.seed, sp.temperature) == (0.9, 5, 0.1, 1.2, 7, 0.7)


@pytest.mark.parametrize(
    "argv,hint",
    [
        (["generate", "x", "--top-p", "0"], "top-p"),
        (["generate", "x", "--temperature", "-1"], "temperature"),
        (["generate", "x", "--raw", "--system", "s"], "--system"),
        (["generate", "   "], "empty"),
        (["generate", "x", "--kv-cache-memory", "big"], "512MiB"),
    ],
)
def test_bad_flags_exit_2_without_loading(engine, argv, hint):
    res = CliRunner().invoke(app, argv)
    assert res.exit_code == 2 and hint in res.output
    assert not engine[0]


def test_prompt_too_long_exits_1(engine):
    _, opts = engine
    opts["fake"] = {"max_model_len": 4}
    res = CliRunner().invoke(app, ["generate", "a b c d e f", "--raw"])
    assert res.exit_code == 1 and "too long" in res.stderr and res.stdout == ""


def test_interrupt_exits_130(engine):
    made, opts = engine
    opts["fake"] = {"interrupt_after": 0}
    res = CliRunner().invoke(app, ["generate", "a b"])
    assert res.exit_code == 130 and "interrupted" in res.stderr
    assert made[0].aborted


def test_chat_prompt_from_stdin_drops_the_trailing_newline(engine):
    made, _ = engine
    res = CliRunner().invoke(app, ["generate"], input="alpha beta\n")
    assert res.exit_code == 0, res.output
    req = next(iter(made[-1].requests.values()))
    assert req.messages[-1]["content"] == "alpha beta"


def test_generate_and_chat_load_without_the_cpu_int4_path(monkeypatch):
    """Both interactive commands ask ``LLM.load`` for the float32 block path (``cpu_int4=False``):
    one prompt, or a conversation's new tokens, does not repay the int4 path's bf16 copies."""
    import localgen.service
    from localgen.api import LLM
    from localgen.cli import chat_cmd

    calls = []
    monkeypatch.setattr(LLM, "load", classmethod(lambda cls, *a, **kw: calls.append(kw)))
    generate_cmd.load_llm(None)
    monkeypatch.setattr(localgen.service, "EngineService", lambda load, **kw: load)
    chat_cmd.make_service(None)()
    assert [kw.get("cpu_int4") for kw in calls] == [False, False]
