"""The dense families (Qwen3, Qwen2.5, Phi-3, Granite, OLMo 2, SmolLM3, Gemma 2/3, Mistral with a
sliding window) against transformers on the same tiny weights: greedy tokens equal to
transformers' KV-cached greedy decoding and last-position logits within 1e-4 (float32, CPU), from
the committed Hugging Face directory and from the GGUF llama.cpp's converter made of it
(tests/fixtures/families/make_fixtures.py), through the paged KV cache and the offload runtime.

The variants the fixtures cover: tied and untied embeddings (qwen3 vs qwen3_mqa), GQA (2 KV
heads) and MQA (qwen3_mqa, gemma3), head_dim != hidden / heads (qwen3_mqa, gemma2, mistral),
sliding windows of 8 tokens under 20-token prompts (gemma2, gemma3, mistral), partial rotary and
LongRoPE past the original context (phi3), layers without RoPE (smollm3)."""

from __future__ import annotations

import json

import pytest
import torch

from localgen.api import LLM, Request, SamplingParams
from localgen.models import dense, llama
from localgen.models.config import ModelConfig, UnsupportedModelError
from localgen.models.model import family_of
from localgen.policy.policy import Policy
from tests.fixtures.families.make_fixtures import DENSE_FIXTURES, FIXTURES, HERE, TEMPLATES
from tests.test_engine_vs_hf import hf_greedy

NEW = 14  # phi3's prompt of 20 + 14 crosses its original context of 32: the long factors run
PROMPT_LENGTHS = (20, 11)
# llama.cpp's converter writes Mistral as the llama arch without its sliding window (llama.cpp
# runs such a file with full attention too), so the mistral GGUF is not the windowed model
GGUF_READY = set(DENSE_FIXTURES) - {"mistral"}
WINDOWED = {"gemma2", "gemma3", "mistral"}
PLAIN = {"qwen25"}  # the Llama layer unchanged (its window is off)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(6, 300, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def reference():
    """name -> (transformers model in float32, its greedy tokens for each prompt)."""
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(name):
        if name not in cache:
            hf = AutoModelForCausalLM.from_pretrained(HERE / name, dtype=torch.float32).eval()
            cache[name] = hf, [hf_greedy(hf, p, NEW) for p in _prompts()]
        return cache[name]
    return get


def _path(name: str, source: str) -> str:
    return str(HERE / name if source == "hf" else HERE / f"{name}.gguf")


def _greedy(llm: LLM) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    return [o.token_ids for o in llm.generate([Request(prompt_token_ids=p, sampling=sp)
                                               for p in _prompts()])]


CASES = [(n, "hf") for n in DENSE_FIXTURES] + [(n, "gguf") for n in DENSE_FIXTURES if n in GGUF_READY]


@pytest.mark.parametrize("name,source", CASES)
def test_greedy_tokens_equal_transformers(reference, name, source):
    llm = LLM.load(_path(name, source), device="cpu", dtype="float32", kv_cache_memory=1 << 22,
                   block_size=4)
    assert family_of(llm.engine.model.cfg) is (llama if name in PLAIN else dense)
    assert _greedy(llm) == reference(name)[1]


@pytest.mark.parametrize("name,source", CASES)
def test_prefill_logits_within_tolerance(reference, name, source):
    hf = reference(name)[0]
    llm = LLM.load(_path(name, source), device="cpu", dtype="float32", kv_cache_memory=1 << 22,
                   block_size=4)
    p = _prompts()[0]
    eng = llm.engine
    eng.add_request(Request(prompt_token_ids=p, sampling=SamplingParams(max_tokens=1)))
    batch = eng.scheduler.schedule()
    ours = eng.runner.run(batch.seqs, batch.is_prefill)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([p])).logits[0, -1]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", sorted(WINDOWED))
def test_windowed_fixtures_depend_on_their_window(reference, name):
    """The window is shorter than the prompt: without it transformers' logits change, so the
    equality tests above do check the window."""
    from transformers import AutoModelForCausalLM

    cfg = json.loads((HERE / name / "config.json").read_text())
    cfg["sliding_window"] = 4096
    from transformers import AutoConfig

    wide = AutoModelForCausalLM.from_pretrained(
        HERE / name, config=AutoConfig.for_model(**cfg), dtype=torch.float32).eval()
    p = torch.tensor([_prompts()[0]])
    with torch.no_grad():
        assert not torch.allclose(wide(p).logits[0, -1], reference(name)[0](p).logits[0, -1],
                                  atol=1e-3)



