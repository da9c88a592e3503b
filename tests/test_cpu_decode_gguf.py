"""The fused CPU decode layer (``llama._cpu_decode_layer``) on GGUF blocks: for float32 and bf16
activations it gives exactly the generic ``layer()``'s output and cache writes (one layer of
random blocks, fused and separate q/k/v), and a whole model decodes the generic path's greedy
tokens with the same logprobs (the embedded model and tiny random-block files in several
types). The C layer ops it calls for float32 rows (rotary + K/V write, residual add + norm)
equal their torch twins bit for bit."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")

sys.path.insert(0, str(Path(__file__).parent))
from test_cpu_decode import BS, _torch_only, decode_meta, paged_cache  # noqa: E402
from test_gguf_packed import FILES, PROMPT, random_blocks, unit_scale, write_random_gguf  # noqa: E402

from localgen.kernels import layer_ops_cpu as ops  # noqa: E402
from localgen.kv.attention import LayerKV  # noqa: E402
from localgen.models import llama  # noqa: E402
from localgen.models.cpu_decode import CpuDecodeLoop  # noqa: E402
from localgen.quant import gguf_blocks as gb  # noqa: E402

Q = gguf.GGMLQuantizationType
needs_kernel = pytest.mark.skipif(not gb.cpu_kernel_serves(Q.Q8_0),
                                  reason="no C compiler for the GGUF kernel")
needs_ops = pytest.mark.skipif(not ops.available(), reason="no C compiler for the layer ops")
DTYPES = [torch.float32, torch.bfloat16]


# ---- the C layer ops on float32 rows ------------------------------------------------------


@needs_ops
@pytest.mark.parametrize("rows,hq,hk,d", [(1, 9, 3, 64), (4, 8, 2, 128), (2, 4, 4, 32)])
def test_rope_store_float32_equals_torch_bit_for_bit(rows, hq, hk, d):
    """float32 rotary embedding in place and the K/V write to shuffled slots, against
    ``apply_rope``'s ``addcmul(x cos, roll(x), signed sin)`` and ``index_copy_``."""
    from localgen.models.rope import apply_rope

    gen = torch.Generator().manual_seed(11 + rows)
    y = torch.randn(rows, (hq + 2 * hk) * d, generator=gen)
    ang = torch.rand(rows, d // 2, generator=gen) * 6.3
    cos, sin = (torch.cat((f(ang), f(ang)), -1) for f in (torch.cos, torch.sin))
    pair = torch.randn(2, 6, BS, hk, d, generator=gen)
    slots = torch.randperm(6 * BS, generator=gen)[:rows]
    want_pair, want_y = pair.clone(), y.clone()
    qk = want_y[:, :(hq + hk) * d].view(rows, hq + hk, d)
    qk.copy_(apply_rope(qk, cos, sin))
    want_pair.view(2, -1, hk, d).index_copy_(
        1, slots, want_y[:, hq * d:].view(rows, 2, hk, d).transpose(0, 1))
    assert ops.supports_rope(y, cos, sin, pair, slots)
    ops.rope_store(y, cos, sin, pair, slots, hq, hk, d)
    assert torch.equal(y, want_y) and torch.equal(pair, want_pair)


@needs_ops
@pytest.mark.parametrize("rows,n", [(1, 576), (3, 100)])
def test_add_rms_norm_float32_equals_add_then_rms_norm(rows, n):
    """The float32 residual add + norm equals the two calls it replaces bit for bit (the same
    C norm; the sum rounds once either way) and the torch expression within float32 rounding."""
    gen = torch.Generator().manual_seed(rows)
    h, delta = (torch.randn(rows, n, generator=gen) * 3 for _ in range(2))
    w = torch.rand(n, generator=gen) + 0.5
    want_h = h + delta
    h_out, y = ops.add_rms_norm(h, delta.clone(), w, 1e-5)
    assert torch.equal(h_out, want_h) and torch.equal(y, ops.rms_norm(want_h, w, 1e-5))
    ref = w * torch.nn.functional.rms_norm(want_h, (n,), eps=1e-5)
    assert torch.allclose(y, ref, rtol=2e-5, atol=1e-6)


# ---- one layer against the generic layer --------------------------------------------------


def _packed(qtype, n: int, k: int, seed: int) -> gb.PackedGGUFWeight:
    raw = random_blocks(qtype, n, k, seed, scale=unit_scale(qtype))
    return gb.PackedGGUFWeight(torch.from_numpy(raw), qtype, (n, k))


def _layer_weights(hidden, heads, kv_heads, d, inter, dtype, fused_qkv: bool) -> dict:
    """A layer of random Q8_0 blocks (Q6_K for v where q/k/v stay apart, as in Q4_K_M files)."""
    w = {"input_norm": (torch.rand(hidden) + 0.5).to(dtype),
         "post_norm": (torch.rand(hidden) + 0.5).to(dtype),
         "o": _packed(Q.Q8_0, hidden, heads * d, 1),
         "gate_up": _packed(Q.Q4_0, 2 * inter, hidden, 2), "down": _packed(Q.Q8_0, hidden, inter, 3)}
    if fused_qkv:
        w["qkv"] = _packed(Q.Q8_0, (heads + 2 * kv_heads) * d, hidden, 4)
    else:
        w |= {"q": _packed(Q.Q8_0, heads * d, hidden, 4), "k": _packed(Q.Q8_0, kv_heads * d, hidden, 5),
              "v": _packed(Q.Q6_K, kv_heads * d, hidden, 6)}
    return w


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_seqs", [1, 3])
@pytest.mark.parametrize("fused_qkv", [True, False])
@pytest.mark.parametrize("c_ops", ["drivers", True, False])
def test_gguf_decode_layer_is_bit_identical_to_layer(dtype, num_seqs, fused_qkv, c_ops, monkeypatch):
    """The fused CPU decode layer over GGUF blocks gives exactly the generic layer's output and
    cache writes, with the C layer ops (float32 rows: through the decode drivers, three C calls
    around attention, q/k/v of mixed types as one segmented matrix; else, or with the drivers
    turned off, one call a step) and with their torch twins; it steps aside for a bias and under
    ``LOCALGEN_GGUF_CPU_KERNEL=0``."""
    from localgen.models.config import ModelConfig
    from localgen.models.rope import inv_frequencies, rope_cos_sin

    if c_ops and not ops.available():
        pytest.skip("no C compiler for the layer ops")
    torch.manual_seed(5)
    hidden, heads, kv_heads, d, inter = 256, 4, 2, 64, 256
    cfg = ModelConfig("LlamaForCausalLM", "llama", 100, hidden, inter, 1, heads, kv_heads, d, 512)
    w = _layer_weights(hidden, heads, kv_heads, d, inter, dtype, fused_qkv)
    lens = [37, 16, 70][:num_seqs]
    perm = torch.randperm(30).tolist()
    tables = [perm[0:3], perm[3:4], perm[4:9]][:num_seqs]
    h = torch.randn(num_seqs, hidden).to(dtype)
    rope = rope_cos_sin(inv_frequencies(cfg), torch.tensor([n - 1 for n in lens]), dtype)
    kv_fast = paged_cache(30, kv_heads, d, dtype)
    ref_pair = kv_fast.pair.clone()
    kv_ref = LayerKV(ref_pair[0], ref_pair[1], ref_pair)
    assert llama._cpu_decode_mats(cfg, w, h, kv_fast) is not None
    calls = []
    driven = c_ops == "drivers" and dtype == torch.float32
    if c_ops == "drivers":
        qkv_call = ops.decode_qkv
        monkeypatch.setattr(llama.cpu_ops, "decode_qkv", lambda *a: calls.append(2) or qkv_call(*a))
    else:
        monkeypatch.setattr(llama, "_drivers_take", lambda *a: False)
    if c_ops:
        store = ops.rope_store
        monkeypatch.setattr(llama.cpu_ops, "rope_store", lambda *a: calls.append(1) or store(*a))
    else:
        _torch_only(monkeypatch)
    h_before = h.clone()
    fast = llama.layer(cfg, w, h, rope, kv_fast, decode_meta(lens, tables))
    assert calls == ([2] if driven else [1] if c_ops else []) and torch.equal(h, h_before)
    with monkeypatch.context() as m:
        m.setattr(llama, "_cpu_decode_mats", lambda *a: None)  # the generic path
        want = llama.layer(cfg, w, h, rope, kv_ref, decode_meta(lens, tables))
    assert fast.dtype == dtype and torch.equal(fast, want) and torch.equal(kv_fast.pair, kv_ref.pair)
    assert llama._cpu_decode_mats(cfg, w | {"o_bias": torch.zeros(hidden, dtype=dtype)}, h,
                                  kv_fast) is None
    monkeypatch.setenv(gb.CPU_KERNEL_ENV, "0")
    assert llama._cpu_decode_mats(cfg, w, h, kv_fast) is None


# ---- whole models: greedy tokens and logprobs ---------------------------------------------


def _counting_loop(taken: list):
    """``CpuDecodeLoop.run`` that adds one to ``taken`` for each layer of a step it runs."""
    real = CpuDecodeLoop.run

    def run(self, cfg, *args):
        out = real(self, cfg, *args)
        taken.extend([1] * cfg.num_layers if out is not None else [])
        return out

    return run


def _greedy(path: Path, dtype: str, fused: bool, monkeypatch, n: int, text: str | None):
    """Greedy tokens and their top-5 logprobs, and how many layer steps took the fused path
    (one layer at a time, or every layer of a step through ``CpuDecodeLoop``)."""
    from localgen.api import LLM, Request, SamplingParams

    taken = []
    real = llama._cpu_decode_layer
    with monkeypatch.context() as m:
        m.setenv("LOCALGEN_GGUF_PACKED", "1")
        if fused:
            m.setattr(llama, "_cpu_decode_layer", lambda *a: taken.append(1) or real(*a))
            m.setattr(CpuDecodeLoop, "run", _counting_loop(taken))
        else:
            m.setattr(llama, "_cpu_decode_mats", lambda *a: None)
        llm = LLM.load(str(path), device="cpu", dtype=dtype, kv_cache_memory=1 << 22)
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=5)
        ids = PROMPT if text is None else llm.tokenizer.encode(text)
        out = llm.generate([Request(prompt_token_ids=ids, sampling=sp)])[0]
    return out.token_ids, out.logprobs, len(taken)


