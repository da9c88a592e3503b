"""The CPU int4 path: GGUF Q4_1 matrices through torch's int4 kernel equal the dense dequantized
weights, small and large M, and the engine picks it for a Q4_1 GGUF in bf16."""

from __future__ import annotations

import pytest
import torch

from localgen.quant import cpu_int4
from localgen.quant.int4 import Int4Tensor

pytestmark = pytest.mark.skipif(not cpu_int4.available(), reason="torch has no CPU int4 kernel")


def random_q4(n: int, k: int, g: int = 32, seed: int = 0) -> Int4Tensor:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    scale = (torch.rand(n, k // g, generator=gen) * 0.1 + 0.01).half()
    mn = (torch.randn(n, k // g, generator=gen) * 0.2).half()
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    return Int4Tensor(packed, scale, mn, g, 1, (n, k))


def dense(t: Int4Tensor) -> torch.Tensor:
    codes = cpu_int4.unpack_codes(t).double()
    rep = lambda x: x.double().repeat_interleave(t.group_size, dim=1)  # noqa: E731
    return codes * rep(t.scale) + rep(t.min)


@pytest.mark.parametrize("m", [1, 5, 8, 9, 40])
def test_int4_linear_matches_dequantized_weights(m):
    parts = [random_q4(96, 64, seed=1), random_q4(32, 64, seed=2)]  # stacked like q and k
    lin = cpu_int4.Int4Linear.from_int4(parts)
    w = torch.cat([dense(p) for p in parts])
    x = torch.randn(m, 64).bfloat16()
    bias = torch.randn(128).bfloat16()
    y = lin(x, bias)
    ref = x.double() @ w.T + bias.double()
    err = float((y.double() - ref).norm() / ref.norm())
    assert torch.isfinite(y).all() and err < 1e-2, err  # bf16 activations and scales


@pytest.mark.parametrize("variant", ["smollm", "qwen2"])  # qwen2: q/k/v biases beside packed qkv
def test_engine_uses_int4_for_a_q4_1_gguf(tmp_path, variant):
    from localgen.api import LLM, Request, SamplingParams
    from tests.tiny_models import make_hf_model, write_gguf

    d = make_hf_model(tmp_path, variant)
    path = write_gguf(tmp_path / "tiny-q4_1.gguf", d, "Q4_1")
    fast = LLM.load(str(path), device="cpu", dtype="bfloat16", kv_cache_memory=1 << 22)
    assert isinstance(fast.engine.model.layers[0]["qkv"], cpu_int4.Int4Linear)
    assert ("qkv_bias" in fast.engine.model.layers[0]) == (variant == "qwen2")
    exact = LLM.load(str(path), device="cpu", dtype="float32", kv_cache_memory=1 << 22)
    assert not isinstance(exact.engine.model.layers[0]["qkv"], cpu_int4.Int4Linear)  # float path
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    a = fast.generate([Request(prompt_token_ids=[5, 9, 30, 41], sampling=sp)])[0]
    b = exact.generate([Request(prompt_token_ids=[5, 9, 30, 41], sampling=sp)])[0]
    assert a.completion_tokens == b.completion_tokens == 6
    # same weights, bf16 vs fp32 activations: the first logits agree closely
    ids = torch.tensor([5, 9, 30, 41])
    for llm in (fast, exact):
        llm.add_request(Request(prompt_token_ids=ids.tolist(), sampling=sp))
    lf = fast.engine.runner.run(fast.engine.scheduler.schedule().seqs, True)[0]
    le = exact.engine.runner.run(exact.engine.scheduler.schedule().seqs, True)[0]
    assert float((lf - le).norm() / le.norm()) < 5e-2


def test_dtype_left_open_takes_int4_unless_the_caller_opts_out(tmp_path, monkeypatch):
    """A Q4_1 GGUF with ``dtype`` unset takes the int4 path where the CPU has native bf16, and the
    float32 block path when ``cpu_int4=False`` (what ``generate`` and ``chat`` ask)."""
    from localgen.api import LLM
    from tests.tiny_models import make_hf_model, write_gguf

    monkeypatch.setattr(cpu_int4, "native_bf16", lambda: True)
    path = write_gguf(tmp_path / "tiny-q4_1.gguf", make_hf_model(tmp_path, "smollm"), "Q4_1")
    default = LLM.load(str(path), device="cpu", kv_cache_memory=1 << 22)
    lean = LLM.load(str(path), device="cpu", kv_cache_memory=1 << 22, cpu_int4=False)
    assert isinstance(default.engine.model.layers[0]["qkv"], cpu_int4.Int4Linear)
    assert default.engine.model.dtype == torch.bfloat16
    assert not isinstance(lean.engine.model.layers[0]["qkv"], cpu_int4.Int4Linear)
    assert lean.engine.model.dtype == torch.float32
