"""The CPU forward path's pieces against their references: the 8-bit output matrix as two 4-bit
planes, decode and prefill attention over the paged cache, the three-kernel rotary embedding, the
float32-statistics RMSNorm, and the decode bench's peer ratios and llama.cpp batch runner."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from localgen.attention import cpu as cpu_decode
from localgen.attention.cpu import CpuBackend, CpuDecodePlan, CpuKernelBackend
from localgen.attention.prefill import cpu_prefill_attention
from localgen.attention.spec import AttentionSpec
from localgen.kernels import paged_attention_ref as ref
from localgen.kv.attention import AttentionMetadata, LayerKV
from localgen.quant import cpu_int4

BS = 16


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    return float((out.double() - want.double()).norm() / want.double().norm())


@pytest.mark.skipif(not cpu_int4.available(), reason="torch has no CPU int4 kernel")
@pytest.mark.parametrize("m", [1, 3, 4, 5, 16])  # int4 planes up to LM_HEAD_MAX_M, dense above
def test_q8_0_as_two_int4_planes_matches_dequantized(m):
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize, quantize

    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(96, 128, generator=gen) * 0.3).numpy()
    raw = quantize(w, Q.Q8_0)
    want = torch.from_numpy(np.asarray(dequantize(raw, Q.Q8_0), dtype=np.float32)).reshape(96, 128)
    lin = cpu_int4.q8_0_as_int4(raw, 96, 128, max_m=cpu_int4.LM_HEAD_MAX_M)
    assert torch.equal(lin.dense.float(), want.bfloat16().float())  # the large-M matrix
    x = torch.randn(m, 128, generator=gen).bfloat16()
    y = lin(x)
    assert y.shape == (m, 96) and rel_err(y, x.double() @ want.double().T) < 1e-2


def paged_cache(num_blocks: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> LayerKV:
    pair = torch.randn(2, num_blocks, BS, kv_heads, head_dim).to(dtype)
    return LayerKV(pair[0], pair[1], pair)


def decode_meta(lens: list[int], tables: list[list[int]]) -> AttentionMetadata:
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    slots = torch.tensor([t[(n - 1) // BS] * BS + (n - 1) % BS for t, n in zip(tables, lens)])
    return AttentionMetadata(False, slots, bt, torch.tensor(lens), [1] * len(lens), lens)


@pytest.fixture(params=["kernel", "torch"])
def decode_path(request):
    """Runs a test through the C kernel backend (skipped where it cannot be built) and the torch
    CPU backend."""
    if request.param == "kernel":
        if not cpu_decode.kernel.available():
            pytest.skip("no C compiler: the CPU decode kernel is not built")
        return CpuKernelBackend()
    return CpuBackend()


def cpu_decode_attention(backend, q, kv, meta, scale):
    """Decode attention through ``backend`` (the new K/V already in the cache)."""
    return backend.decode(kv, q, None, None, meta, AttentionSpec(scale))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["one_consecutive", "one_shuffled", "three_lengths", "pair_less"])
def test_cpu_decode_attention_matches_reference(dtype, case, decode_path):
    torch.manual_seed(1)
    heads, kv_heads, d = 9, 3, 64
    kv = paged_cache(40, kv_heads, d, dtype)
    if case == "one_consecutive":
        lens, tables = [37], [[5, 6, 7]]
    elif case == "one_shuffled":
        lens, tables = [37], [[9, 2, 30]]
    else:
        lens = [37, 5, 64]
        perm = torch.randperm(40).tolist()
        tables = [perm[0:3], perm[3:4], perm[4:8]]
    if case == "pair_less":
        kv = LayerKV(kv.k_cache, kv.v_cache)
    meta = decode_meta(lens, tables)
    q = torch.randn(len(lens), heads, d).to(dtype)
    out = cpu_decode_attention(decode_path, q, kv, meta, d ** -0.5)
    want = ref.paged_decode_attention(q.double(), kv.k_cache.double(), kv.v_cache.double(),
                                      meta.block_tables, meta.context_lens, d ** -0.5)
    assert out.dtype == dtype and rel_err(out, want) < (1e-5 if dtype == torch.float32 else 1e-2)
    planned = lambda kind: meta.plan(kind, lambda: pytest.fail(f"no {kind.__name__} planned"))  # noqa: E731
    if isinstance(decode_path, CpuKernelBackend) and cpu_decode.kernel.supports(q, kv.k_cache, kv.v_cache):
        assert isinstance(planned(cpu_decode.kernel.Launch), cpu_decode.kernel.Launch)
    else:
        assert planned(CpuDecodePlan).n_blocks == -(-max(lens) // BS)
        assert (planned(CpuDecodePlan).mask is None) == (len(set(lens)) == 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens", [[48], [17, 80, 33, 1], [64, 64]])
def test_cpu_decode_attention_strided_query_and_reversed_tables(dtype, lens, decode_path):
    """Queries as a strided view (the q part of a fused q/k/v output, as the CPU decode layer
    passes them), block tables running backwards or shuffled, lengths on and off block
    boundaries, against a float64 reference."""
    torch.manual_seed(4)
    heads, kv_heads, d = 9, 3, 64
    kv = paged_cache(60, kv_heads, d, dtype)
    need = [-(-n // BS) for n in lens]
    perm = torch.randperm(60).tolist()
    tables, at = [], 0
    for i, k in enumerate(need):  # the first sequence's blocks consecutive but backwards
        tables.append(list(range(at + k - 1, at - 1, -1)) if i == 0 else perm[at:at + k])
        at += k
    meta = decode_meta(lens, tables)
    y = torch.randn(len(lens), (heads + 2 * kv_heads) * d).to(dtype)
    q = y[:, :heads * d].view(len(lens), heads, d)
    out = cpu_decode_attention(decode_path, q, kv, meta, d ** -0.5)
    want = ref.paged_decode_attention(q.double(), kv.k_cache.double(), kv.v_cache.double(),
                                      meta.block_tables, meta.context_lens, d ** -0.5)
    assert out.shape == (len(lens), heads, d)
    assert rel_err(out, want) < (1e-5 if dtype == torch.float32 else 1e-2)


def _torch_only(monkeypatch) -> None:
    """The layer ops' torch twins instead of the C library."""
    from localgen.models import llama

    monkeypatch.setattr(llama.cpu_ops, "supports_rope", lambda *a: False)
    monkeypatch.setattr(llama.cpu_ops, "supports_norm", lambda *a: False)