def test_mistral_gguf_is_the_model_without_its_window(tmp_path):
    """llama.cpp's converter writes no sliding window for Mistral, so its GGUF is the full-
    attention model: greedy tokens equal transformers' with the window widened past the context
    (and, by the test above, differ from the windowed model's logits)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = json.loads((HERE / "mistral" / "config.json").read_text())
    cfg["sliding_window"] = 4096
    wide = AutoModelForCausalLM.from_pretrained(
        HERE / "mistral", config=AutoConfig.for_model(**cfg), dtype=torch.float32).eval()
    llm = LLM.load(_path("mistral", "gguf"), device="cpu", dtype="float32",
                   kv_cache_memory=1 << 22, block_size=4)
    assert _greedy(llm) == [hf_greedy(wide, p, NEW) for p in _prompts()]

OFFLOAD = Policy(gbs=1, num_gpu_batches=2, wg=0, wc=1, wd=0, cg=0, cc=1, cd=0, hg=0, hc=1)


def _offloaded(name: str, tmp_path, source: str = "hf") -> LLM:
    return LLM.load(_path(name, source), device="cpu", dtype="float32", kv_cache_memory=1 << 22,
                    block_size=4, policy=OFFLOAD.validate(), offload_dir=str(tmp_path / "off"))


@pytest.mark.parametrize("name,source", CASES)
def test_offload_runtime_gives_the_same_tokens(reference, tmp_path, name, source):
    assert _greedy(_offloaded(name, tmp_path, source)) == reference(name)[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name,source", CASES)
def test_gpu_greedy_tokens_equal_transformers(reference, name, source):
    """The CUDA path (Triton paged attention for every layer, windows and soft-caps included)
    in float32 gives transformers' tokens."""
    llm = LLM.load(_path(name, source), device="cuda", dtype="float32", kv_cache_memory=1 << 24,
                   block_size=16)
    assert _greedy(llm) == reference(name)[1]


@pytest.mark.parametrize("name,source", [("qwen3", "hf"), ("qwen3", "gguf"), ("phi3", "hf")])
def test_chat_template_the_model_ships(name, source):
    llm = LLM.load(_path(name, source), device="cpu", dtype="float32", kv_cache_memory=1 << 20)
    msgs = [{"role": "user", "content": "hello world"}]
    text = llm.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    from jinja2 import Template

    want = Template(TEMPLATES[FIXTURES[name][2]]).render(messages=msgs, add_generation_prompt=True)
    assert text == want


def test_a_model_sliding_in_every_layer_holds_only_its_window_of_kv(reference):
    """Mistral's window of 8 with 4-token KV blocks: once decoding, the sequence holds the blocks
    its window touches (at most 3) and the placeholder, however long it grows, and still decodes
    transformers' tokens (20-token prompt, 40 new ones). Gemma 2 keeps everything (its full
    layers read the whole context)."""
    from transformers import AutoModelForCausalLM

    assert ModelConfig.from_hf_dict(json.loads((HERE / "gemma2" / "config.json").read_text())
                                    ).dense.kv_window(2) is None
    llm = LLM.load(_path("mistral", "hf"), device="cpu", dtype="float32", kv_cache_memory=1 << 22,
                   block_size=4)
    bm, p = llm.engine.block_manager, _prompts()[0]
    llm.add_request(Request(prompt_token_ids=p, sampling=SamplingParams(
        temperature=0.0, max_tokens=40, ignore_eos=True)))
    held, out = [], None
    while llm.has_unfinished():
        for o in llm.step():
            out = o.token_ids
        held.append(bm.num_blocks - bm.num_free_blocks)
    assert held[0] == 5 and max(held[1:-1]) <= 8 // 4 + 2  # prefill: all 20 tokens' blocks
    hf = AutoModelForCausalLM.from_pretrained(HERE / "mistral", dtype=torch.float32).eval()
    assert out == hf_greedy(hf, p, 40)


def test_blocks_behind_the_window_are_given_back_and_stay_reusable():
    from localgen.kv.block_manager import BlockManager

    bm = BlockManager(16, block_size=4, sliding_window=8)
    tokens = list(range(10, 30))  # 20 tokens: 5 blocks
    table, _ = bm.allocate(tokens)
    first = table[:2]
    tokens.append(30)
    bm.append(table, tokens)  # 21 tokens: the query at 20 sees 13..20, so blocks 0-2 go
    placeholder = table[0]
    assert table[:3] == [placeholder] * 3 and placeholder not in first
    assert bm.num_free_blocks == 16 - 4  # blocks 3, 4, 5 and the placeholder held
    other, cached = bm.allocate(tokens[:9] + [99])  # blocks 0-1 kept their contents and hashes
    assert other[:2] == first and cached == 8
    bm.free(table)
    bm.free(other)
    assert bm.num_free_blocks == 16  # the placeholder too, with the last table pointing at it


