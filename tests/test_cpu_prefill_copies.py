"""GGUF blocks for decode beside bf16 copies for prefill (``cpu_int4.BlocksWithCopy``,
``LLM.load(prefill_copies=True)``): a product of at most ``max_m`` rows is the blocks' own (the
float32 block path's C kernel) bit for bit, a larger one is torch's bf16 GEMM on the same bf16
matrix the int4 path's large-M products multiply; a model whose every step has at most
``max_m`` rows gives the float32 block path's greedy tokens and logprobs exactly, and a long
prompt's decode steps never read the copies."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from localgen.quant import cpu_int4
from localgen.quant.gguf_blocks import PackedGGUFWeight, Q

Q4_1_BYTES = 20


def random_q4_1(rows: int, cols: int, seed: int = 0) -> PackedGGUFWeight:
    """Random Q4_1 blocks: fp16 d in [0.01, 0.11), fp16 m in about ±0.2, random codes."""
    gen = torch.Generator().manual_seed(seed)
    nb = cols // 32
    raw = torch.randint(0, 256, (rows, nb, Q4_1_BYTES), generator=gen, dtype=torch.uint8)
    d = (torch.rand(rows, nb, generator=gen) * 0.1 + 0.01).half()
    m = (torch.randn(rows, nb, generator=gen) * 0.2).half()
    raw[..., 0:4] = torch.stack([d, m], -1).view(torch.uint8).reshape(rows, nb, 4)
    return PackedGGUFWeight(raw.reshape(rows, nb * Q4_1_BYTES), Q.Q4_1, (rows, cols))


@pytest.mark.parametrize("m", [1, 3, cpu_int4.BLOCKS_MAX_M])
def test_small_m_is_the_blocks_product_and_makes_no_copy(m):
    blocks = random_q4_1(96, 128, seed=m)
    w = cpu_int4.BlocksWithCopy(blocks)
    x, bias = torch.randn(m, 128), torch.randn(96)
    assert torch.equal(w(x, bias), blocks(x, bias))
    assert torch.equal(w(x[None])[0], blocks(x))  # a leading batch dim is flattened as M
    assert w._copy is None  # a decode-only model never holds the bf16 matrix


@pytest.mark.parametrize("m", [cpu_int4.BLOCKS_MAX_M + 1, 40])
def test_large_m_is_the_bf16_gemm_on_the_int4_paths_matrix(m):
    blocks = random_q4_1(96, 128, seed=m)
    w = cpu_int4.BlocksWithCopy(blocks)
    x, bias = torch.randn(m, 128), torch.randn(96)
    # the int4 path's large-M matrix of the same blocks (d q + m in float32, rounded once)
    int4_dense = cpu_int4.q4_1_as_int4(blocks.raw, 96, 128).dense
    assert torch.equal(w.copy, int4_dense)
    want = F.linear(x.bfloat16(), int4_dense).float() + bias
    assert torch.equal(w(x, bias), want)
    exact = x.double() @ blocks.dequantize().double().T
    err = float((w(x).double() - exact).norm() / exact.norm())
    assert err < 1e-2, err  # bf16 rounding of the activations and the weights


def test_with_copies_wraps_only_the_layers_gguf_matrices():
    blocks, dense = random_q4_1(64, 64), torch.randn(64, 64)
    w = {"qkv": blocks, "o": dense, "q_bias": torch.zeros(64), "input_norm": torch.ones(64),
         "down": blocks}
    out = cpu_int4.with_copies(w, max_m=3)
    assert type(out["qkv"]) is cpu_int4.BlocksWithCopy and out["qkv"].blocks is blocks
    assert out["qkv"].max_m == 3 and type(out["down"]) is cpu_int4.BlocksWithCopy
    assert out["o"] is dense and out["q_bias"] is w["q_bias"]
    assert out["input_norm"] is w["input_norm"]


# ---- a whole model -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_q4_1(tmp_path_factory):
    from tests.tiny_models import make_hf_model, write_gguf

    d = tmp_path_factory.mktemp("tiny")
    return write_gguf(d / "tiny-q4_1.gguf", make_hf_model(d, "smollm"), "Q4_1")


def _load(path, copies: bool):
    from localgen.api import LLM

    return LLM.load(str(path), device="cpu", dtype="float32", cpu_int4=False,
                    prefill_copies=copies, kv_cache_memory=1 << 22)


def _greedy(llm, prompt: list[int], n: int = 8, after_prefill=None):
    """Greedy tokens and their logprobs, stepping the engine; ``after_prefill(llm)`` runs after
    the first step (the prompt's prefill)."""
    from localgen.api import Request, SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0)
    llm.add_request(Request(prompt_token_ids=prompt, sampling=sp))
    outs = llm.step()
    if after_prefill is not None:
        after_prefill(llm)
    while llm.has_unfinished():
        outs = llm.step()
    return outs[-1].token_ids, [lp.logprob for lp in outs[-1].logprobs]


