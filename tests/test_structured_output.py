"""Structured output (response_format) with the embedded SmolLM2-135M: answers that parse and
validate against their JSON Schema (jsonschema) greedy and sampled, json_object mode, a free
request sharing the batch unchanged, preemption under a tiny KV budget, the batch and generate
command paths, and bad formats refused with errors naming the bad part."""

from __future__ import annotations

import json

import jsonschema
import pytest
from typer.testing import CliRunner

from localgen.api import LLM, Request, SamplingParams
from localgen.cli import batch_cmd, generate_cmd
from localgen.cli.main import app
from localgen.runtime.engine import Engine, EngineConfig

MAX_TOKENS = 64

PERSON = {  # nested object, required fields, integer range, a pattern, an array of enums
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 12},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]},
                 "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "address", "pets"],
}
WEATHER = {  # numbers, a boolean, an enum
    "type": "object",
    "properties": {
        "celsius": {"type": "number", "minimum": -50, "maximum": 60},
        "raining": {"type": "boolean"},
        "sky": {"enum": ["clear", "cloudy", "stormy"]},
    },
    "required": ["celsius", "raining", "sky"],
}
TASKS = {  # an array at the root, of objects
    "type": "array",
    "items": {"type": "object",
              "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99},
                             "done": {"type": "boolean"}},
              "required": ["id", "done"]},
    "minItems": 2, "maxItems": 2,
}
SCHEMAS = {"person": (PERSON, "Describe a person who has pets, as JSON."),
           "weather": (WEATHER, "What is the weather today? Answer in JSON."),
           "tasks": (TASKS, "List two tasks as JSON.")}
FREE_PROMPT = "Name three colors."
OBJECT_PROMPT = 'Output {"ok": true} as JSON.'  # a short object: json_object mode sets no end


def _rf(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name][0]}}


def _req(prompt: str, request_id: str, **sampling) -> Request:
    sampling.setdefault("max_tokens", MAX_TOKENS)
    return Request(messages=[{"role": "user", "content": prompt}],
                   sampling=SamplingParams(**sampling), request_id=request_id)


def _constrained(prefix: str, **sampling) -> list[Request]:
    return [_req(prompt, f"{prefix}-{name}", response_format=_rf(name), **sampling)
            for name, (_, prompt) in SCHEMAS.items()]


@pytest.fixture(scope="module")
def llm():
    # float32 weights expanded at load (as test_embedded_model's oracle and the soak): the
    # token-equality checks below compare one request's greedy tokens across batch
    # compositions, and the packed GGUF CPU kernel's rows are not bit-equal across them
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOCALGEN_GGUF_PACKED", "0")
        return LLM.load(device="cpu", dtype="float32", kv_cache_memory=32 << 20)


@pytest.fixture(scope="module")
def mixed(llm):
    """One batch: each schema greedy and seeded-sampled, a json_object request and a free
    greedy request, all sharing the engine's steps. Outputs by request id."""
    reqs = (_constrained("greedy", temperature=0.0)
            + _constrained("seeded", temperature=0.9, top_p=0.95, seed=1234)
            + [_req(OBJECT_PROMPT, "object", temperature=0.0,
                    response_format={"type": "json_object"}),
               _req(FREE_PROMPT, "free", temperature=0.0, max_tokens=16)])
    return {o.request_id: o for o in llm.generate(reqs)}


@pytest.mark.parametrize("mode", ["greedy", "seeded"])
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_answers_parse_and_validate_against_their_schema(mixed, mode, name):
    out = mixed[f"{mode}-{name}"]
    assert out.finish_reason == "stop", out.text  # the grammar completed, not max_tokens
    jsonschema.validate(json.loads(out.text), SCHEMAS[name][0])


def test_json_object_mode_answers_a_json_object(mixed):
    out = mixed["object"]
    assert out.finish_reason == "stop", out.text
    assert isinstance(json.loads(out.text), dict)