def _q8_0_copy(src, dst) -> None:
    """``src`` GGUF rewritten with its 2-D weights in Q8_0 blocks (norms and vectors as they are),
    every metadata key kept: the quantized form of a converted file, made without llama.cpp."""
    import gguf

    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    for key, f in r.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            w.add_key_value(key, f.contents(), f.types[0],
                            f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
    for t in r.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype("float32")
        if data.ndim == 2 and "norm" not in t.name and data.shape[-1] % 32 == 0:
            q = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(t.name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("name", ["phi3", "gemma2", "qwen3"])
def test_quantized_gguf_runs_its_blocks_as_the_expanded_weights(tmp_path, monkeypatch, name):
    """Q8_0 matrices kept in their blocks (Phi-3's fused qkv and gate_up as stored, the others
    fused at load) give the tokens of the same file expanded to float32; float32 activations
    make the two the same arithmetic."""
    from localgen.quant.gguf_blocks import PackedGGUFWeight

    _q8_0_copy(HERE / f"{name}.gguf", tmp_path / "q8.gguf")
    monkeypatch.setenv("LOCALGEN_GGUF_ACTIVATIONS", "f32")
    runs = []
    for packed in ("1", "0"):
        monkeypatch.setenv("LOCALGEN_GGUF_PACKED", packed)
        llm = LLM.load(str(tmp_path / "q8.gguf"), device="cpu", dtype="float32",
                       kv_cache_memory=1 << 22, block_size=4)
        kinds = {type(v) for v in llm.engine.model.layers[0].values()}
        assert (PackedGGUFWeight in kinds) == (packed == "1")
        runs.append(_greedy(llm))
    assert runs[0] == runs[1]


# Config shapes of the Qwen2.5 and DeepSeek-R1 distill checkpoints (their config.json keys that
# matter): they run on the plain Llama layer.
R1_DISTILL_QWEN = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=3584,
                       intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, rope_theta=10000.0,
                       sliding_window=4096, use_sliding_window=False, max_window_layers=28,
                       max_position_embeddings=131072, tie_word_embeddings=False)
R1_DISTILL_LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
                        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                          high_freq_factor=4.0,
                                          original_max_position_embeddings=8192),
                        max_position_embeddings=131072)


@pytest.mark.parametrize("d", [R1_DISTILL_QWEN, R1_DISTILL_LLAMA], ids=["qwen", "llama"])
def test_qwen25_and_r1_distill_configs_run_the_llama_layer(d):
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.dense.plain and cfg.dense.window(0) is None
    assert family_of(cfg) is llama


def test_qwen2_with_its_window_on_windows_the_later_layers():
    cfg = ModelConfig.from_hf_dict({**R1_DISTILL_QWEN, "use_sliding_window": True,
                                    "max_window_layers": 20})
    assert [cfg.dense.window(i) for i in (19, 20)] == [None, 4096]


def test_query_pre_attn_scalar_sets_the_attention_scale():
    d = json.loads((HERE / "gemma2" / "config.json").read_text())
    cfg = ModelConfig.from_hf_dict({**d, "query_pre_attn_scalar": 144})
    assert [dense.layer_spec(cfg, i).scale for i in (0, 1)] == [144 ** -0.5] * 2
    assert [dense.layer_spec(cfg, i).sliding_window for i in (0, 1)] == [8, None]


def test_bidirectional_attention_is_refused_in_one_sentence():
    d = json.loads((HERE / "gemma3" / "config.json").read_text())
    with pytest.raises(UnsupportedModelError, match="Gemma3ForCausalLM: use_bidirectional_attention"):
        ModelConfig.from_hf_dict({**d, "use_bidirectional_attention": True})


def test_an_unknown_layer_type_is_refused_in_one_sentence():
    d = json.loads((HERE / "gemma2" / "config.json").read_text())
    d["layer_types"] = ["chunked_attention", "full_attention"]
    with pytest.raises(UnsupportedModelError, match="layer_types holds \\['chunked_attention'\\]"):
        ModelConfig.from_hf_dict(d)
