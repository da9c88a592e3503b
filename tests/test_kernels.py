"""Triton kernels vs float64 references (small shapes): compiled on a GPU, else on the CPU under
the Triton interpreter (tests/conftest.py).

Inputs are drawn fresh each run (the seed is in every failure message); outputs are poisoned with
NaN before each call; caches, queries and block tables are non-contiguous views, block tables are
shuffled, and sequence lengths are not multiples of the block size.
"""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("kernel_device")

from localgen.kernels import paged_attention_ref as ref  # noqa: E402
from localgen.kernels import quant_ref as qr  # noqa: E402
from localgen.kernels.dispatch import (GemmDispatchTable, Int4Linear, NO_LIMIT,  # noqa: E402
                                       inflection_points)
from localgen.kernels.flat_gemm import flat_gemm_int4  # noqa: E402
from localgen.kernels.paged_decode import (paged_decode_attention,  # noqa: E402
                                           paged_decode_attention_int4)
from localgen.kernels.paged_prefill import paged_prefill_attention  # noqa: E402

TOL = {torch.bfloat16: 1e-2, torch.float16: 5e-3, torch.float32: 1e-5}
BS = 16  # tokens per KV block


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    return float((out.double() - want).abs().max() / want.abs().max().clamp_min(1e-12))


def poisoned(like: torch.Tensor) -> torch.Tensor:
    return torch.full_like(like, float("nan"))


def make_cache(num_blocks, kv_heads, head_dim, dtype):
    """A non-contiguous K or V cache: every other KV head of a wider tensor."""
    big = torch.randn(num_blocks, BS, 2 * kv_heads, head_dim, dtype=dtype)
    return big[:, :, ::2]