def test_free_request_in_the_batch_gets_the_tokens_it_gets_alone(llm, mixed):
    alone = llm.generate([_req(FREE_PROMPT, "free-alone", temperature=0.0, max_tokens=16)])[0]
    assert mixed["free"].token_ids == alone.token_ids
    # the constrained neighbours really were constrained: the free answer is not JSON
    with pytest.raises(ValueError):
        json.loads(mixed["free"].text)


def test_preemption_under_a_tiny_kv_budget_keeps_the_grammar_state(llm, mixed):
    base = llm.engine
    per_block = base.kv_cache.bytes_per_block
    longest = max(len(base.tokenize(r)) for r in _constrained("x")) + MAX_TOKENS
    blocks = -(-longest // base.config.block_size) + 1  # room for one request, not three
    engine = Engine(base.model, base.tokenizer,
                    EngineConfig(kv_cache_memory=blocks * per_block, cuda_graphs=False),
                    tuple(base.eos_token_ids))
    small = LLM(engine, "embedded-small-kv")
    outs = {o.request_id: o for o in small.generate(_constrained("greedy", temperature=0.0))}
    assert engine.metrics.num_preemptions > 0
    for name in SCHEMAS:
        out = outs[f"greedy-{name}"]
        jsonschema.validate(json.loads(out.text), SCHEMAS[name][0])
        # recomputed after preemption, the matcher went on where it was: the same answer
        assert out.token_ids == mixed[f"greedy-{name}"].token_ids


def test_batch_command_openai_lines_with_response_format(llm, tmp_path, monkeypatch):
    monkeypatch.setattr(batch_cmd, "load_llm", lambda *a, **k: llm)
    prompt = SCHEMAS["weather"][1]
    body = {"model": "x", "messages": [{"role": "user", "content": prompt}], "temperature": 0,
            "max_tokens": MAX_TOKENS, "response_format": _rf("weather")}
    bad = dict(body, response_format={"type": "json_schema",
                                      "json_schema": {"name": "w", "schema": {"type": "strng"}}})
    lines = [{"custom_id": "ok", "method": "POST", "url": "/v1/chat/completions", "body": body},
             {"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions", "body": bad}]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    res = CliRunner().invoke(app, ["batch", str(inp), "-o", str(out), "--no-progress"])
    assert res.exit_code == 1, res.output  # line 2 is bad
    recs = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    answer = recs["ok"]["response"]["body"]["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(answer), WEATHER)
    msg = recs["bad"]["error"]["message"]
    assert msg.startswith("line 2: body.response_format.json_schema.schema") and "strng" in msg


def test_generate_command_with_a_json_schema_file(llm, tmp_path, monkeypatch):
    monkeypatch.setattr(generate_cmd, "load_llm", lambda *a, **k: llm)
    schema = tmp_path / "tasks.json"
    schema.write_text(json.dumps(TASKS))
    res = CliRunner().invoke(app, ["generate", "--json-schema", str(schema), "-t", "0",
                                   "-n", str(MAX_TOKENS), SCHEMAS["tasks"][1]])
    assert res.exit_code == 0, res.output
    jsonschema.validate(json.loads(res.stdout.strip()), TASKS)


def test_generate_command_json_mode(llm, monkeypatch):
    monkeypatch.setattr(generate_cmd, "load_llm", lambda *a, **k: llm)
    res = CliRunner().invoke(app, ["generate", "--json", "-t", "0", "-n", str(MAX_TOKENS),
                                   OBJECT_PROMPT])
    assert res.exit_code == 0, res.output
    assert isinstance(json.loads(res.stdout.strip()), dict)


@pytest.mark.parametrize("text,why", [
    ('{"type": "object",', "not valid JSON (line 1, column 19)"),
    ('{"type": "strng"}', 'Unsupported type "strng"'),
    ("[1, 2]", "must be a JSON Schema object, got list"),
])
def test_generate_refuses_a_bad_schema_file_in_one_line_naming_it(tmp_path, monkeypatch, text, why):
    def no_load(*a, **k):
        raise AssertionError("the model must not load for a bad schema file")

    monkeypatch.setattr(generate_cmd, "load_llm", no_load)
    path = tmp_path / "s.json"
    path.write_text(text)
    res = CliRunner().invoke(app, ["generate", "--json-schema", str(path), "hi"])
    assert res.exit_code == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --json-schema {path}: ") and why in lines[0]


@pytest.mark.parametrize("rf,part", [
    ("json", "response_format: must be an object"),
    ({"type": "xml"}, "response_format.type: must be"),
    ({"type": "json_schema"}, "response_format.json_schema: must be an object"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "strict": "yes"}},
     "response_format.json_schema.strict"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": [1]}},
     "response_format.json_schema.schema: must be a JSON Schema object"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "strng"}}},
     'response_format.json_schema.schema: cannot be compiled: Unsupported type "strng"'),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {"$ref": "#/$defs/x"}}},
     "response_format.json_schema.schema: cannot be compiled"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "string", "pattern": "("}}},
     "response_format.json_schema.schema: cannot be compiled"),
])
def test_bad_response_formats_name_the_bad_part(rf, part):
    with pytest.raises(ValueError) as e:
        SamplingParams(response_format=rf).validate()
    assert str(e.value).startswith(part)