def _copied(llm) -> list:
    return [m for w in llm.engine.model.layers for m in w.values()
            if type(m) is cpu_int4.BlocksWithCopy]


def test_short_prompt_gives_the_block_paths_tokens_and_logprobs(tiny_q4_1):
    """A prompt of at most ``BLOCKS_MAX_M`` tokens and one sequence: every product of every step
    reads the blocks, so the tokens and logprobs are the float32 block path's, bit for bit."""
    hybrid, blocks = _load(tiny_q4_1, True), _load(tiny_q4_1, False)
    assert type(hybrid.engine.model.layers[0]["qkv"]) is cpu_int4.BlocksWithCopy
    assert type(blocks.engine.model.layers[0]["qkv"]) is PackedGGUFWeight
    prompt = [5, 9, 30, 41, 7][:cpu_int4.BLOCKS_MAX_M]
    assert _greedy(hybrid, prompt) == _greedy(blocks, prompt)
    assert _copied(hybrid) and all(m._copy is None for m in _copied(hybrid))


def test_long_prompt_prefills_from_the_copies_and_decodes_from_the_blocks(tiny_q4_1):
    """A 40-token prompt prefills through the bf16 copies (its first token's logprob close to
    the block path's); its decode steps read the blocks only: with every copy poisoned to NaN
    after the prefill, the tokens and logprobs are unchanged."""
    prompt = [(7 * i + 3) % 200 + 2 for i in range(40)]
    tokens, lps = _greedy(_load(tiny_q4_1, True), prompt)
    _, ref_lps = _greedy(_load(tiny_q4_1, False), prompt)
    assert abs(lps[0] - ref_lps[0]) < 0.05  # bf16 prefill products against 8-bit activations

    def poison(llm) -> None:
        assert _copied(llm) and all(m._copy is not None for m in _copied(llm))
        for m in _copied(llm):
            m._copy = torch.full_like(m._copy, float("nan"))

    assert _greedy(_load(tiny_q4_1, True), prompt, after_prefill=poison) == (tokens, lps)


def test_decode_steps_past_the_row_limit_take_the_copies(tiny_q4_1, monkeypatch):
    """Two sequences decode together: within ``BLOCKS_DECODE_MAX_M`` rows the layer runs the
    fused decode step on the blocks; past it (the limit set to 1) the op-by-op path, where
    each product dispatches by M."""
    from localgen.api import Request, SamplingParams
    from localgen.models import llama

    calls = []
    real = llama._blocks_products
    monkeypatch.setattr(llama, "_blocks_products", lambda *a: calls.append(1) or real(*a))

    def run(limit: int) -> int:
        monkeypatch.setattr(cpu_int4, "BLOCKS_DECODE_MAX_M", limit)
        calls.clear()
        llm = _load(tiny_q4_1, True)
        sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        llm.generate([Request(prompt_token_ids=p, sampling=sp) for p in ([5, 9], [30, 41])])
        return len(calls)

    assert run(16) > 0 and run(1) == 0


@pytest.mark.parametrize("native", [True, False])
def test_dtype_left_open_with_prefill_copies(tiny_q4_1, monkeypatch, native):
    """``prefill_copies`` with ``dtype`` unset: float32 with copies where the CPU has native bf16
    (before the int4 path), else the choice without copies (float32 blocks here: the int4 path
    needs native bf16 too); a dtype given other than float32 makes no copies."""
    from localgen.api import LLM

    monkeypatch.setattr(cpu_int4, "native_bf16", lambda: native)
    llm = LLM.load(str(tiny_q4_1), device="cpu", kv_cache_memory=1 << 22, prefill_copies=True)
    qkv = llm.engine.model.layers[0]["qkv"]
    assert llm.engine.model.dtype == torch.float32
    assert type(qkv) is (cpu_int4.BlocksWithCopy if native else PackedGGUFWeight)
    bf16 = LLM.load(str(tiny_q4_1), device="cpu", dtype="bfloat16", kv_cache_memory=1 << 22,
                    prefill_copies=True)
    assert not any(type(m) is cpu_int4.BlocksWithCopy for m in bf16.engine.model.layers[0].values())


def test_serve_asks_for_prefill_copies_only_with_dtype_left_open(monkeypatch):
    """``localgen serve`` loads with ``prefill_copies`` when ``--dtype`` is not given; with it,
    the path the dtype names (``--dtype float32``: the float32 block path alone)."""
    import typer
    from typer.testing import CliRunner

    from localgen.api import LLM
    from localgen.cli import serve_cmd

    seen = []

    def fake_load(*a, **kw):
        seen.append(kw)
        raise RuntimeError("stop after the load call")

    monkeypatch.setattr(LLM, "load", staticmethod(fake_load))
    app = typer.Typer()
    app.command()(serve_cmd.serve)
    for args in ([], ["--dtype", "float32"]):
        CliRunner().invoke(app, args)
    assert [kw.get("prefill_copies") for kw in seen] == [True, False]
