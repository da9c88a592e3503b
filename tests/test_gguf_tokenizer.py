"""A GGUF's cached tokenizer read without transformers (`LightTokenizer`) answers as the
transformers tokenizer of the same cache entry: encodings, decodings, chat templates, special
tokens; entries transformers might read differently are left to it; other calls reach it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from localgen.models import gguf_source
from localgen.models.gguf_tokenizer import LightTokenizer, read_light_tokenizer
from localgen.models.tokenizer_cache import cache_entry, load_saved

FAMILIES = Path(__file__).parent / "fixtures" / "families"
TEXTS = ["Hello world", "  two  spaces\nand a newline\t tab", "naïve café ✓ 日本 🤗",
         "<|im_start|>user\nhi<|im_end|>", "<s> </s> [INST] x", "", " ", "\n\n\n"]
CHATS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be brief. ünïcode"}, {"role": "user", "content": "Name a cat."},
     {"role": "assistant", "content": "Tom.", "tool_calls": None}, {"role": "user", "content": "More?\n"}],
    [{"role": "user", "content": "say <|im_end|> and {{ 1 + 1 }}"}],
]


def _pair(gguf: Path) -> tuple[LightTokenizer | None, object]:
    """The light reading of ``gguf``'s cache entry (written first) and transformers' reading."""
    gguf_source.load_gguf_tokenizer(gguf)  # converts into the session's cache when missing
    entry = cache_entry(gguf)
    return read_light_tokenizer(entry), load_saved(entry)


def _assert_same(light, full) -> None:
    assert light.get_vocab() == full.get_vocab() and len(light) == len(full)
    assert light.vocab_size == full.vocab_size
    for name in ("bos", "eos", "unk", "pad"):
        assert getattr(light, f"{name}_token") == getattr(full, f"{name}_token")
        assert getattr(light, f"{name}_token_id") == getattr(full, f"{name}_token_id")
    assert light.chat_template == full.chat_template
    for text in TEXTS:
        for special in (True, False):
            ids = full(text, add_special_tokens=special)["input_ids"]
            assert dict(light(text, add_special_tokens=special)) == dict(full(text, add_special_tokens=special))
            assert light.encode(text, add_special_tokens=special) == ids
            for skip in (True, False):
                assert light.decode(ids, skip_special_tokens=skip) == full.decode(ids, skip_special_tokens=skip)
    if full.chat_template is None:
        return
    for chat in CHATS:
        for gen in (True, False):
            try:
                want = full.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            except Exception as e:  # a template that refuses this chat must refuse it here too
                with pytest.raises(type(e)):
                    light.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
                continue
            assert light.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen) == want


@pytest.fixture(scope="module")
def embedded():
    from localgen.models.sources import embedded_gguf_path

    light, full = _pair(embedded_gguf_path())
    assert light is not None, "the embedded model's entry must be read without transformers"
    return light, full


def test_the_embedded_tokenizer_answers_as_transformers(embedded):
    _assert_same(*embedded)


def test_the_embedded_model_loads_it_without_importing_transformers():
    import subprocess
    import sys

    code = ("import sys; from localgen.models.sources import load_embedded; "
            "t = load_embedded().tokenizer; t.apply_chat_template([{'role': 'user', 'content': 'hi'}], "
            "tokenize=False, add_generation_prompt=True); t.decode(t.encode('hi')); "
            "print(type(t).__name__, 'transformers' in sys.modules)")
    load_embedded_tokenizer = subprocess.run([sys.executable, "-c", code], capture_output=True,
                                             text=True, check=True)
    assert load_embedded_tokenizer.stdout.split() == ["LightTokenizer", "False"]


@pytest.mark.parametrize("gguf", sorted(FAMILIES.glob("*.gguf")), ids=lambda p: p.stem)
def test_each_family_fixture_reads_the_same_or_is_left_to_transformers(gguf):
    light, full = _pair(gguf)
    if light is not None:
        _assert_same(light, full)


TEMPLATES = {
    "namespace_and_loop_controls": (
        "{% set ns = namespace(n=0, seen=[]) %}{% for m in messages %}{% if m.role == 'system' %}"
        "{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}[{{ ns.n }}:{{ m.role }}]{{ m.content }}"
        "{% if ns.n > 2 %}{% break %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}>{% endif %}"),
    "tojson_dict_and_tokens": (
        "{{ bos_token }}{{ messages | tojson }}{{ dict(a=1, b='é') | tojson(indent=2) }}"
        "{{ dict.fromkeys(['x'], 0) | tojson(sort_keys=True) }}{{ eos_token }}"),
    "trim_and_lstrip_blocks": (
        "  {% for m in messages %}\n    {{ m.content | trim }}\n  {% endfor %}\n{{ 'end' }}"),
    "strftime": "{{ strftime_now('%Y') }}:{{ messages[0].content }}",
}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_template_features_render_as_transformers_renders_them(embedded, name):
    light, full = _renamed(embedded, TEMPLATES[name])
    for chat in CHATS:
        for gen in (True, False):
            want = full.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            assert light.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen) == want


def _renamed(embedded, template: str):
    """Copies of the embedded pair with another chat template."""
    light, full = embedded
    other = LightTokenizer(light.backend, dict(light.special_tokens_map), template, light.folder)
    copy = load_saved(light.folder)
    copy.chat_template = template
    return other, copy


def test_a_template_error_and_the_sandbox_are_kept(embedded):
    import jinja2

    raising = "{{ raise_exception('only user turns: ' + messages[0].role) }}"
    light, full = _renamed(embedded, raising)
    for tok in (light, full):
        with pytest.raises(jinja2.TemplateError, match="only user turns: user"):
            tok.apply_chat_template(CHATS[0], tokenize=False)
    light, full = _renamed(embedded, "{% set ns = namespace(_x=1) %}{{ ns._x }}")
    for tok in (light, full):
        with pytest.raises(jinja2.exceptions.SecurityError):
            tok.apply_chat_template(CHATS[0], tokenize=False)
    light, full = _renamed(embedded, "{{ messages.__class__.__mro__ }}")
    for tok in (light, full):
        with pytest.raises(jinja2.exceptions.SecurityError):
            tok.apply_chat_template(CHATS[0], tokenize=False)


def test_other_calls_go_to_transformers_with_its_answers(embedded):
    light, full = embedded
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    chat = CHATS[1]
    assert light.apply_chat_template(chat, tools=tools, tokenize=False) == \
        full.apply_chat_template(chat, tools=tools, tokenize=False)
    assert list(light.apply_chat_template(chat)["input_ids"]) == list(full.apply_chat_template(chat)["input_ids"])
    reasoning = [{"role": "assistant", "content": "x", "reasoning_content": "because"}]
    assert light.apply_chat_template(reasoning, tokenize=False) == full.apply_chat_template(reasoning, tokenize=False)
    ids = full.encode("Hello there")
    assert light.decode(np.array(ids)) == full.decode(np.array(ids))
    assert light.decode(ids[0]) == full.decode(ids[0])
    assert light(["a", "b c"])["input_ids"] == full(["a", "b c"])["input_ids"]
    assert light.all_special_ids == full.all_special_ids  # an attribute it does not hold itself
    assert light.transformers_tokenizer is light.transformers_tokenizer  # read once
    assert light("hi").input_ids == light("hi")["input_ids"]


def test_a_grammar_compiles_against_it(embedded):
    from localgen.runtime.structured import GrammarCache

    light, _ = embedded
    grammars = GrammarCache(light, None, (light.eos_token_id,))
    assert grammars.compile({"type": "json_object"}) is not None


def _copy_entry(embedded, tmp_path: Path) -> Path:
    folder = tmp_path / "entry"
    shutil.copytree(embedded[0].folder, folder)
    return folder


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("change", [
    {"add_bos_token": True},  # transformers rebuilds the post-processor
    {"clean_up_tokenization_spaces": True},
    {"extra_special_tokens": ["<x>"]},
    {"eos_token": "<not in the vocabulary>"},  # transformers would add it
    {"bos_token": {"content": "<|im_start|>", "lstrip": True}},
    {"tokenizer_class": "LlamaTokenizer"},
])
def test_entries_transformers_might_read_differently_are_left_to_it(embedded, tmp_path, change):
    folder = _copy_entry(embedded, tmp_path)
    assert isinstance(read_light_tokenizer(folder), LightTokenizer)
    _edit_config(folder, **change)
    assert read_light_tokenizer(folder) is None


def test_a_backend_with_truncation_or_an_extra_file_is_left_to_transformers(embedded, tmp_path):
    folder = _copy_entry(embedded, tmp_path)
    (folder / "special_tokens_map.json").write_text("{}")
    assert read_light_tokenizer(folder) is None
    (folder / "special_tokens_map.json").unlink()
    tj = folder / "tokenizer.json"
    data = json.loads(tj.read_text())
    data["truncation"] = {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}
    tj.write_text(json.dumps(data))
    assert read_light_tokenizer(folder) is None


def test_a_damaged_or_missing_entry_reads_as_none(embedded, tmp_path):
    assert read_light_tokenizer(tmp_path / "absent") is None
    folder = _copy_entry(embedded, tmp_path)
    tj = folder / "tokenizer.json"
    tj.write_text(tj.read_text()[:100])
    assert read_light_tokenizer(folder) is None
    (folder / "tokenizer_config.json").write_text("{not json")
    assert read_light_tokenizer(folder) is None


def test_the_engine_gives_the_same_tokens_and_text_with_either_tokenizer(embedded):
    from localgen.api import LLM, Request, SamplingParams
    from localgen.models.sources import load_embedded

    src = load_embedded()
    outs = []
    for tok in embedded:  # light, then transformers'
        llm = LLM.from_parts(src.config, src.weights, tok, device="cpu", dtype="float32")
        req = Request(messages=CHATS[1], sampling=SamplingParams(temperature=0, max_tokens=12))
        raw = Request(prompt="The capital of France is", sampling=SamplingParams(temperature=0, max_tokens=6))
        outs.append([(o.prompt_tokens, o.token_ids, o.text) for o in llm.generate([req, raw])])
    assert outs[0] == outs[1]
    assert all(text for _, _, text in outs[0])