def test_text_format_and_valid_formats_pass():
    for rf in ({"type": "text"}, {"type": "json_object"}, _rf("person"), _rf("tasks")):
        assert SamplingParams(response_format=rf).validate().response_format == rf


class _FixedMask:
    """Stands in for a SequenceGrammar whose matcher allows what ``bitmask`` allows."""

    def __init__(self, bitmask):
        self.bitmask = bitmask

    def next_token_bitmask(self):
        return self.bitmask


def test_mask_logits_matches_xgrammar_own_bitmask_kernel(seed):
    import torch
    import xgrammar as xgr

    from localgen.runtime.structured import mask_logits

    vocab = 1000  # not a multiple of 32: the last word's high bits are past the vocabulary
    logits = torch.randn(3, vocab)
    before = logits.clone()
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, -(-vocab // 32)), dtype=torch.int32)
    out = mask_logits(logits, [_FixedMask(bitmask[0]), None, _FixedMask(bitmask[2])])
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, bitmask, indices=[0, 2])
    assert torch.equal(out, want)
    assert torch.equal(out[1], before[1]) and torch.equal(logits, before)  # free row, input kept
    assert mask_logits(logits, [None, None, None]) is logits


def test_bench_structured_counts_both_runs(llm):
    from localgen.bench import structured_bench

    res = structured_bench.run(llm, 2, 6, log=lambda m: None)
    for run in (res.free, res.constrained):
        assert run.requests == 2 and 2 <= run.output_tokens <= 12 and run.seconds > 0
    assert 0 <= res.valid_json <= 2
    assert f"{res.ratio:8.2f}x" in structured_bench.report(res)


def test_eos_is_allowed_only_once_the_grammar_is_complete(llm):
    from localgen.runtime.structured import unpack_bitmask

    engine = llm.engine
    (eos,) = sorted(engine.eos_token_ids)
    rf = {"type": "json_schema", "json_schema": {"name": "ok", "schema": {
        "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}}
    grammar = engine.grammars.sequence_grammar(rf)
    tokens = llm.tokenizer('{"ok": true}', add_special_tokens=False)["input_ids"]
    vocab = engine.model.cfg.vocab_size
    for i, tok in enumerate(tokens):
        allowed = unpack_bitmask(grammar.next_token_bitmask()[None], vocab)[0]
        assert allowed[tok] and not allowed[eos] and not grammar.complete, (i, tok)
        grammar.accept(tok)
    assert grammar.complete
    assert unpack_bitmask(grammar.next_token_bitmask()[None], vocab)[0].nonzero().flatten().tolist() == [eos]
    with pytest.raises(RuntimeError, match="breaks the request's response_format grammar"):
        grammar.accept(tokens[0])