def _assert_same_decoding(path: Path, dtype: str, monkeypatch, n: int, layers: int,
                          text: str | None = None):
    tokens, logprobs, taken = _greedy(path, dtype, True, monkeypatch, n, text)
    want_tokens, want_logprobs, _ = _greedy(path, dtype, False, monkeypatch, n, text)
    assert taken == layers * (n - 1)  # every decode step of every layer ran fused
    assert tokens == want_tokens and len(set(tokens)) > 3  # varied tokens: a real comparison
    assert logprobs == want_logprobs  # the same logits, to the bit


@needs_kernel
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["Q4_K_M", "Q8_0_tied", "Q5_1", "IQ4_XS"])
def test_random_block_model_decodes_as_the_generic_path(tmp_path, kind, dtype, monkeypatch):
    """Tiny Llama GGUFs of random blocks (test_gguf_packed's files; Q4_K_M keeps q/k/v apart)."""
    types, tied = FILES[kind]
    path = write_random_gguf(tmp_path / f"{kind}.gguf", types, tied=tied)
    _assert_same_decoding(path, dtype, monkeypatch, n=16, layers=2)


@needs_kernel
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_embedded_model_decodes_as_the_generic_path(dtype, monkeypatch):
    """The embedded SmolLM2-135M Q4_1 file, 30 layers, 32 greedy tokens."""
    from localgen.models.sources import embedded_gguf_path

    try:
        path = embedded_gguf_path()
    except Exception as e:  # the embedded model's package is missing
        pytest.skip(str(e))
    _assert_same_decoding(path, dtype, monkeypatch, n=32, layers=30,
                          text="The three largest cities of France are")


