"""Rotated 4-bit KV (QuaRot) and the recent-block pool of ``localgen.runtime.offload.kv``:
the rotation changes nothing without quantization and shrinks the 4-bit error on outlier
channels; each query reads its own block in full precision, in prefill as in decode."""

from __future__ import annotations

import pytest  # noqa: E402
import torch  # noqa: E402

from localgen.kernels.quant_ref import dequantize_int4, quantize_int4  # noqa: E402
from localgen.attention.spec import AttentionSpec  # noqa: E402
from localgen.kv.attention import AttentionMetadata  # noqa: E402
from localgen.models.config import ModelConfig  # noqa: E402
from localgen.runtime.offload import kv as offload_kv  # noqa: E402
from localgen.runtime.offload.kv import TieredKVCache, kv_rotation  # noqa: E402
from localgen.runtime.offload.timers import Timers  # noqa: E402
from tests.conftest import KERNEL_DEVICE  # noqa: E402
from tests.tiny_models import make_config  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture(params=["reference", "kernels"])
def int4_path(request, monkeypatch):
    """Run a test over the torch reference path and over the Triton kernels (quantize-and-write,
    int4 paged decode reading the own block from the pool) that a CUDA cache takes."""
    if request.param == "kernels":
        pytest.importorskip("triton")
        if KERNEL_DEVICE.type == "cuda":  # CPU tensors cannot reach compiled kernels
            pytest.skip("drives the CUDA route with CPU tensors under the interpreter; compiled, "
                        "test_cuda_gather_and_cpu_delegation_paths_agree covers it")
        monkeypatch.setattr(offload_kv, "INT4_KERNEL_DEVICES", ("cuda", "cpu"))
    return request.param


def config(head_dim: int) -> ModelConfig:
    """4 query heads, 2 KV heads of ``head_dim`` (GQA), 2 layers."""
    return ModelConfig.from_hf_dict({**make_config("llama3").to_dict(), "head_dim": head_dim})


def layer(cfg, compress=True, num_blocks=16, block_size=4, **kw):
    return TieredKVCache(cfg, num_blocks, block_size, torch.float32, CPU, ["cpu"] * cfg.num_layers,
                         compress, False, None, Timers(CPU), **kw).views[0]


def qkv(cfg, n, seed=0, outliers=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, cfg.num_heads, cfg.head_dim, generator=g)
    k = torch.randn(n, cfg.num_kv_heads, cfg.head_dim, generator=g)
    v = torch.randn(n, cfg.num_kv_heads, cfg.head_dim, generator=g)
    if outliers:  # post-RoPE keys: a few channels with a large, nearly constant magnitude
        k[..., 3] += 12.0
        k[..., 37] -= 9.0
        q[..., 3] *= 0.2  # queries small there, as in real models; the outliers only stretch the range
    return q, k, v


def prefill_meta(slots, table, n):
    return AttentionMetadata(True, slots, table, torch.tensor([n]), [n], [n])