def make_tables(context_lens, num_blocks):
    """Shuffled, distinct physical blocks; the table is a column slice of a wider tensor."""
    need = [-(-n // BS) for n in context_lens]
    width = max(need) + 1
    perm = torch.randperm(num_blocks)
    big = torch.zeros(len(context_lens), width + 3, dtype=torch.int64)
    at = 0
    for i, n in enumerate(need):
        big[i, 2:2 + n] = perm[at:at + n]
        at += n
    return big[:, 2:2 + width]


def make_q(num, heads, head_dim, dtype):
    return torch.randn(num, heads, 2 * head_dim, dtype=dtype)[..., :head_dim]  # strided rows


def decode_case(dtype, heads, kv_heads, head_dim, lens):
    nb = sum(-(-n // BS) for n in lens) + 5
    k, v = make_cache(nb, kv_heads, head_dim, dtype), make_cache(nb, kv_heads, head_dim, dtype)
    q = make_q(len(lens), heads, head_dim, dtype)
    bt = make_tables(lens, nb)
    cl = torch.tensor(lens)
    return q, k, v, bt, cl


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 64), (8, 2, 80), (8, 1, 64)])
@pytest.mark.parametrize("softmax", ["sync", "async"])
def test_decode_matches_float64(seed, dtype, heads, kv_heads, head_dim, softmax):
    lens = [1, random.randint(2, 40), random.randint(41, 120)]
    q, k, v, bt, cl = decode_case(dtype, heads, kv_heads, head_dim, lens)
    scale = head_dim ** -0.5
    want = ref.paged_decode_attention(q.double(), k.double(), v.double(), bt, cl, scale)
    splits = random.choice([1, 3, 9])  # 9 splits leaves some empty for short sequences
    fused = random.choice([True, False])  # last split combines in-kernel / separate stage 2
    out = poisoned(q)
    got, flags = paged_decode_attention(q, k, v, bt, cl, scale, phi=0.0 if softmax == "async" else None,
                                        num_splits=splits, block_n=16, out=out, return_flags=True,
                                        fused=fused)
    assert got.data_ptr() == out.data_ptr()
    assert not torch.isnan(got).any(), f"seed={seed}"
    assert rel_err(got, want) < TOL[dtype], f"seed={seed} splits={splits} err={rel_err(got, want)}"
    assert int(flags.sum()) == 0, f"seed={seed}: no row should need recompute"


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 64), (8, 2, 80), (8, 8, 128)])
@pytest.mark.parametrize("softmax", ["sync", "async"])
@pytest.mark.parametrize("cache", ["bf16", "int4"])
def test_decode_on_cuda_cores_matches_float64(seed, heads, kv_heads, head_dim, softmax, cache):
    """``block_h`` below 16 (one program per KV head's few query heads, MHA's one): the dots run
    as CUDA-core multiply-adds instead of padded tensor-core tiles; same results, both caches."""
    lens = [1, random.randint(2, 40), random.randint(41, 120)]
    q, k, v, bt, cl = decode_case(torch.bfloat16, heads, kv_heads, head_dim, lens)
    scale = head_dim ** -0.5
    if cache == "int4":
        k, v = qr.quantize_kv(k), qr.quantize_kv(v)
        kd, vd = qr.dequantize_kv(k, torch.float64), qr.dequantize_kv(v, torch.float64)
        fn = paged_decode_attention_int4
    else:
        kd, vd, fn = k.double(), v.double(), paged_decode_attention
    want = ref.paged_decode_attention(q.double(), kd, vd, bt, cl, scale)
    got = fn(q, k, v, bt, cl, scale, phi=0.0 if softmax == "async" else None, block_h=heads // kv_heads,
             num_splits=random.choice([1, 3]), block_n=16, fused=random.choice([True, False]),
             out=poisoned(q))
    assert rel_err(got, want) < 1e-2, f"seed={seed} err={rel_err(got, want)}"
    if heads > kv_heads:
        with pytest.raises(ValueError, match="block_h"):
            fn(q, k, v, bt, cl, scale, block_h=heads // kv_heads // 2)


def test_decode_default_splits_and_block_n(seed):
    q, k, v, bt, cl = decode_case(torch.bfloat16, 8, 2, 64, [300, 7])
    want = ref.paged_decode_attention(q.double(), k.double(), v.double(), bt, cl, 0.125)
    got = paged_decode_attention(q, k, v, bt, cl, 0.125, out=poisoned(q))  # block_n 64, auto splits
    assert rel_err(got, want) < 1e-2, f"seed={seed}"


def test_wave_span_by_hand():
    """132 SMs, 264 programs saturate, 396 resident: 256 programs in one wave run as long as 264;
    512 are a full wave plus 116, which take as long as 264; 768 fill two waves. The share of
    the bandwidth kept busy is ``programs / wave_span``."""
    from localgen.kernels.paged_decode import wave_span
    assert wave_span(256, 264, 396) == 264 and wave_span(512, 264, 396) == 396 + 264
    assert 256 / wave_span(256, 264, 396) == pytest.approx(256 / 264)
    assert 512 / wave_span(512, 264, 396) == pytest.approx(512 / (396 + 264))
    assert 768 / wave_span(768, 264, 396) == 1.0
    assert 3072 / wave_span(3072, 264, 396) == 1.0  # 7 waves + 300 resident: saturated


@pytest.mark.parametrize("b,kvh,ctx,want", [
    (1, 8, 4096, 32),    # 8 programs: 32 one-tile splits (256 programs)
    (8, 8, 4096, 4),     # 4 x 8-tile splits (256); 5 would be 7,7,7,7,4 tiles
    (32, 8, 32768, 1),   # 256 programs already saturate
    (64, 8, 16384, 2),   # 512 programs: 1.3 waves; 2 splits: 2.6 waves of 3 resident per SM
    (128, 8, 4096, 1),   # 1024: 2.6 waves, within the 5% margin of the best count
    (64, 8, 512, 1),     # 512 programs of 4 tiles: a split would hold under 8
    (16, 32, 544, 1),    # Llama-2-7B's MHA, 512 programs of 5 tiles (was 5 one-tile splits)
])
def test_bf16_split_counts_on_132_sms(monkeypatch, b, kvh, ctx, want):
    """The bf16 split counts on an H200 (132 SMs), hand-computed from the wave model; every
    returned count leaves no split empty (whole-tile chunks)."""
    from localgen.kernels import decode_splits
    from localgen.kernels import paged_decode as pd
    monkeypatch.setattr(decode_splits, "num_sms", lambda device, off_cuda: 132)
    cfg = pd.decode_config(b, kvh, ctx, 128, torch.device("cpu"))
    got = pd.config_splits(cfg, b, kvh, ctx, torch.device("cpu"))
    tiles = -(-ctx // cfg["block_n"])
    assert got == want and -(-tiles // -(-tiles // got)) == got


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # fp16 partials of the flagged row
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("splits,fused", [(3, True), (3, False), (1, True)])
def test_async_recompute_on_outliers(seed, dtype, splits, fused):
    """Crafted outliers: seq 0 has one key aligned with its query (x - phi >> b, overflow side);
    seq 2's scores all sit far below phi (x - phi << a, underflow side). Both rows must be
    flagged and recomputed synchronously; seq 1 stays on the asynchronous path."""
    heads, kv_heads, d = 8, 2, 64
    lens = [37, 50, 29]
    q, k, v, bt, cl = decode_case(dtype, heads, kv_heads, d, lens)
    # k is a strided view; edit it in place
    # seq 0, query head 1 (KV head 0): key at position 20 = 4 * q -> x = 4 |q|^2 / 8 ~ 32
    blk, off = int(bt[0, 20 // BS]), 20 % BS
    k[blk, off, 0] = (4 * q[0, 1]).to(dtype)
    # seq 2, KV head 1 (query heads 4..7): every key points away from q
    for t in range(lens[2]):
        b2, o2 = int(bt[2, t // BS]), t % BS
        k[b2, o2, 1] = (-3 * q[2, 4:8].float().mean(0) / q[2, 4:8].float().mean(0).norm() * 8
                        ).to(dtype)
    q[2, 4:8] = q[2, 4:8].float().mean(0, keepdim=True).to(dtype)
    scale = d ** -0.5
    want = ref.paged_decode_attention(q.double(), k.double(), v.double(), bt, cl, scale)
    flags_buf = torch.full((len(lens), heads), -7, dtype=torch.int32)  # every flag is stored
    got, flags = paged_decode_attention(q, k, v, bt, cl, scale, phi=0.0, bounds=(-9.0, 11.0),
                                        num_splits=splits, block_n=16, out=poisoned(q),
                                        return_flags=True, fused=fused, flags=flags_buf)
    assert flags.data_ptr() == flags_buf.data_ptr()
    assert flags[0, 1] == 1, f"seed={seed}: overflow outlier not flagged"
    assert flags[2, 4:8].all(), f"seed={seed}: underflow rows not flagged"
    assert flags[1].sum() == 0 and flags[0, 4:].sum() == 0, f"seed={seed}: {flags}"
    assert rel_err(got, want) < TOL[dtype], f"seed={seed} err={rel_err(got, want)}"
    # without the recompute the overflow row would be wrong: the async partials alone overflow fp16
    # or lose the row; check the detection, not the failure, by a wide-bounds run
    got2, flags2 = paged_decode_attention(q, k, v, bt, cl, scale, phi=0.0, bounds=(-1e4, 1e4),
                                          num_splits=3, block_n=16, return_flags=True)
    assert int(flags2.sum()) == 0


def test_flags_buffer_sync_zeroed_and_validated(seed):
    """The sync path stores no flags: a given buffer comes back zeroed. A buffer of the wrong
    shape or dtype is refused."""
    q, k, v, bt, cl = decode_case(torch.bfloat16, 8, 2, 64, [21, 40])
    buf = torch.full((2, 8), -7, dtype=torch.int32)
    _, flags = paged_decode_attention(q, k, v, bt, cl, 0.125, num_splits=2, block_n=16,
                                      return_flags=True, flags=buf)
    assert int(flags.abs().sum()) == 0 and flags.data_ptr() == buf.data_ptr()
    for bad in (torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, 8, dtype=torch.int64)):
        with pytest.raises(ValueError, match="flags must be"):
            paged_decode_attention(q, k, v, bt, cl, 0.125, phi=0.0, flags=bad)


def test_async_phi_far_from_scores_all_rows_recomputed(seed):
    q, k, v, bt, cl = decode_case(torch.bfloat16, 4, 4, 64, [5, 33])
    want = ref.paged_decode_attention(q.double(), k.double(), v.double(), bt, cl, 0.125)
    got, flags = paged_decode_attention(q, k, v, bt, cl, 0.125, phi=200.0, num_splits=2,
                                        block_n=16, out=poisoned(q), return_flags=True)
    assert flags.all(), f"seed={seed}"
    assert rel_err(got, want) < 1e-2, f"seed={seed}"


# ---- int4 KV ---------------------------------------------------------------------------------

@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_int4_roundtrip(seed, head_dim):
    x = torch.randn(3, BS, 2, head_dim) * torch.rand(3, 1, 2, 1) * 4
    qk = qr.quantize_kv(x)
    ngroups = -(-head_dim // 64)
    assert qk.packed.dtype == torch.uint8 and qk.packed.shape == (3, BS, 2, head_dim // 2)
    assert qk.scale.dtype == torch.float16 and qk.scale.shape == (3, BS, 2, ngroups)
    back = qr.dequantize_kv(qk)
    step = qk.scale.float().repeat_interleave(64, -1)[..., :head_dim]
    assert ((back - x).abs() <= step / 2 + 2e-3 * x.abs().amax(-1, keepdim=True)).all(), f"seed={seed}"
    # the packing is bit-exact and idempotent: re-quantizing the dequantized tensor keeps codes
    again = qr.quantize_kv(back)
    assert (again.packed == qk.packed).float().mean() > 0.99


def test_int4_layout_known_values():
    x = torch.arange(64, dtype=torch.float32).view(1, 1, 1, 64)  # min 0, max 63: scale 4.2
    qk = qr.quantize_kv(x)
    assert float(qk.min) == 0 and abs(float(qk.scale) - 4.2) < 1e-2
    codes = torch.round(x / qk.scale.float()).clamp(0, 15).to(torch.uint8).flatten()
    assert qk.packed.flatten()[0] == codes[0] | (codes[1] << 4)
    assert qk.packed.flatten()[5] == codes[10] | (codes[11] << 4)
    const = qr.quantize_kv(torch.full((1, 1, 1, 64), 2.5))
    assert float(const.scale) == 0 and torch.equal(qr.dequantize_kv(const), torch.full((1, 1, 1, 64), 2.5))


def test_write_kv_int4_matches_quantize(seed):
    k = torch.randn(20, 3, 64)
    v = torch.randn(20, 3, 64)
    ck = qr.QuantizedKV(torch.zeros(4, BS, 3, 32, dtype=torch.uint8), torch.zeros(4, BS, 3, 1).half(),
                        torch.zeros(4, BS, 3, 1).half())
    cv = qr.QuantizedKV(ck.packed.clone(), ck.scale.clone(), ck.min.clone())
    slots = torch.randperm(4 * BS)[:20]
    qr.write_kv_int4(ck, cv, k, v, slots)
    flat = qr.dequantize_kv(ck).view(-1, 3, 64)[slots]
    assert torch.equal(flat, qr.dequantize_kv(qr.quantize_kv(k.view(20, 1, 3, 64))).view(20, 3, 64))


@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 8, 2), (80, 4, 4)])
@pytest.mark.parametrize("softmax", ["sync", "async"])
def test_int4_decode_matches_dequantized_reference(seed, head_dim, heads, kv_heads, softmax):
    lens = [random.randint(1, 30), random.randint(31, 90)]
    q, k, v, bt, cl = decode_case(torch.bfloat16, heads, kv_heads, head_dim, lens)
    qk, qv = qr.quantize_kv(k), qr.quantize_kv(v)
    kd, vd = qr.dequantize_kv(qk, torch.float64), qr.dequantize_kv(qv, torch.float64)
    scale = head_dim ** -0.5
    want = ref.paged_decode_attention(q.double(), kd, vd, bt, cl, scale)
    got = paged_decode_attention_int4(q, qk, qv, bt, cl, scale, num_splits=random.choice([1, 2, 5]),
                                      block_n=16, fused=random.choice([True, False]),
                                      phi=0.0 if softmax == "async" else None, out=poisoned(q))
    assert rel_err(got, want) < 1e-2, f"seed={seed} err={rel_err(got, want)}"


@pytest.mark.parametrize("softmax", ["sync", "async", "recompute"])
def test_int4_decode_reads_own_blocks_from_the_fp_pool(seed, softmax):
    """KIVI-style own block: each sequence with a pool row reads its last block's slots in fp from
    the row (non-contiguous pool, shuffled rows), earlier blocks 4-bit; row -1 reads all 4-bit.
    Lengths on and off block boundaries (a lone token in a fresh block, a full last block), splits
    that cut the own block, and an outlier row in the pool that forces the recompute path."""
    heads, kv_heads, head_dim = 8, 2, 64
    lens = [1, BS, BS + 1, random.randint(2 * BS + 2, 3 * BS - 1), random.randint(3 * BS, 6 * BS)]
    q, k, v, bt, cl = decode_case(torch.bfloat16, heads, kv_heads, head_dim, lens)
    qk, qv = qr.quantize_kv(k), qr.quantize_kv(v)
    kd, vd = qr.dequantize_kv(qk, torch.float64), qr.dequantize_kv(qv, torch.float64)
    pool_k = torch.randn(9, BS, 2 * kv_heads, head_dim, dtype=torch.bfloat16)[:, :, 1::2]
    pool_v = torch.randn(9, BS, 2 * kv_heads, head_dim, dtype=torch.bfloat16)[:, :, 1::2]
    rows = torch.tensor(random.sample(range(9), len(lens)))
    rows[random.randrange(len(lens))] = -1
    if softmax == "recompute":
        seq = int(torch.nonzero(rows >= 0)[0])
        # a key along each KV head's first query head: that score is ~ 30 * |q|^2 / 8, far above
        # the safe range, in every draw
        pool_k[rows[seq], (lens[seq] - 1) % BS] = 30 * q[seq, ::heads // kv_heads]
    for i, (row, n) in enumerate(zip(rows.tolist(), lens)):  # the reference reads the same values
        if row >= 0:
            blk, m = int(bt[i, (n - 1) // BS]), (n - 1) % BS + 1
            kd[blk, :m], vd[blk, :m] = pool_k[row, :m].double(), pool_v[row, :m].double()
    scale = head_dim ** -0.5
    want = ref.paged_decode_attention(q.double(), kd, vd, bt, cl, scale)
    got, flags = paged_decode_attention_int4(
        q, qk, qv, bt, cl, scale, num_splits=random.choice([1, 3, 7]), block_n=16,
        fused=random.choice([True, False]), phi=None if softmax == "sync" else 0.0,
        out=poisoned(q), return_flags=True, own_k=pool_k, own_v=pool_v, own_rows=rows)
    assert rel_err(got, want) < 1e-2, f"seed={seed} err={rel_err(got, want)}"
    assert bool(flags.any()) == (softmax == "recompute"), f"seed={seed}"


def test_int4_decode_rejects_a_mismatched_pool():
    q, k, v, bt, cl = decode_case(torch.bfloat16, 4, 2, 64, [5, 20])
    qk, qv = qr.quantize_kv(k), qr.quantize_kv(v)
    pool = torch.zeros(3, BS + 1, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="own-block pool"):
        paged_decode_attention_int4(q, qk, qv, bt, cl, 0.125, own_k=pool, own_v=pool,
                                    own_rows=torch.tensor([0, 1]))


def test_int4_recompute_and_fused_counters_reset(seed):
    """int4 rows forced through the recompute path (phi far above every score), fused combine;
    the fused path leaves its ticket counters at zero for the next call (CUDA-graph replays)."""
    from localgen.kernels.triton_common import tickets
    q, k, v, bt, cl = decode_case(torch.bfloat16, 8, 2, 64, [45, 70])
    qk, qv = qr.quantize_kv(k), qr.quantize_kv(v)
    kd, vd = qr.dequantize_kv(qk, torch.float64), qr.dequantize_kv(qv, torch.float64)
    want = ref.paged_decode_attention(q.double(), kd, vd, bt, cl, 0.125)
    for splits in (3, 1):
        got, flags = paged_decode_attention_int4(
            q, qk, qv, bt, cl, 0.125, phi=200.0, num_splits=splits, block_n=16, fused=True,
            out=poisoned(q), return_flags=True, flags=torch.full((2, 8), -7, dtype=torch.int32))
        assert flags.all(), f"seed={seed}"
        assert rel_err(got, want) < 1e-2, f"seed={seed} splits={splits} err={rel_err(got, want)}"
    assert int(tickets(q.device, 1).abs().sum()) == 0  # every launch leaves its tickets at zero


# ---- prefill ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 64), (8, 2, 80)])
def test_prefill_matches_float64(seed, dtype, heads, kv_heads, head_dim):
    # fresh prompt, reused prefix + new tokens, one-token chunk
    ctx = [random.randint(2, 40), random.randint(20, 70), random.randint(5, 30)]
    ql = [ctx[0], random.randint(1, ctx[1] - 1), 1]
    nb = sum(-(-n // BS) for n in ctx) + 3
    k, v = make_cache(nb, kv_heads, head_dim, dtype), make_cache(nb, kv_heads, head_dim, dtype)
    q = make_q(sum(ql), heads, head_dim, dtype)
    bt = make_tables(ctx, nb)
    scale = head_dim ** -0.5
    want = ref.paged_prefill_attention(q.double(), k.double(), v.double(), bt, ctx, ql, scale)
    got = paged_prefill_attention(q, k, v, bt, ctx, ql, scale, block_m=16, block_n=16,
                                  out=poisoned(q.contiguous()))
    assert rel_err(got, want) < TOL[dtype], f"seed={seed} ctx={ctx} ql={ql}"


# ---- flat GEMM + dispatch ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,split_k", [(1, 1), (5, 2), (33, 1)])
def test_flat_gemm_int4_matches_dequantized(seed, dtype, m, split_k):
    n, k = 192, 96  # 3 groups along N; K not a multiple of BLOCK_K
    qw = qr.quantize_weight(torch.randn(n, k))
    x = torch.randn(m, 2 * k, dtype=dtype)[:, ::2]  # strided activations
    want = x.double() @ qr.dequantize_weight(qw, torch.float64).t()
    got = flat_gemm_int4(x, qw, block_m=16, block_n=64, block_k=64, split_k=split_k)
    assert got.shape == (m, n) and got.dtype == dtype
    assert rel_err(got, want) < TOL[dtype] * 2, f"seed={seed}"


def test_weight_quant_groups_along_output_channels(seed):
    w = torch.randn(128, 10)
    qw = qr.quantize_weight(w)
    assert qw.packed.shape == (64, 10) and qw.scale.shape == (2, 10) and qw.shape == (128, 10)
    assert torch.allclose(qw.min.float(), w.view(2, 64, 10).amin(1), atol=1e-2)


def test_inflection_points_and_dispatch():
    def t(f, ti, to):
        return {"flat": f, "tiled": ti, "torch": to}
    timings = {1: t(1, 2, 5), 8: t(1, 2, 5), 16: t(3, 2, 5), 64: t(6, 3, 4), 256: t(9, 8, 5)}
    assert inflection_points(timings) == (8, 64)
    assert inflection_points({1: t(1, 2, 3), 2: t(1, 2, 3)}) == (NO_LIMIT, NO_LIMIT)
    assert inflection_points({1: t(3, 2, 1), 2: t(3, 2, 1)}) == (0, 0)
    # torch never measured fastest, but the kernels grow faster with M: the lines meet at M=3000
    # (tiled 100 + 0.1 (M - 1000), torch 300 + 0.0 (M - 1000): 100 + 0.1 d = 300 at d = 2000)
    far = {500: t(80, 50, 300), 1000: t(120, 100, 300)}
    assert inflection_points(far) == (0, 3000)
    assert inflection_points({500: t(50, 60, 300), 1000: t(100, 120, 300)}) == (3000, 3000)
    table = GemmDispatchTable({(256, 128): (8, 64)})
    assert [table.impl(m, 256, 128) for m in (1, 8, 9, 64, 65)] == \
        ["flat", "flat", "tiled", "tiled", "torch"]
    assert GemmDispatchTable.from_json(table.to_json()).entries == table.entries


def test_int4_linear_routes_all_impls(seed):
    qw = qr.quantize_weight(torch.randn(128, 64))
    lin = Int4Linear(qw, GemmDispatchTable({(128, 64): (2, 4)}), dtype=torch.float32)
    for m in (1, 3, 6):  # flat, tiled, torch
        x = torch.randn(m, 64)
        want = x.double() @ qr.dequantize_weight(qw, torch.float64).t()
        assert rel_err(lin(x), want) < 1e-5, f"seed={seed} m={m}"


@pytest.mark.parametrize("dim,group", [(0, 64), (1, 32)])
def test_streamed_weight_dequantized_in_row_slices(seed, dim, group, monkeypatch):
    """A streamed weight (``cache_dense=False``) over ``DENSE_CHUNK_BYTES`` goes through the
    dequantize + matmul path a row slice at a time (the last slice short), each GEMM writing its
    columns of the output in place: the same product as the whole dense weight."""
    from localgen.kernels import dispatch

    n, k = 200 if dim == 1 else 320, 96
    qw = qr.quantize_weight(torch.randn(n, k), group, dim=dim)
    lin = Int4Linear(qw, GemmDispatchTable({(n, k): (0, 0)}), dtype=torch.float32, cache_dense=False)
    monkeypatch.setattr(dispatch, "DENSE_CHUNK_BYTES", 70 * k * 4)  # 70 rows -> 64 (dim 0) / 70
    sliced = []
    monkeypatch.setattr(Int4Linear, "dense", lambda self: pytest.fail("whole weight dequantized"))
    real_rows = Int4Linear.dense_rows
    monkeypatch.setattr(Int4Linear, "dense_rows",
                        lambda self, a, b: sliced.append((a, b)) or real_rows(self, a, b))
    x = torch.randn(5, k)
    want = x.double() @ qr.dequantize_weight(qw, torch.float64).t()
    assert rel_err(lin(x), want) < 1e-5, f"seed={seed}"
    step = 64 if dim == 0 else 70
    assert sliced == [(a, min(n, a + step)) for a in range(0, n, step)]


# ---- the call site ------------------------------------------------------------------------------

def test_call_site_observer_and_cpu_path(seed):
    """On the CPU the call site gives the reference twin's values (through the C decode kernel
    where it builds: within float32 rounding); the score observer sees every call."""
    with torch.device("cpu"):  # the CPU backend, whatever device the module's kernels run on
        _check_cpu_call_site()


def _check_cpu_call_site():
    from localgen.kv import attention as att
    k_cache, v_cache = torch.zeros(4, BS, 2, 64), torch.zeros(4, BS, 2, 64)
    kv = att.LayerKV(k_cache, v_cache)
    meta = att.AttentionMetadata(False, torch.tensor([3 * BS + 4, 5]), torch.tensor([[3, 0], [0, 1]]),
                                 torch.tensor([5, 6]), [1, 1], [5, 6])
    q, k, v = torch.randn(2, 4, 64), torch.randn(2, 2, 64), torch.randn(2, 2, 64)
    seen = []
    from localgen.attention.select import device_backend
    from localgen.attention.spec import AttentionSpec
    kv.backend = device_backend("cpu", torch.float32, observer=lambda *a: seen.append(a))
    out = kv.attend(q, k, v, meta, AttentionSpec(0.125))
    assert len(seen) == 1 and seen[0][0] is q
    want = ref.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, 0.125)
    assert torch.allclose(out, want, rtol=1e-5, atol=1e-6)


# ---- KV write ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kv_heads,head_dim", [(2, 64), (3, 80)])
def test_write_kv_matches_index_copy(seed, dtype, kv_heads, head_dim):
    from localgen.kernels.kv_write import write_kv

    nb, n = 6, 11
    shape = (nb, BS, kv_heads, head_dim)
    # k/v as strided views of a fused qkv row, slots scattered over the blocks
    qkv = torch.randn(n, kv_heads * 3, head_dim, dtype=dtype)
    k, v = qkv[:, kv_heads:2 * kv_heads], qkv[:, 2 * kv_heads:]
    slots = torch.randperm(nb * BS)[:n]
    want_k, want_v = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    ref.write_kv(want_k, want_v, k, v, slots)
    got_k, got_v = torch.full(shape, 7.0, dtype=dtype), torch.full(shape, 7.0, dtype=dtype)
    got_k.view(-1, kv_heads, head_dim)[slots] = 0  # poisoned everywhere except ...
    got_v.view(-1, kv_heads, head_dim)[slots] = 0  # ... written slots, zeroed to spot misses
    untouched = torch.ones(nb * BS, dtype=torch.bool)
    untouched[slots] = False
    write_kv(got_k, got_v, k, v, slots)
    for got, want in ((got_k, want_k), (got_v, want_v)):
        flat_g, flat_w = got.view(-1, kv_heads, head_dim), want.view(-1, kv_heads, head_dim)
        assert torch.equal(flat_g[slots], flat_w[slots]), f"seed={seed}"
        assert bool((flat_g[untouched] == 7.0).all()), f"seed={seed}: wrote outside the slots"
    with pytest.raises(ValueError, match="do not match"):
        write_kv(got_k, got_v, k, v, slots[:-1])


def _garbage_int4_cache(nb, kv_heads, head_dim, group):
    """A QuantizedKV filled with random bytes (scale/min: random fp16 bit patterns, NaNs
    included), so unwritten slots can be checked bit for bit."""
    s = (nb, BS, kv_heads, -(-head_dim // group))
    scale, mn = torch.randint(-(1 << 15), 1 << 15, (2, *s), dtype=torch.int16).view(torch.float16)
    return qr.QuantizedKV(torch.randint(0, 256, (*s[:3], head_dim // 2), dtype=torch.uint8),
                          scale, mn, group)


def _int4_bits(c):  # integer views: exact comparison, NaN and -0.0 included
    return c.packed, c.scale.view(torch.int16), c.min.view(torch.int16)


def _clone_int4(c):
    return qr.QuantizedKV(c.packed.clone(), c.scale.clone(), c.min.clone(), c.group_size)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kv_heads,head_dim,group", [(1, 64, 64), (3, 80, 64), (8, 128, 32)])
@pytest.mark.parametrize("heads_per_program", [None, 2])
def test_write_kv_int4_kernel_bit_identical(seed, dtype, kv_heads, head_dim, group, heads_per_program,
                                            monkeypatch):
    """Bit-identical to the torch twin, with the heads of a token split over programs as the
    size rule picks (12 tokens: one head each) or two a program (a last program half masked)."""
    from localgen.kernels import kv_write
    from localgen.kernels.kv_write import write_kv_int4

    if heads_per_program:
        monkeypatch.setattr(kv_write, "_heads_per_program", lambda *_a: heads_per_program)

    nb, n = 3, 12
    # k/v as strided views of a fused qkv row; per-(token, head) ranges vary
    qkv = torch.randn(n, kv_heads * 4, head_dim) * torch.rand(n, kv_heads * 4, 1) * 8
    qkv[0, 2 * kv_heads:] = 1.5 + torch.randn(()).item()  # token 0's K and V: zero-range groups
    qkv[2] += 20  # all positive, token 3 all negative: padding must not enter a short group's min/max
    qkv[3] -= 20
    # token 1's K, head 0, every group: min m*s, max (m + 15)*s, the rest exactly halfway between
    # codes, (x - min) / scale = c + 0.5: the codes must round half to even
    s = random.choice([0.25, 0.5, 1.0, 2.0])
    m = random.randint(-8, 8)
    c = torch.randint(0, 15, (head_dim,))
    row = s * (m + c + 0.5)
    starts = list(range(0, head_dim, group))
    for a in starts:
        row[a], row[a + 1] = m * s, (m + 15) * s
    qkv[1, 2 * kv_heads] = row
    qkv = qkv.to(dtype)
    k, v = qkv[:, 2 * kv_heads:3 * kv_heads], qkv[:, 3 * kv_heads:]
    slots = torch.randperm(nb * BS)[:n]
    got_k, got_v = _garbage_int4_cache(nb, kv_heads, head_dim, group), \
        _garbage_int4_cache(nb, kv_heads, head_dim, group)
    want_k, want_v = _clone_int4(got_k), _clone_int4(got_v)
    qr.write_kv_int4(want_k, want_v, k, v, slots)
    write_kv_int4(got_k, got_v, k, v, slots)
    for got, want in ((got_k, want_k), (got_v, want_v)):
        for g_t, w_t in zip(_int4_bits(got), _int4_bits(want)):
            assert torch.equal(g_t, w_t), f"seed={seed}"  # unwritten slots: garbage kept
    # independent oracle for the crafted row: half-way codes go to the even neighbour
    packed = got_k.packed.view(-1, kv_heads, head_dim // 2)[slots[1], 0]
    codes = torch.stack([packed & 15, packed >> 4], -1).flatten().long()
    want_codes = c + c % 2
    for a in starts:
        want_codes[a], want_codes[a + 1] = 0, 15
    assert torch.equal(codes, want_codes), f"seed={seed}"
    assert bool((got_v.scale.view(-1, kv_heads, got_v.scale.shape[-1])[slots[0]] == 0).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv_heads,head_dim", [(3, 80), (4, 128)])
def test_write_kv_int4_echoes_what_it_stored(seed, dtype, kv_heads, head_dim):
    """``dequantized``: the values the cache now holds at the written slots, as the reference
    dequantizer reads them back (a 4-bit prefill attends over these instead of a gather)."""
    from localgen.kernels.kv_write import write_kv_int4

    n, nb = 21, 3
    k, v = (torch.randn(n, kv_heads, head_dim, dtype=dtype) * 4 for _ in range(2))
    kc, vc = _garbage_int4_cache(nb, kv_heads, head_dim, 64), _garbage_int4_cache(nb, kv_heads, head_dim, 64)
    slots = torch.randperm(nb * BS)[:n]
    echo = (poisoned(k), poisoned(v))
    write_kv_int4(kc, vc, k, v, slots, dequantized=echo)
    for cache, e in ((kc, echo[0]), (vc, echo[1])):
        stored = qr.dequantize_kv(cache, dtype).view(-1, kv_heads, head_dim)[slots]
        if dtype == torch.float16:
            assert torch.equal(e, stored), f"seed={seed}"
        else:  # Triton's interpreter casts float32 to bf16 by truncation (the GPU rounds to even)
            torch.testing.assert_close(e, stored, rtol=2 ** -7, atol=0, msg=f"seed={seed}")
    with pytest.raises(ValueError, match="dequantized"):
        write_kv_int4(kc, vc, k, v, slots, dequantized=(echo[0][:, :1], echo[1]))


def test_write_kv_int4_kernel_validates(seed):
    from localgen.kernels.kv_write import write_kv_int4

    kc, vc = _garbage_int4_cache(2, 2, 64, 64), _garbage_int4_cache(2, 2, 64, 64)
    k = v = torch.randn(3, 2, 64)
    slots = torch.tensor([0, 5, 17])
    with pytest.raises(ValueError, match="do not match"):
        write_kv_int4(kc, vc, k, v, slots[:-1])
    with pytest.raises(ValueError, match="do not match"):
        write_kv_int4(kc, vc, torch.randn(3, 2, 80), torch.randn(3, 2, 80), slots)
    with pytest.raises(ValueError, match="power of two"):
        write_kv_int4(kc, _garbage_int4_cache(2, 2, 64, 32), k, v, slots)
    with pytest.raises(ValueError, match="contiguous"):
        write_kv_int4(qr.QuantizedKV(kc.packed.transpose(0, 1).contiguous().transpose(0, 1),
                                     kc.scale, kc.min), vc, k, v, slots)
    with pytest.raises(ValueError, match="bf16/fp16/fp32"):
        write_kv_int4(kc, vc, k.double(), v.double(), slots)
    write_kv_int4(kc, vc, k[:0], v[:0], slots[:0])  # no tokens: no launch


@pytest.mark.parametrize("module,kernel,names", [
    ("paged_prefill", "_prefill_kernel", "PER_BATCH_ARGS"),
    ("gguf_q8", "_quantize_x8", "QUANTIZE_PER_BATCH_ARGS")])
def test_arguments_that_follow_the_batch_are_not_specialized(module, kernel, names):
    """The prefill attention's block table (address, width) and the activation rounding's row
    count change with each batch; compiled, Triton would specialize them (16-byte alignment,
    value 1 or a multiple of 16) and compile a new kernel in the first step that reaches a new
    class, one the graphs captured at load did not (an eager prefill past a cached prefix). They
    name real arguments, and a compiled kernel keeps them unspecialized."""
    import importlib

    mod = importlib.import_module(f"localgen.kernels.{module}")
    fn, wanted = getattr(mod, kernel), getattr(mod, names)
    params = getattr(fn, "params", None)
    if params is None:  # the interpreter's wrapper keeps the names only
        assert set(wanted) <= set(fn.arg_names)
    else:
        assert {p.name for p in params if p.do_not_specialize} == set(wanted)