@needs_kernel
@needs_ops
def test_decode_loop_is_bit_identical_to_the_layer_path(tmp_path, monkeypatch):
    """``CpuDecodeLoop`` (two C calls a layer) against ``llama.layer`` one layer at a time on a
    float32 Q4_K_M file of random blocks: three sequences of different lengths decoding
    together, then two, then one, give the same tokens and logprobs, every decode step through
    the loop (one binding per row count); with a score observer installed the loop steps aside
    for the layer path; after a layer's weight is replaced it multiplies the new one."""
    from localgen.api import LLM, Request, SamplingParams

    path = write_random_gguf(tmp_path / "q4km.gguf", *FILES["Q4_K_M"][:1],
                             tied=FILES["Q4_K_M"][1])
    monkeypatch.setenv("LOCALGEN_GGUF_PACKED", "1")
    llm = LLM.load(str(path), device="cpu", dtype="float32", kv_cache_memory=1 << 22)
    sps = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=5)
           for n in (12, 5, 8)]  # 3, 2, then 1 row a step
    prompts = [PROMPT, PROMPT[:2], PROMPT * 4]

    def run(loop: bool):
        taken = []
        with monkeypatch.context() as m:
            m.setattr(CpuDecodeLoop, "run", _counting_loop(taken) if loop else lambda *a: None)
            outs = llm.generate([Request(prompt_token_ids=p, sampling=sp)
                                 for p, sp in zip(prompts, sps)])
        return [(o.token_ids, o.logprobs) for o in outs], len(taken)

    got, taken = run(True)
    want, _ = run(False)
    assert taken == llm.config.num_layers * 11 and got == want
    assert sorted(k[0] for k in llm.engine.runner.model.cpu_decode._bound) == [1, 2, 3]
    assert len({t for toks, _ in got for t in toks}) > 3  # varied tokens: a real comparison
    llm.engine.runner.observe_scores(lambda *a: None)
    again, taken = run(True)
    assert taken == 0 and again == want
    llm.engine.runner.observe_scores(None)
    layers = llm.engine.runner.model.layers
    layers[0]["down"] = layers[1]["down"]  # a replaced weight: the loop binds the new one
    got, taken = run(True)
    want, _ = run(False)
    assert taken == llm.config.num_layers * 11 and got == want
