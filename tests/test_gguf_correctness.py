"""GGUF files localgen must run right or refuse before generating (issue 27): llama3 RoPE scaling
stored only as the rope_freqs tensor, keys and tensors that change the math, and files that are
truncated, corrupt or not GGUF at all."""

from __future__ import annotations

import dataclasses
import re
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from localgen.api import LLM, Request, SamplingParams
from localgen.models.config import CorruptModelError, UnsupportedModelError
from localgen.models.gguf_source import load_gguf
from localgen.models.rope import inv_frequencies
from localgen.models.sources import resolve_model
from localgen.runtime.engine import EngineConfig
from tests import tiny_models as tm
from tests.test_engine_vs_hf import hf_greedy

# llama3 scaling whose original context (16) the 64-token prompt outgrows fourfold: the scaled
# frequencies then move the logits by whole units, not rounding noise.
ORIGINAL = 16
LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=ORIGINAL)
PROMPT_LEN, NEW_TOKENS = 64, 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
LOGIT_TOL = 1e-4  # fp32 last-position logits against transformers, absolute and relative


def rope_model(rope_scaling: dict | None, seed: int = 0) -> torch.nn.Module:
    """A tiny Llama (head_dim 16, theta 1e4) with `rope_scaling`. The original context length is
    also set at the config's top level, where llama.cpp's converter reads it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = {k: v for k, v in tm.VARIANTS["llama2"].items() if k != "model_type"}
    kw.update(num_key_value_heads=2, rope_theta=10000.0, rope_scaling=rope_scaling,
              original_max_position_embeddings=ORIGINAL)
    cfg = AutoConfig.for_model("llama", vocab_size=tm.vocab_size(), bos_token_id=tm.BOS_ID,
                               eos_token_id=tm.EOS_ID, pad_token_id=tm.PAD_ID, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    tm._reinit_(model, seed)
    return model.eval()


def write_converted(model, out: Path, qtype: str = "F32") -> Path:
    """`model` saved as a HF directory and converted as llama.cpp would: ``out/model.gguf``."""
    model.save_pretrained(out / "hf")
    tm.make_tokenizer().save_pretrained(out / "hf")
    return tm.write_gguf(out / "model.gguf", out / "hf", qtype)


def prompt_ids(seed: int = 5) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(6, 300, (PROMPT_LEN,), generator=g).tolist()


def last_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """The engine's prefill logits at the last prompt position ``[vocab]``."""
    eng = llm.engine
    eng.add_request(Request(prompt_token_ids=prompt, sampling=GREEDY))
    batch = eng.scheduler.schedule()
    return eng.runner.run(batch.seqs, batch.is_prefill)[0]


def hf_last_logits(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0, -1]


