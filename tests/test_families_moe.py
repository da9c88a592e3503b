"""Mixtral and Qwen3-MoE against transformers on the same weights: greedy tokens equal to the
reference's, top-1 and top-2 routing, from the committed Hugging Face directories and from their
GGUFs made by llama.cpp's converter (tests/fixtures/families/make_fixtures.py), on the CPU path.
Also: routing as each family's transformers router computes it, experts run batched per expert,
quantized GGUF experts through the packed matmul, and the refusals (offload runtime, gpt-oss)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from localgen.api import LLM, Request, SamplingParams
from localgen.models import moe
from localgen.models.config import ModelConfig, UnsupportedModelError
from localgen.models.moe_options import SOFTMAX_TOPK, TOPK_SOFTMAX, MoEOptions
from localgen.models.sources import resolve_model
from tests.fixtures.families.make_fixtures import MOE_FIXTURES
from tests.test_engine_vs_hf import hf_greedy, prompts, run_staggered

FIXTURES = Path(__file__).parent / "fixtures" / "families"
LOGITS_ATOL = 1e-4  # float32 on both sides, the same float16-valued weights


def hf_model(name: str, path: Path | None = None):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path or FIXTURES / name, dtype=torch.float32).eval()


def load(path: Path) -> LLM:
    return LLM.load(str(path), device="cpu", dtype="float32", kv_cache_memory=1 << 22, block_size=4)


def prefill_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    llm.add_request(Request(prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=1)))
    return llm.engine.runner.run(llm.engine.scheduler.schedule().seqs, True)[0]


def assert_greedy_equal(llm: LLM, hf) -> None:
    ps = prompts(3)
    got = run_staggered(llm, ps)
    for i, p in enumerate(ps):
        assert got[i] == hf_greedy(hf, p), f"prompt {i} (len {len(p)}) differs"
    assert len({t for toks in got.values() for t in toks}) > 8  # varied tokens: a real comparison


@pytest.mark.parametrize("source", ["hf", "gguf"])
@pytest.mark.parametrize("name", list(MOE_FIXTURES))
def test_greedy_tokens_equal_transformers(name, source):
    hf = hf_model(name)
    path = FIXTURES / (name if source == "hf" else f"{name}.gguf")
    llm = load(path)
    cfg = llm.engine.model.cfg
    assert cfg.moe is not None and cfg.moe.top_k == MOE_FIXTURES[name][1]["num_experts_per_tok"]
    assert_greedy_equal(llm, hf)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["mixtral_top2", "qwen3moe_top1"])
def test_greedy_tokens_on_cuda_equal_transformers(name):
    """float32 on the GPU: the fused layer path (llama.layer_step) for Mixtral, the dense one for
    Qwen3-MoE, decode without CUDA graphs (the routing reads per-expert counts on the host)."""
    llm = LLM.load(str(FIXTURES / name), device="cuda", dtype="float32", kv_cache_memory=1 << 22,
                   block_size=4)
    assert type(llm.engine.runner).__name__ != "GraphedModelRunner"
    assert_greedy_equal(llm, hf_model(name))


@pytest.mark.parametrize("source", ["hf", "gguf"])
@pytest.mark.parametrize("name", ["mixtral_top2", "qwen3moe_top2"])
def test_prefill_logits_match_transformers(name, source):
    prompt = prompts(5, lengths=(21,))[0]
    with torch.no_grad():
        want = hf_model(name)(torch.tensor([prompt])).logits[0, -1]
    path = FIXTURES / (name if source == "hf" else f"{name}.gguf")
    got = prefill_logits(load(path), prompt)
    torch.testing.assert_close(got.reshape(-1)[-want.numel():], want, atol=LOGITS_ATOL, rtol=0)


def _variant_dir(tmp_path: Path, base=MOE_FIXTURES["qwen3moe_top2"], **overrides) -> Path:
    """A model made in the test: ``base`` (a fixture's (model_type, config, template)) with
    ``overrides``, saved as make_fixtures saves its fixtures."""
    from tests.fixtures.families import make_fixtures as mf

    kind, kw, template = base
    mf.FIXTURES["variant"] = (kind, dict(kw, **overrides), template)
    try:
        return mf.write_hf("variant", tmp_path)
    finally:
        del mf.FIXTURES["variant"]


# gpt-oss (made in the test: its GGUF is refused, so there is no converted fixture): sinks,
# biased attention and experts, sliding layers with a window shorter than the prompts, YaRN
GPT_OSS = ("gpt_oss", dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
                           sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                           tie_word_embeddings=False,
                           rope_parameters=dict(rope_type="yarn", factor=4.0, beta_fast=32.0,
                                                beta_slow=1.0, truncate=False, rope_theta=150000.0,
                                                original_max_position_embeddings=64)), "chatml")


@pytest.mark.parametrize("top_k", [1, 2])
def test_gpt_oss_from_the_hf_dir(tmp_path, top_k):
    path = _variant_dir(tmp_path, GPT_OSS, num_experts_per_tok=top_k)
    llm = load(path)
    cfg = llm.engine.model.cfg
    assert cfg.moe.layout == "gpt_oss" and cfg.dense.attention_sinks
    assert cfg.dense.window(0) == 8 and cfg.dense.window(1) is None
    assert_greedy_equal(llm, hf_model("", path))
    prompt = prompts(5, lengths=(21,))[0]
    with torch.no_grad():
        want = hf_model("", path)(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(prefill_logits(load(path), prompt), want, atol=LOGITS_ATOL, rtol=0)


@pytest.mark.parametrize("overrides", [
    dict(norm_topk_prob=False),  # the top-k weights as the softmax gave them
    dict(norm_topk_prob=False, num_experts_per_tok=1),
    dict(num_hidden_layers=3, decoder_sparse_step=2),  # layers 0 and 2 dense
    dict(num_hidden_layers=3, mlp_only_layers=[1]),
], ids=["unnormalised", "unnormalised_top1", "sparse_step", "mlp_only_layers"])
def test_qwen3_moe_variants_from_the_hf_dir(tmp_path, overrides):
    path = _variant_dir(tmp_path, **overrides)
    llm = load(path)
    layers = llm.engine.model.layers
    dense = {i for i, w in enumerate(layers) if not moe.is_moe(w)}
    assert dense == set(llm.engine.model.cfg.moe.dense_layers)
    assert dense == ({0, 2} if "decoder_sparse_step" in overrides else
                     {1} if "mlp_only_layers" in overrides else set())
    assert_greedy_equal(llm, hf_model("", path))


# ---- routing and the per-expert batching ----------------------------------------------------


def _opts(routing: str, k: int, norm: bool) -> MoEOptions:
    return MoEOptions(num_experts=6, top_k=k, expert_size=8, routing=routing, norm_topk_prob=norm,
                      layout="mixtral")


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("family,norm", [("mixtral", True), ("qwen3_moe", True), ("qwen3_moe", False)])
def test_routing_equals_the_transformers_router(family, norm, k):
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    torch.manual_seed(k)
    if family == "mixtral":
        ref = MixtralTopKRouter(MixtralConfig(hidden_size=16, num_local_experts=6, num_experts_per_tok=k))
        opts = _opts(TOPK_SOFTMAX, k, True)
    else:
        ref = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=16, num_experts=6, num_experts_per_tok=k,
                                                norm_topk_prob=norm))
        opts = _opts(SOFTMAX_TOPK, k, norm)
    torch.nn.init.normal_(ref.weight)
    x = torch.randn(9, 16)
    with torch.no_grad():
        _, want_w, want_e = ref(x)
    got_w, got_e = moe.route(opts, ref.weight.detach(), x)
    assert torch.equal(got_e, want_e)
    torch.testing.assert_close(got_w, want_w.float(), atol=1e-6, rtol=1e-6)
    if norm or k == 1 and family == "mixtral":
        torch.testing.assert_close(got_w.sum(-1), torch.ones(9))


def test_mixtral_weights_are_the_softmax_of_the_top_k_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])  # router = identity: x is the logits
    w, e = moe.route(_opts(TOPK_SOFTMAX, 2, True), torch.eye(4), logits)
    assert e.tolist() == [[3, 0]]
    s = 1 / (1 + np.exp(-1.0))  # softmax([3, 2]) = (sigmoid(1), 1 - sigmoid(1))
    torch.testing.assert_close(w, torch.tensor([[s, 1 - s]], dtype=torch.float32))


class _Counting:
    """A weight that counts its matmuls (``quant.linear`` calls a non-tensor weight)."""

    def __init__(self, t: torch.Tensor, calls: list):
        self.t, self.calls = t, calls

    def __call__(self, x: torch.Tensor, bias=None) -> torch.Tensor:
        self.calls.append(x.shape[0])
        return torch.nn.functional.linear(x, self.t, bias)


def test_each_routed_expert_runs_one_matmul_over_all_its_tokens():
    torch.manual_seed(0)
    opts = _opts(SOFTMAX_TOPK, 2, False)
    cfg = ModelConfig("Qwen3MoeForCausalLM", "llama", 10, 16, 8, 1, 2, 2, 8, 64, moe=opts)
    w = {"router": torch.randn(6, 16)}
    calls: list[int] = []
    for e in range(6):
        w[f"expert.{e}.gate_up"] = _Counting(torch.randn(16, 16), calls)
        w[f"expert.{e}.down"] = torch.randn(16, 8)
    x = torch.randn(40, 16)
    got = moe.moe_mlp(cfg, w, x, torch.nn.functional.silu)
    weights, experts = moe.route(opts, w["router"], x)
    want = torch.zeros_like(x)  # the definition, token by token
    for t in range(40):
        for j in range(2):
            e = int(experts[t, j])
            g, u = (x[t] @ w[f"expert.{e}.gate_up"].t.T).chunk(2)
            want[t] += weights[t, j] * (torch.nn.functional.silu(g) * u) @ w[f"expert.{e}.down"].T
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    hit = torch.bincount(experts.flatten(), minlength=6)
    assert sorted(calls) == sorted(int(c) for c in hit if c) and sum(calls) == 80


# ---- quantized GGUF experts -------------------------------------------------------------------


def requantize(src: Path, dst: Path, qtype) -> Path:
    """``src`` with every matrix whose rows are whole blocks stored as ``qtype`` (the stacked
    experts included), metadata as it was."""
    import gguf

    from localgen.models.gguf_tensors import dequantize_tensor

    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), str(r.fields["general.architecture"].contents()))
    for name, f in r.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture":
            sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(name, f.contents(), f.types[0], sub_type=sub)
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    for t in r.tensors:
        data = dequantize_tensor(t).float().numpy().reshape([int(d) for d in reversed(t.shape.tolist())])
        if data.ndim >= 2 and data.shape[-1] % block == 0:
            q = gguf.quants.quantize(data, qtype)
            w.add_tensor(t.name, q, raw_shape=q.shape, raw_dtype=qtype)
        else:
            w.add_tensor(t.name, data.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.mark.parametrize("name", ["mixtral_top2", "qwen3moe_top1"])
def test_quantized_gguf_experts_run_packed_per_expert_slice(name, tmp_path, monkeypatch):
    from gguf import GGMLQuantizationType as Q

    from localgen.quant import gguf_blocks as gb

    path = requantize(FIXTURES / f"{name}.gguf", tmp_path / "q8.gguf", Q.Q8_0)
    monkeypatch.setenv(gb.CPU_KERNEL_ENV, "0")  # the exact packed path: dequantize, then matmul
    runs = {}
    for env in ("1", "0"):
        monkeypatch.setenv("LOCALGEN_GGUF_PACKED", env)
        llm = load(path)
        ps = prompts(4)
        runs[env] = (llm, run_staggered(llm, ps))
    packed_layer = runs["1"][0].engine.model.layers[0]
    assert isinstance(packed_layer["expert.0.gate_up"], gb.PackedGGUFWeight)
    assert isinstance(packed_layer["expert.3.down"], gb.PackedGGUFWeight)
    assert isinstance(runs["0"][0].engine.model.layers[0]["expert.0.down"], torch.Tensor)
    assert runs["1"][1] == runs["0"][1]


def test_gguf_expert_slices_are_the_hf_experts():
    from localgen.models.gguf_source import load_gguf
    from localgen.models.weights import SafetensorsStore

    _, store = load_gguf(FIXTURES / "mixtral_top2.gguf")
    hf = SafetensorsStore(FIXTURES / "mixtral_top2")
    names = [n for n in hf.names() if "experts" in n or "block_sparse_moe.gate" in n]
    assert len(names) == 2 * (4 * 3 + 1)
    for n in names:
        torch.testing.assert_close(store.get(n).float(), hf.get(n).float(), atol=0, rtol=0)


# ---- refusals ---------------------------------------------------------------------------------


def test_the_offload_runtime_refuses_moe_in_one_sentence():
    from localgen.policy import Policy

    pol = Policy(gbs=1, num_gpu_batches=1, wg=0, wc=1, wd=0, cg=0, cc=1, cd=0, hg=0, hc=1).validate()
    with pytest.raises(UnsupportedModelError) as e:
        LLM.load(str(FIXTURES / "mixtral_top1"), device="cpu", kv_cache_memory=1 << 22, policy=pol)
    msg = str(e.value)
    assert msg.startswith("MixtralForCausalLM is a mixture-of-experts model") and "offload" in msg
    assert msg.count(". ") == 0 and "\n" not in msg


def test_a_gpt_oss_gguf_is_refused_in_one_sentence_naming_it(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "oss.gguf"), "gpt-oss")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError) as e:
        resolve_model(tmp_path / "oss.gguf")
    msg = str(e.value)
    assert msg.startswith(f"{tmp_path / 'oss.gguf'}: GGUF architecture 'gpt-oss' is not supported")
    assert "Hugging Face directory" in msg and msg.count(". ") == 0 and "\n" not in msg


def test_moe_settings_without_math_are_refused():
    d = json.loads((FIXTURES / "mixtral_top2" / "config.json").read_text())
    with pytest.raises(UnsupportedModelError, match="num_experts_per_tok = 5 with 4 experts"):
        ModelConfig.from_hf_dict(dict(d, num_experts_per_tok=5))


@pytest.mark.parametrize("truncate", [True, False])
@pytest.mark.parametrize("mscale", [None, (1.0, 0.5)])
def test_yarn_frequencies_and_attention_factor_equal_transformers(truncate, mscale):
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from localgen.models.rope import attention_factor, inv_frequencies

    rp = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=truncate,
              original_max_position_embeddings=4096, rope_theta=150000.0)
    if mscale:
        rp.update(mscale=mscale[0], mscale_all_dim=mscale[1])
    hf = GptOssConfig(head_dim=64, rope_parameters=rp, max_position_embeddings=131072)
    want_inv, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    cfg = ModelConfig.from_hf_dict(hf.to_dict())
    torch.testing.assert_close(inv_frequencies(cfg), want_inv.float(), atol=0, rtol=1e-6)
    assert attention_factor(cfg) == pytest.approx(want_factor, rel=1e-12)