def slots_of(table, n, bs):
    return torch.tensor([int(table[0, p // bs]) * bs + p % bs for p in range(n)])


def exact(q, k, v, scale):
    """Causal fp attention of one sequence, ``[n, heads, d]``."""
    rep = q.shape[1] // k.shape[1]
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(rep, 1).transpose(0, 1),
        v.repeat_interleave(rep, 1).transpose(0, 1), is_causal=True, scale=scale).transpose(0, 1)


@pytest.mark.parametrize("d", [16, 64, 80, 96, 128])
def test_rotation_is_orthogonal(d):
    r = kv_rotation(d)
    torch.testing.assert_close(r @ r.T, torch.eye(d, dtype=torch.float64), atol=1e-12, rtol=0)
    if d & (d - 1) == 0:  # Hadamard: every entry +-1/sqrt(d), an outlier spreads over all channels
        torch.testing.assert_close(r.abs(), torch.full((d, d), d ** -0.5, dtype=torch.float64))
    assert torch.equal(kv_rotation(d), r)  # fixed: written and read with the same matrix


@pytest.mark.parametrize("d", [64, 80])
def test_rotation_alone_is_exact(d):
    """Uncompressed K/V stored rotated: attention equals plain attention within fp32 rounding
    (scores (qR)(kR)^T = qk^T; output (P VR) R^T = PV), in prefill and in decode."""
    cfg = config(d)
    q, k, v = qkv(cfg, 9, outliers=True)
    bs, table = 4, torch.tensor([[3, 0, 6]])
    slots, scale = slots_of(table, 9, bs), d ** -0.5
    rot = layer(cfg, compress=False, rotate=True)
    assert rot.rot is not None and not rot.compress
    out = rot.attend(q[:8], k[:8], v[:8], prefill_meta(slots[:8], table, 8), AttentionSpec(scale))
    step = rot.attend(q[8:], k[8:], v[8:], AttentionMetadata(False, slots[8:], table, torch.tensor([9]),
                                                             [1], [9]), AttentionSpec(scale))
    want = exact(q, k, v, scale)
    torch.testing.assert_close(torch.cat([out, step]), want, atol=2e-5, rtol=1e-5)
    stored = rot.t["k"].view(-1, cfg.num_kv_heads, d)[slots]
    assert not torch.allclose(stored, k, atol=1e-3)  # really stored in the rotated basis


@pytest.mark.parametrize("d", [64, 80])
def test_rotation_shrinks_4bit_error_on_outlier_channels(d):
    """With outlier key channels, 4-bit attention over the rotated cache is closer to exact fp
    attention than over the plain one (recent-block pool off, so every key is 4-bit)."""
    cfg = config(d)
    n, scale = 40, d ** -0.5
    q, k, v = qkv(cfg, n, seed=1, outliers=True)
    table = torch.arange(10)[None]
    slots = slots_of(table, n, 4)
    want = exact(q, k, v, scale)
    err = {}
    for rotate in (False, True):
        kv = layer(cfg, rotate=rotate, recent_blocks=0)
        out = kv.attend(q, k, v, prefill_meta(slots, table, n), AttentionSpec(scale))
        err[rotate] = float((out - want).norm() / want.norm())
    assert err[True] < 0.7 * err[False], err  # V has no outliers: its error stays, hence 0.7
    # the same for the keys themselves: quantizing kR loses far less than quantizing k
    r = kv_rotation(d).float()
    plain = dequantize_int4(*quantize_int4(k, 64, -1), 64, -1)
    rotated = dequantize_int4(*quantize_int4(k @ r, 64, -1), 64, -1) @ r.T
    assert (rotated - k).norm() < 0.5 * (plain - k).norm()


def test_rotated_greedy_tokens_equal_plain(tmp_path):
    """A tiny model with every layer's (uncompressed) cache stored rotated gives the plain path's
    greedy tokens."""
    from localgen.api import LLM, SamplingParams
    from localgen.policy import Policy
    from tests.test_engine_vs_hf import run_staggered
    from tests.tiny_models import make_hf_model

    d = make_hf_model(tmp_path, "llama3")
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(6, 300, (n,), generator=g).tolist() for n in (5, 19, 11)]
    plain = LLM.load(str(d), device="cpu", kv_cache_memory=1 << 22, block_size=4, max_num_seqs=4)
    want = run_staggered(plain, prompts, sp)
    pol = Policy(cg=0, cc=1, gbs=3, num_gpu_batches=1).validate()  # CPU tier: tiered layer views
    llm = LLM.load(str(d), device="cpu", kv_cache_memory=1 << 22, block_size=4, policy=pol)
    for view in llm.engine.runner.kv.views:
        view.set_rotation(kv_rotation(llm.config.head_dim))
    assert run_staggered(llm, prompts, sp) == want


def reference_recent(q, k, v, scale, bs, rot):
    """Each query: fp keys/values of its own block up to itself, 4-bit (rotated) before it."""
    kr, vr, qr = k @ rot, v @ rot, q @ rot
    kq = dequantize_int4(*quantize_int4(kr, 64, -1), 64, -1)
    vq = dequantize_int4(*quantize_int4(vr, 64, -1), 64, -1)
    rep, outs = q.shape[1] // k.shape[1], []
    for p in range(q.shape[0]):
        own = (p // bs) * bs
        kk = torch.cat([kq[:own], kr[own:p + 1]]).repeat_interleave(rep, 1)
        vv = torch.cat([vq[:own], vr[own:p + 1]]).repeat_interleave(rep, 1)
        w = (torch.einsum("hd,mhd->hm", qr[p], kk) * scale).softmax(-1)
        outs.append(torch.einsum("hm,mhd->hd", w, vv) @ rot.T)
    return torch.stack(outs)


def test_recent_block_prefill_equals_decode_and_reference(int4_path):
    """With the pool, one prefill, a chunked prefill and token-by-token decode all give the
    reference: own block fp, earlier blocks 4-bit."""
    cfg = config(64)
    n, bs, scale = 11, 4, 0.125
    q, k, v = qkv(cfg, n, seed=2, outliers=True)
    table = torch.tensor([[5, 2, 7, 9]])
    slots = slots_of(table, n, bs)
    want = reference_recent(q, k, v, scale, bs, kv_rotation(64).float())
    one = layer(cfg).attend(q, k, v, prefill_meta(slots, table, n), AttentionSpec(scale))
    torch.testing.assert_close(one, want, atol=1e-5, rtol=1e-5)
    kv = layer(cfg)
    outs = [kv.attend(q[p:p + 1], k[p:p + 1], v[p:p + 1],
                      AttentionMetadata(p == 0, slots[p:p + 1], table, torch.tensor([p + 1]), [1], [p + 1]),
                      AttentionSpec(scale)) for p in range(n)]
    torch.testing.assert_close(torch.cat(outs), want, atol=1e-5, rtol=1e-5)
    kv = layer(cfg)
    a = kv.attend(q[:6], k[:6], v[:6], prefill_meta(slots[:6], table, 6), AttentionSpec(scale))  # ends mid-block
    b = kv.attend(q[6:], k[6:], v[6:], AttentionMetadata(True, slots[6:], table, torch.tensor([n]), [5], [n]),
                  AttentionSpec(scale))
    torch.testing.assert_close(torch.cat([a, b]), want, atol=1e-5, rtol=1e-5)
    # and it matters: without the pool the same prefill is further from exact attention
    fp = exact(q, k, v, scale)
    off = layer(cfg, recent_blocks=0).attend(q, k, v, prefill_meta(slots, table, n), AttentionSpec(scale))
    assert (one - fp).norm() < 0.7 * (off - fp).norm()


def test_batched_fresh_prefill_equals_the_reference():
    """Whole prompts prefilled together (runs of equal length in one masked attention call: 7, 7,
    then 5, then 9 tokens, shuffled block tables) give each prompt's own reference."""
    cfg = config(64)
    bs, scale = 4, 0.125
    lens = (7, 7, 5, 9)
    tables = torch.tensor([[9, 2, 14], [0, 11, 3], [6, 1, 8], [4, 13, 7]])
    data = [qkv(cfg, n, seed=60 + i, outliers=True) for i, n in enumerate(lens)]
    q, k, v = (torch.cat(x) for x in zip(*data))
    slots = torch.cat([slots_of(tables[i:i + 1], n, bs) for i, n in enumerate(lens)])
    out = layer(cfg).attend(q, k, v, AttentionMetadata(True, slots, tables, torch.tensor(lens),
                                                       list(lens), list(lens)), AttentionSpec(scale))
    rot, start = kv_rotation(64).float(), 0
    for (qi, ki, vi), n in zip(data, lens):
        torch.testing.assert_close(out[start:start + n], reference_recent(qi, ki, vi, scale, bs, rot),
                                   atol=1e-5, rtol=1e-5)
        start += n


def test_recent_pool_batched_decode_and_eviction(int4_path):
    """Batched decode of sequences of different lengths equals decoding each alone; with a pool of
    one block, the evicted sequence falls back to its 4-bit values (still the 4-bit reference)."""
    cfg = config(64)
    bs, scale = 4, 0.125
    lens = (6, 3, 9)
    tables = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8]])
    data = [qkv(cfg, n + 1, seed=10 + i, outliers=True) for i, n in enumerate(lens)]

    def run(recent, batched):
        kv = layer(cfg, recent_blocks=recent)
        for i, n in enumerate(lens):  # prefill each prompt alone
            q, k, v = (x[:n] for x in data[i])
            kv.attend(q, k, v, prefill_meta(slots_of(tables[i:i + 1], n, bs), tables[i:i + 1], n), AttentionSpec(scale))
        q, k, v = (torch.cat([x[i][n:n + 1] for i, n in enumerate(lens)]) for x in zip(*data))
        slots = torch.tensor([int(tables[i, n // bs]) * bs + n % bs for i, n in enumerate(lens)])
        ctx = [n + 1 for n in lens]
        if batched:
            return kv.attend(q, k, v, AttentionMetadata(False, slots, tables, torch.tensor(ctx), [1] * 3, ctx),
                             AttentionSpec(scale)), kv
        outs = [kv.attend(q[i:i + 1], k[i:i + 1], v[i:i + 1],
                          AttentionMetadata(False, slots[i:i + 1], tables[i:i + 1], torch.tensor([ctx[i]]),
                                            [1], [ctx[i]]), AttentionSpec(scale)) for i in range(3)]
        return torch.cat(outs), kv

    batched, kv = run(8, True)
    torch.testing.assert_close(batched, run(8, False)[0], atol=1e-5, rtol=1e-5)
    rot = kv_rotation(64).float()
    for i, n in enumerate(lens):
        q, k, v = data[i]
        torch.testing.assert_close(batched[i], reference_recent(q, k, v, scale, bs, rot)[n], atol=1e-5, rtol=1e-5)
    assert len(kv.pool_rows) == 3 and kv.pool_k.shape[0] == 8 + 1  # + the scratch row
    small, kv1 = run(1, True)  # one pool row: only the last prefilled sequence kept its tail
    assert len(kv1.pool_rows) == 1 and kv1.pool_k.shape[0] == 1 + 1
    torch.testing.assert_close(small[2], batched[2], atol=1e-5, rtol=1e-5)  # sequence 2 kept its pool row
    q, k, v = data[0]  # sequence 0: own block slots before this step read 4-bit
    n = lens[0]
    kr, vr, qr = k @ rot, v @ rot, q @ rot
    kq = dequantize_int4(*quantize_int4(kr, 64, -1), 64, -1)
    vq = dequantize_int4(*quantize_int4(vr, 64, -1), 64, -1)
    kk = torch.cat([kq[:n], kr[n:]]).repeat_interleave(2, 1)
    vv = torch.cat([vq[:n], vr[n:]]).repeat_interleave(2, 1)
    w = (torch.einsum("hd,mhd->hm", qr[n], kk) * scale).softmax(-1)
    torch.testing.assert_close(small[0], torch.einsum("hm,mhd->hd", w, vv) @ rot.T, atol=1e-5, rtol=1e-5)


def test_pool_memory_is_counted():
    """The pools (full capacity) are part of the cache's bytes; a disk layer's pool is host memory."""
    cfg = config(64)
    args = (cfg, 16, 4, torch.float32, CPU)
    a = TieredKVCache(*args, ["cpu"] * 2, True, False, None, Timers(CPU), recent_blocks=5)
    b = TieredKVCache(*args, ["cpu"] * 2, True, False, None, Timers(CPU), recent_blocks=0)
    per = (5 + 1) * 4 * cfg.num_kv_heads * 64 * 2 * 4  # + the scratch row
    assert a.nbytes - b.nbytes == 2 * per and a.bytes_on("cpu") - b.bytes_on("cpu") == 2 * per
    assert a.views[0].recent_blocks == 5 and b.views[0].recent_blocks == 0
    plain = TieredKVCache(*args, ["cpu"] * 2, False, False, None, Timers(CPU), recent_blocks=5)
    assert plain.pool_bytes == 0 and plain.views[0].rot is None  # both only with compression


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_gather_and_cpu_delegation_paths_agree():
    """On a GPU: the cache on the GPU tier, gathered from the CPU tier, and decode delegated to the
    CPU (``cpu_cache_compute``) give the same results, and match the CPU reference."""
    cfg = config(64)
    bs, scale, dev = 4, 0.125, torch.device("cuda")
    lens = (6, 3, 9)
    tables = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8]])
    data = [qkv(cfg, n + 2, seed=20 + i, outliers=True) for i, n in enumerate(lens)]

    def run(tier, cpu_compute):
        kv = TieredKVCache(cfg, 16, bs, torch.float32, dev, [tier] * 2, True, cpu_compute, None,
                           Timers(dev)).views[0]
        outs = []
        for i, n in enumerate(lens):
            q, k, v = (x[:n].to(dev) for x in data[i])
            outs.append(kv.attend(q, k, v, prefill_meta(slots_of(tables[i:i + 1], n, bs).to(dev),
                                                        tables[i:i + 1].to(dev), n), AttentionSpec(scale)))
        for step in range(2):
            q, k, v = (torch.cat([x[i][n + step:n + step + 1] for i, n in enumerate(lens)]).to(dev)
                       for x in zip(*data))
            p = [n + step for n in lens]
            slots = torch.tensor([int(tables[i, x // bs]) * bs + x % bs for i, x in enumerate(p)], device=dev)
            ctx = [x + 1 for x in p]
            outs.append(kv.attend(q, k, v, AttentionMetadata(False, slots, tables.to(dev),
                                                             torch.tensor(ctx, device=dev), [1] * 3, ctx), AttentionSpec(scale)))
        assert all(o.device.type == "cuda" for o in outs)
        return [o.cpu() for o in outs]

    gpu, gathered, delegated = run("gpu", False), run("cpu", False), run("cpu", True)
    for a, b, c in zip(gpu, gathered, delegated):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(c, a, atol=1e-4, rtol=1e-4)
    rot = kv_rotation(64).float()
    for i, n in enumerate(lens):  # against the CPU reference (4-bit codes may differ at rounding ties)
        q, k, v = data[i]
        want = reference_recent(q, k, v, scale, bs, rot)
        torch.testing.assert_close(gpu[i], want[:n], atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(gpu[3][i], want[n], atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(gpu[4][i], want[n + 1], atol=2e-2, rtol=2e-2)


def test_decode_with_a_shared_own_block_takes_the_general_path():
    """A sequence's own block that another sequence of the batch also reads (a prefix block): the
    batched step equals the two sequences stepped one after the other."""
    cfg = config(64)
    scale = 0.125
    tables = torch.tensor([[0, 1, 3], [0, 1, 2]])  # A: blocks 0, 1 (own: 1); B: 0, 1, 2 (own: 2)
    q, k, v = qkv(cfg, 10, seed=30, outliers=True)

    def setup():
        kv = layer(cfg)
        kv.attend(q[:7], k[:7], v[:7], prefill_meta(torch.arange(7), tables[:1], 7), AttentionSpec(scale))
        return kv

    slots = torch.tensor([7, 8])  # A's 8th token (block 1), B's 9th (block 2); B's 8th is A's
    ctx = [8, 9]
    kv, kv2 = setup(), setup()
    meta = AttentionMetadata(False, slots, tables, torch.tensor(ctx), [1, 1], ctx)
    both = kv2.attend(q[7:9], k[7:9], v[7:9], meta, AttentionSpec(scale))
    assert kv2._plan(meta).decode is None  # block 1 is A's own block and B's context
    one = [kv.attend(q[7:8], k[7:8], v[7:8], AttentionMetadata(False, slots[:1], tables[:1],
                                                              torch.tensor([8]), [1], [8]), AttentionSpec(scale)),
           kv.attend(q[8:9], k[8:9], v[8:9], AttentionMetadata(False, slots[1:], tables[1:],
                                                              torch.tensor([9]), [1], [9]), AttentionSpec(scale))]
    torch.testing.assert_close(both, torch.cat(one), atol=1e-5, rtol=1e-5)


def test_row_remade_mid_block_starts_from_4bit_values(int4_path):
    """A sequence whose pool row was evicted gets a new one mid-block: the slots written before
    read 4-bit, every token from then on fp (the pool's invariant), over two decode steps."""
    cfg = config(64)
    bs, scale = 4, 0.125
    tables = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8]])
    n = 6
    data = [qkv(cfg, n + 2, seed=40 + i, outliers=True) for i in range(3)]
    kv = layer(cfg, recent_blocks=2)
    for i in range(3):  # the third prefill evicts the first sequence's row (least recently written)
        q, k, v = (x[:n] for x in data[i])
        kv.attend(q, k, v, prefill_meta(slots_of(tables[i:i + 1], n, bs), tables[i:i + 1], n), AttentionSpec(scale))
    assert 1 not in kv.pool_rows  # sequence 0's last block (positions 4..7)
    q, k, v = data[0]
    rot = kv_rotation(64).float()
    kr, vr, qr = k @ rot, v @ rot, q @ rot
    kq = dequantize_int4(*quantize_int4(kr, 64, -1), 64, -1)
    vq = dequantize_int4(*quantize_int4(vr, 64, -1), 64, -1)
    for p in (n, n + 1):
        out = kv.attend(q[p:p + 1], k[p:p + 1], v[p:p + 1],
                        AttentionMetadata(False, torch.tensor([int(tables[0, p // bs]) * bs + p % bs]),
                                          tables[:1], torch.tensor([p + 1]), [1], [p + 1]), AttentionSpec(scale))
        kk = torch.cat([kq[:n], kr[n:p + 1]]).repeat_interleave(2, 1)  # fp from the remade row on
        vv = torch.cat([vq[:n], vr[n:p + 1]]).repeat_interleave(2, 1)
        w = (torch.einsum("hd,mhd->hm", qr[p], kk) * scale).softmax(-1)
        torch.testing.assert_close(out[0], torch.einsum("hm,mhd->hd", w, vv) @ rot.T, atol=1e-5, rtol=1e-5)
    assert 1 in kv.pool_rows and 4 not in kv.pool_rows  # remade; sequence 1 lost its row