@pytest.fixture(scope="module")
def llama31(tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    model = rope_model(LLAMA3)
    return model, write_converted(model, tmp_path_factory.mktemp("llama31"))


# ---- llama3 RoPE scaling as the rope_freqs tensor -----------------------------------------------


def test_llama3_scaling_is_stored_only_as_rope_freqs_and_read_exactly(llama31):
    from gguf import GGUFReader

    model, path = llama31
    reader = GGUFReader(str(path))
    assert not [k for k in reader.fields if ".rope.scaling" in k]
    assert "rope_freqs.weight" in {t.name for t in reader.tensors}
    cfg, store = load_gguf(path)
    assert cfg.rope_scaling is None and len(cfg.rope_freq_factors) == cfg.head_dim // 2
    assert "rope_freqs.weight" not in store.names()  # a config value, not a layer weight
    # the factors blend (first frequency), divide by `factor` (the rest) and reproduce
    # transformers' llama3 inverse frequencies bit for bit on this config
    assert 1.0 < cfg.rope_freq_factors[0] < 8.0 and set(cfg.rope_freq_factors[1:]) == {8.0}
    assert torch.equal(inv_frequencies(cfg), model.model.rotary_emb.inv_freq)


def test_llama3_gguf_greedy_tokens_and_logits_equal_transformers(llama31):
    model, path = llama31
    prompt = prompt_ids()
    llm = LLM.load(str(path), device="cpu", dtype="float32", kv_cache_memory=1 << 22)
    out = llm.generate([Request(prompt_token_ids=prompt, sampling=GREEDY)])[0]
    assert out.token_ids == hf_greedy(model, prompt, NEW_TOKENS)
    fresh = LLM.load(str(path), device="cpu", dtype="float32", kv_cache_memory=1 << 22)
    torch.testing.assert_close(last_logits(fresh, prompt), hf_last_logits(model, prompt),
                               atol=LOGIT_TOL, rtol=LOGIT_TOL)


def test_ignoring_rope_freqs_would_fail_the_comparison(llama31):
    """The comparison above has teeth: without the scaling, transformers and localgen both move
    far outside the tolerance and pick other tokens."""
    model, path = llama31
    prompt = prompt_ids()
    plain = rope_model(None)
    plain.load_state_dict(model.state_dict())
    assert hf_greedy(plain, prompt, NEW_TOKENS) != hf_greedy(model, prompt, NEW_TOKENS)
    cfg, store = load_gguf(path)
    ablated = LLM.from_parts(dataclasses.replace(cfg, rope_freq_factors=None), store,
                             tm.make_tokenizer(), EngineConfig(kv_cache_memory=1 << 22),
                             device="cpu", dtype="float32")
    ours = last_logits(ablated, prompt)
    torch.testing.assert_close(ours, hf_last_logits(plain, prompt), atol=LOGIT_TOL, rtol=LOGIT_TOL)
    assert (ours - hf_last_logits(model, prompt)).abs().max() > 1000 * LOGIT_TOL


def test_linear_scaling_gguf_equals_transformers(tmp_path):
    model = rope_model({"rope_type": "linear", "factor": 4.0})
    path = write_converted(model, tmp_path)
    llm = LLM.load(str(path), device="cpu", dtype="float32", kv_cache_memory=1 << 22)
    assert llm.config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    prompt = prompt_ids()
    out = llm.generate([Request(prompt_token_ids=prompt, sampling=GREEDY)])[0]
    assert out.token_ids == hf_greedy(model, prompt, NEW_TOKENS)


# ---- keys and tensors that change the math: refused, never skipped ------------------------------


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {v: tm.make_hf_model(root, v) for v in ("llama2", "qwen2")}


def write(model_dirs, tmp_path, variant="llama2", metadata=None, tensors=None) -> Path:
    return tm.write_gguf(tmp_path / f"{variant}.gguf", model_dirs[variant], "F32",
                         with_tokenizer=False, metadata=metadata, tensors=tensors)


def test_experts_of_an_arch_without_moe_math_are_refused_up_front_in_one_sentence(model_dirs, tmp_path):
    experts = {"blk.0.ffn_gate_exps.weight": np.zeros((8, 128, 64))}
    path = write(model_dirs, tmp_path, "qwen2", metadata={"{arch}.expert_count": 8,
                                                          "{arch}.expert_used_count": 2}, tensors=experts)
    with pytest.raises(UnsupportedModelError) as e:
        resolve_model(path)
    assert str(e.value) == (f"{path}: qwen2.expert_count = 8: localgen runs the experts of Mixtral "
                            f"(llama arch) and Qwen3-MoE (qwen3moe) files only")


REFUSED = [
    # (variant, metadata, tensors, what the message says after "<file>: ")
    ("llama2", {"{arch}.attention.sliding_window": 4096}, None,
     "llama.attention.sliding_window = 4096: sliding-window attention is not supported yet"),
    ("qwen2", {"{arch}.attention.sliding_window": 32768}, None,
     "qwen2.attention.sliding_window = 32768: sliding-window"),
    ("llama2", {"{arch}.rope.scaling.type": "yarn", "{arch}.rope.scaling.factor": 4.0}, None,
     "llama.rope.scaling.type = 'yarn': this RoPE scaling is not supported yet"),
    ("qwen2", {"{arch}.rope.scaling.type": "longrope"}, None,
     "qwen2.rope.scaling.type = 'longrope'"),
    ("llama2", {"{arch}.attention.layer_norm_epsilon": 0.5}, None,
     "llama.attention.layer_norm_epsilon = 0.5: LayerNorm (non-RMS) models are not supported"),
    ("llama2", {"{arch}.attn_logit_softcapping": 50.0}, None,
     "llama.attn_logit_softcapping = 50.0: attention logit soft-capping is not supported"),
    ("qwen2", {"{arch}.final_logit_softcapping": 30.0}, None,
     "qwen2.final_logit_softcapping = 30.0: final logit soft-capping"),
    ("llama2", {"{arch}.logit_scale": 0.5}, None, "llama.logit_scale = 0.5: scaled output logits"),
    ("llama2", {"{arch}.attention.causal": False}, None, "llama.attention.causal = False: non-causal"),
    ("llama2", {"{arch}.rope.dimension_count": 8}, None,
     "llama.rope.dimension_count = 8: head_dim is 16; partial rotary embeddings are not supported"),
    ("llama2", {"{arch}.attention.value_length": 32}, None, "llama.attention.value_length = 32"),
    ("llama2", {"{arch}.attention.head_count_kv": [4, 2]}, None,
     "llama.attention.head_count_kv = [4, 2]: per-layer values differ"),
    ("llama2", {"{arch}.a_key_from_the_future": 3}, None,
     "llama.a_key_from_the_future = 3: localgen does not implement this key"),
    ("llama2", {"split.count": 3}, None, "split.count = 3: this is one part of a split GGUF"),
    ("llama2", {"general.type": "adapter"}, None, "general.type = 'adapter'"),
    ("llama2", None, {"blk.0.attn_q_norm.weight": np.ones(16)},
     "tensor blk.0.attn_q_norm.weight [16] F32: localgen has no math for it"),
    ("llama2", None, {"blk.1.attn_norm.bias": np.zeros(64)}, "tensor blk.1.attn_norm.bias [64] F32"),
    ("qwen2", None, {"token_embd_norm.weight": np.ones(64)}, "tensor token_embd_norm.weight"),
    ("llama2", None, {"blk.2.ffn_up.weight": np.zeros((128, 64))},
     "tensor blk.2.ffn_up.weight: layer 2 is beyond block_count 2"),
]


@pytest.mark.parametrize("variant, metadata, tensors, says", REFUSED,
                         ids=[r[3].split(" = ")[0].split(":")[0] for r in REFUSED])
def test_keys_and_tensors_that_change_the_math_are_refused(model_dirs, tmp_path, variant,
                                                           metadata, tensors, says):
    path = write(model_dirs, tmp_path, variant, metadata, tensors)
    with pytest.raises(UnsupportedModelError) as e:
        load_gguf(path)
    assert str(e.value).startswith(f"{path}: {says}")


@pytest.mark.parametrize("variant", ["llama2", "qwen2"])
def test_keys_at_their_neutral_value_load(model_dirs, tmp_path, variant):
    neutral = {"{arch}.expert_count": 0, "{arch}.expert_used_count": 0,
               "{arch}.attention.sliding_window": 0, "{arch}.attention.causal": True,
               "{arch}.rope.scaling.original_context_length": 64, "{arch}.logit_scale": 1.0,
               "{arch}.attention.head_count_kv": [2 if variant == "qwen2" else 4] * 2,
               "general.type": "model", "quantize.imatrix.file": "imatrix.dat"}
    cfg, store = load_gguf(write(model_dirs, tmp_path, variant, neutral))
    assert cfg.rope_scaling is None and cfg.rope_freq_factors is None
    assert cfg.num_kv_heads == (2 if variant == "qwen2" else 4)


@pytest.mark.parametrize("metadata, scaling", [
    ({"{arch}.rope.scaling.type": "none", "{arch}.rope.scaling.factor": 4.0}, None),
    ({"{arch}.rope.scaling.factor": 4.0}, {"rope_type": "linear", "factor": 4.0}),
    ({"{arch}.rope.scale_linear": 2.0}, {"rope_type": "linear", "factor": 2.0}),
    ({"{arch}.rope.scaling.type": "linear", "{arch}.rope.scaling.factor": 1.0}, None),
])
def test_rope_scaling_keys_read_as_llama_cpp_does(model_dirs, tmp_path, metadata, scaling):
    cfg, _ = load_gguf(write(model_dirs, tmp_path, metadata=metadata))
    assert cfg.rope_scaling == scaling


# ---- bad files: one sentence naming the file, the tensor and what is missing --------------------


@pytest.fixture
def good(model_dirs, tmp_path) -> Path:
    return write(model_dirs, tmp_path)


def cut_copy(path: Path, keep: int) -> Path:
    out = path.with_name(f"cut{keep}.gguf")
    out.write_bytes(path.read_bytes()[:keep])
    return out


def patched_type(path: Path, tensor: str, type_id: int) -> Path:
    """A copy of `path` whose tensor info for `tensor` claims GGML type id `type_id`."""
    data = bytearray(path.read_bytes())
    at = data.index(tensor.encode()) + len(tensor)  # name, then n_dims u32, dims u64[], type u32
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, type_id)
    out = path.with_name(f"type{type_id}.gguf")
    out.write_bytes(bytes(data))
    return out