@pytest.mark.skipif(not cpu_int4.available(), reason="torch has no CPU int4 kernel")
@pytest.mark.parametrize("num_seqs", [1, 3])
@pytest.mark.parametrize("c_ops", [True, False])
def test_cpu_decode_layer_is_bit_identical_to_layer(num_seqs, c_ops, monkeypatch):
    """The CPU decode fast path of a bf16 int4 llama layer gives exactly the generic layer's
    output and cache writes, with the C layer ops (norms, rotary + K/V write, residual add; the
    generic layer then takes the C norm too) and with their torch twins, and steps aside when a
    score observer is installed. test_cpu_kernels checks the C ops against torch alone."""
    from localgen.kernels import layer_ops_cpu
    from localgen.models import llama
    from localgen.models.config import ModelConfig
    from localgen.models.rope import inv_frequencies, rope_cos_sin

    torch.manual_seed(5)
    hidden, heads, kv_heads, d, inter = 128, 4, 2, 32, 192
    cfg = ModelConfig("LlamaForCausalLM", "llama", 100, hidden, inter, 1, heads, kv_heads, d, 512)

    def int4(n, k):
        g = 32
        return cpu_int4.Int4Linear(torch.randint(0, 16, (n, k), dtype=torch.int32),
                                   torch.rand(n, k // g) * 0.02, torch.randn(n, k // g) * 0.05, g)

    w = {"input_norm": (torch.rand(hidden) + 0.5).bfloat16(),
         "post_norm": (torch.rand(hidden) + 0.5).bfloat16(),
         "qkv": int4((heads + 2 * kv_heads) * d, hidden), "o": int4(hidden, heads * d),
         "gate_up": int4(2 * inter, hidden), "down": int4(hidden, inter)}
    lens = [37, 16, 70][:num_seqs]
    perm = torch.randperm(30).tolist()
    tables = [perm[0:3], perm[3:4], perm[4:9]][:num_seqs]
    h = torch.randn(num_seqs, hidden).bfloat16()
    pos = torch.tensor([n - 1 for n in lens])
    rope = rope_cos_sin(inv_frequencies(cfg), pos, torch.bfloat16)
    kv_fast = paged_cache(30, kv_heads, d, torch.bfloat16)
    ref_pair = kv_fast.pair.clone()
    kv_ref = LayerKV(ref_pair[0], ref_pair[1], ref_pair)
    assert llama._cpu_decode_mats(cfg, w, h, kv_fast) is not None
    calls = []
    if c_ops:
        if not layer_ops_cpu.available():
            pytest.skip("no C compiler for the layer ops")
        store = layer_ops_cpu.rope_store
        monkeypatch.setattr(llama.cpu_ops, "rope_store", lambda *a: calls.append(1) or store(*a))
    else:
        _torch_only(monkeypatch)
    h_before = h.clone()
    fast = llama.layer(cfg, w, h, rope, kv_fast, decode_meta(lens, tables))
    assert len(calls) == int(c_ops) and torch.equal(h, h_before)  # the input is left alone
    with monkeypatch.context() as m:
        m.setattr(llama, "_cpu_decode_mats", lambda *a: None)  # the generic path
        want = llama.layer(cfg, w, h, rope, kv_ref, decode_meta(lens, tables))
    assert torch.equal(fast, want) and torch.equal(kv_fast.pair, kv_ref.pair)
    kv_fast.backend = CpuKernelBackend(observer=lambda *a: None)  # scores observed: generic path
    assert llama._cpu_decode_mats(cfg, w, h, kv_fast) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_prefill_attention_matches_reference(dtype):
    """Two fresh prompts of one length longer than a query chunk (batched, chunked calls), a
    fresh one of another length, and one whose first 32 tokens are a cached prefix (gathered
    from the cache, offset mask)."""
    torch.manual_seed(2)
    heads, kv_heads, d = 9, 3, 64
    kv = paged_cache(40, kv_heads, d, dtype)
    ctx, ql = [150, 150, 7, 45], [150, 150, 7, 13]
    perm = torch.randperm(40).tolist()
    tables = [perm[0:10], perm[10:20], perm[20:21], perm[21:24]]
    slots = [t[p // BS] * BS + p % BS for t, c, n in zip(tables, ctx, ql) for p in range(c - n, c)]
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(True, torch.tensor(slots),
                             torch.tensor([t + [0] * (width - len(t)) for t in tables]),
                             torch.tensor(ctx), ql, ctx)
    n = sum(ql)
    q = torch.randn(n, heads, d).to(dtype)
    k, v = torch.randn(n, kv_heads, d).to(dtype), torch.randn(n, kv_heads, d).to(dtype)
    ref.write_kv(kv.k_cache, kv.v_cache, k, v, meta.slot_mapping)  # as the backend does first
    out = cpu_prefill_attention(q, k, v, kv, meta, d ** -0.5)
    want = ref.paged_prefill_attention(q.double(), kv.k_cache.double(), kv.v_cache.double(),
                                       meta.block_tables, ctx, ql, d ** -0.5)
    assert out.dtype == dtype and rel_err(out, want) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_rope_and_rms_norm_match_their_definitions():
    from localgen.models.llama import rms_norm
    from localgen.models.rope import apply_rope

    torch.manual_seed(3)
    x = torch.randn(5, 12, 64, dtype=torch.float64)
    ang = torch.rand(5, 32, dtype=torch.float64) * 6
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    rotated = torch.cat((-x[..., 32:], x[..., :32]), -1)
    want = x * cos[:, None] + rotated * sin[:, None]  # Hugging Face's rotate_half form
    assert torch.allclose(apply_rope(x, cos, sin), want, atol=1e-12)
    h, w = torch.randn(4, 576), torch.randn(576)
    want = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5))
    assert torch.allclose(rms_norm(h, w, 1e-5), want, rtol=1e-5, atol=1e-6)


def test_peer_ratios_name_decode_prefill_and_throughput():
    from localgen.bench.decode_bench import DecodeRun, format_ratios, peer_ratios

    def run(engine, batch, tps, dec, pre):
        return DecodeRun(engine, batch, 8, 4, 1.0, tps, dec, 100.0, 0.1, None, None, pre)

    runs = [run("localgen", 1, 40.0, 80.0, 900.0), run("transformers", 1, 20.0, 10.0, 600.0),
            run("llama.cpp", 1, 30.0, 100.0, 300.0), run("localgen", 16, 160.0, 300.0, 1000.0),
            run("llama.cpp", 16, 80.0, 100.0, None)]
    r = peer_ratios(runs)
    assert r["transformers"]["1"] == {"decode": 8.0, "prefill": 1.5, "throughput": 2.0}
    assert r["llama.cpp"]["1"]["decode"] == 0.8 and r["llama.cpp"]["16"]["prefill"] is None
    assert r["llama.cpp"]["16"]["throughput"] == 2.0 and "16" not in r["transformers"]
    assert any("batch 16" in line and "2.00x" in line for line in format_ratios(r))


def test_llama_cpp_batch_matches_one_sequence_at_a_time():
    """Several sequence ids in one llama.cpp batch give each prompt the tokens it gets alone."""
    pytest.importorskip("llama_cpp")
    from localgen.bench.decode_bench import prompts, run_llama_cpp_batch
    from localgen.models.sources import embedded_gguf_path

    try:
        path = str(embedded_gguf_path())
    except Exception as e:
        pytest.skip(f"embedded model unavailable: {e}")
    together: list[list[int]] = []
    wall, dec, pre = run_llama_cpp_batch(path, 3, 24, 5, 49152, 1, out_tokens=together)
    assert wall > pre > 0 and dec > 0 and len(together) == 3
    for i in range(3):
        alone: list[list[int]] = []
        run_llama_cpp_batch(path, 1, 24, 5, 49152, 1, out_tokens=alone,
                            prompt_ids=[prompts(3, 24, 49152)[i]])
        assert alone[0] == together[i]