def test_truncated_tensor_data_names_the_tensor_and_the_missing_bytes(good):
    from gguf import GGUFReader

    size = good.stat().st_size - 1000
    tensors = GGUFReader(str(good)).tensors
    past = sorted((t for t in tensors if t.data_offset + t.n_bytes > size), key=lambda t: t.data_offset)
    first = past[0]
    cut = cut_copy(good, size)
    with pytest.raises(CorruptModelError) as e:
        resolve_model(cut)
    assert str(e.value).startswith(
        f"{cut}: tensor {first.name} needs {first.n_bytes:,} bytes at offset {first.data_offset:,}, "
        f"the file ends {first.data_offset + first.n_bytes - size:,} bytes short")


def test_a_file_cut_in_half_counts_the_other_tensors_past_the_end(good):
    with pytest.raises(CorruptModelError, match=r"bytes short \(\d+ more tensors lie past the end\)"):
        load_gguf(cut_copy(good, good.stat().st_size // 2))


def test_a_header_cut_short_names_what_it_was_reading(good):
    name_at = good.read_bytes().index(b"output_norm.weight")  # its info: u64 length, then the name
    cut = cut_copy(good, name_at + 4)
    with pytest.raises(CorruptModelError) as e:
        load_gguf(cut)
    assert re.fullmatch(rf"{re.escape(str(cut))}: the file ends inside its header: tensor info "
                        rf"\d+ of \d+ needs 18 bytes at offset {name_at:,}, the file ends 14 bytes "
                        rf"short", str(e.value))
    cut = cut_copy(good, 60)  # magic, version, counts (24 bytes), the first key: in its value
    with pytest.raises(CorruptModelError) as e:
        load_gguf(cut)
    assert str(e.value) == (f"{cut}: the file ends inside its header: metadata key "
                            f"general.architecture needs 8 bytes at offset 56, the file ends 4 "
                            f"bytes short")


@pytest.mark.parametrize("content, says", [
    (b"", "not a GGUF file: it is empty"),
    (b"PK\x03\x04" + bytes(200), r"not a GGUF file: it starts with b'PK\x03\x04"),
    (b'{"model_type": "llama"}', "not a GGUF file: it starts with b'{\"model_'"),
])
def test_a_file_that_is_not_gguf_is_one_sentence(tmp_path, content, says):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(CorruptModelError) as e:
        load_gguf(path)
    assert str(e.value).startswith(f"{path}: {says}")


def test_an_unknown_tensor_type_names_file_tensor_and_type(good):
    path = patched_type(good, "blk.0.attn_q.weight", 99)
    with pytest.raises(UnsupportedModelError) as e:
        load_gguf(path)
    assert str(e.value).startswith(f"{path}: tensor blk.0.attn_q.weight has type id 99, which "
                                   f"the installed gguf package does not know")


def test_a_type_localgen_cannot_load_names_file_tensor_and_type(good):
    path = patched_type(good, "blk.0.attn_q.weight", 9)  # Q8_1: a ggml type gguf cannot expand
    with pytest.raises(UnsupportedModelError) as e:
        load_gguf(path)
    assert str(e.value).startswith(f"{path}: tensor blk.0.attn_q.weight is stored as Q8_1, a type "
                                   f"localgen cannot load")


def test_rows_that_are_not_whole_blocks_are_corrupt(good):
    path = patched_type(good, "blk.0.attn_norm.weight", 14)  # Q6_K: 256-value blocks, 64 values
    with pytest.raises(CorruptModelError, match=r"tensor blk\.0\.attn_norm\.weight: rows of 64 "
                                                r"values are not whole Q6_K blocks of 256"):
        load_gguf(path)


def test_an_unsupported_gguf_version_is_one_sentence(good):
    data = bytearray(good.read_bytes())
    struct.pack_into("<I", data, 4, 1)
    path = good.with_name("v1.gguf")
    path.write_bytes(bytes(data))
    with pytest.raises(UnsupportedModelError, match="GGUF version 1 is not supported"):
        load_gguf(path)
