"""The C CPU decode-attention kernel (kernels/csrc/paged_decode_cpu.c) against the float64
reference, on fresh random inputs: GQA groups, every head_dim the models use (and one that takes
the kernel's generic loop), shuffled block tables, lengths off block boundaries, contexts split
across threads; and its build's fallbacks."""

from __future__ import annotations

import pytest
import torch

from localgen.kernels import cpu_build
from localgen.kernels import paged_attention_ref as ref
from localgen.kernels import layer_ops_cpu as ops
from localgen.kernels import paged_decode_cpu as pdc

needs_kernel = pytest.mark.skipif(not pdc.available(), reason="no C compiler for the kernel")
BS = 16


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    return float((out.double() - want.double()).norm() / want.double().norm())


def random_case(lens: list[int], heads: int, kv_heads: int, d: int, dtype: torch.dtype,
                gen: torch.Generator):
    """A shuffled paged cache holding ``lens`` tokens per sequence, and the queries."""
    need = [-(-n // BS) for n in lens]
    num_blocks = sum(need) + 5
    pair = torch.randn(2, num_blocks, BS, kv_heads, d, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    width, at, rows = max(need), 0, []
    for k in need:
        rows.append(torch.cat([perm[at:at + k], torch.zeros(width - k, dtype=torch.long)]))
        at += k
    q = torch.randn(len(lens), heads, d, generator=gen).to(dtype)
    return q, pair[0], pair[1], torch.stack(rows), torch.tensor(lens)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (8, 8, 80), (12, 4, 96), (32, 8, 128),
                                              (4, 1, 48)])
@pytest.mark.parametrize("lens", [[1], [37], [16, 300, 5], [1100]])
def test_paged_decode_matches_float64_reference(dtype, heads, kv_heads, d, lens):
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)  # fresh inputs each run
    q, kc, vc, bt, cl = random_case(lens, heads, kv_heads, d, dtype, gen)
    out = pdc.paged_decode(q, kc, vc, bt, cl, d ** -0.5)
    want = ref.paged_decode_attention(q.double(), kc.double(), vc.double(), bt, cl, d ** -0.5)
    assert out.shape == q.shape and out.dtype == dtype
    assert rel_err(out, want) < (1e-5 if dtype == torch.float32 else 1e-2)


@needs_kernel
@pytest.mark.parametrize("splits", [2, 3, 7])
def test_split_contexts_combine_to_the_unsplit_result(splits):
    """Partials over context splits (some empty: 7 splits of a 40-token sequence) combine to
    what one pass gives, within float32 rounding."""
    gen = torch.Generator().manual_seed(3)
    q, kc, vc, bt, cl = random_case([700, 40], 8, 2, 64, torch.float32, gen)
    one = pdc.run(pdc.Launch(bt, cl, 1, 1), q, kc, vc, 0.125)
    many = pdc.run(pdc.Launch(bt, cl, splits, 2), q, kc, vc, 0.125)
    assert (many - one).abs().max() < 1e-5


@needs_kernel
def test_outlier_scores_stay_finite_and_exact():
    """A key aligned with the query at a large scale: one score far above the rest (the
    softmax is then one-hot), as the float64 reference gives."""
    gen = torch.Generator().manual_seed(5)
    q, kc, vc, bt, cl = random_case([200], 4, 1, 64, torch.float32, gen)
    kc[bt[0, 3], 7, 0] = q[0, 0] * 40
    out = pdc.paged_decode(q, kc, vc, bt, cl, 0.125)
    want = ref.paged_decode_attention(q.double(), kc.double(), vc.double(), bt, cl, 0.125)
    assert torch.isfinite(out).all() and rel_err(out, want) < 1e-5


def test_choose_splits_fills_threads_without_short_splits():
    assert pdc.choose_splits(1, 3, 540, 2) == 2      # 3 items for 2 threads -> 6
    assert pdc.choose_splits(1, 3, 100, 2) == 1      # shorter than a split is worth
    assert pdc.choose_splits(16, 8, 4000, 2) == 1    # plenty of items already
    assert pdc.choose_splits(1, 1, 4000, 8) == 16


def test_plan_runs_little_work_on_one_thread(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    bt = torch.zeros(2, 40, dtype=torch.long)
    few = pdc.plan(bt, torch.tensor([37, 20]), 3, 37)         # 171 K rows
    many = pdc.plan(bt, torch.tensor([600, 20]), 3, 600)      # 1860 K rows
    assert (few.threads, few.splits) == (1, 1)
    assert many.threads == 4 and many.splits == pdc.choose_splits(2, 3, 600, 4) == 2


@needs_kernel
def test_rejects_what_it_cannot_take():
    gen = torch.Generator().manual_seed(0)
    q, kc, vc, bt, cl = random_case([20], 4, 2, 64, torch.float32, gen)
    with pytest.raises(ValueError, match="unsupported"):
        pdc.paged_decode(q.half(), kc.half(), vc.half(), bt, cl, 0.125)
    with pytest.raises(ValueError, match="unsupported"):
        pdc.paged_decode(q[:, :3], kc, vc, bt, cl, 0.125)  # 3 query heads over 2 KV heads
    with pytest.raises(ValueError, match=">= 1"):
        pdc.paged_decode(q, kc, vc, bt, torch.tensor([0]), 0.125)


def test_build_falls_back_without_a_compiler(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("LOCALGEN_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_build, "_compiler", lambda: None)
    cpu_build.load.cache_clear()
    try:
        assert cpu_build.load("paged_decode_cpu") is None
        assert "no C compiler" in caplog.text
    finally:
        cpu_build.load.cache_clear()


def test_build_reports_a_compile_error(monkeypatch, tmp_path, caplog):
    if cpu_build._compiler() is None:
        pytest.skip("no C compiler")
    (tmp_path / "broken.c").write_text("int f( {")
    monkeypatch.setattr(cpu_build, "CSRC", tmp_path)
    monkeypatch.setenv("LOCALGEN_KERNEL_CACHE", str(tmp_path / "cache"))
    cpu_build.load.cache_clear()
    try:
        assert cpu_build.load("broken") is None
        assert "broken.c" in caplog.text and not list((tmp_path / "cache").glob("*.so"))
    finally:
        cpu_build.load.cache_clear()


needs_ops = pytest.mark.skipif(not ops.available(), reason="no C compiler for the layer ops")


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 steps between same-signed values (as ordered integers)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@needs_ops
@pytest.mark.parametrize("rows,n", [(1, 576), (3, 100), (70, 2048)])  # 70 rows: threaded
def test_rms_norms_match_torch(rows, n):
    """bf16 RMSNorm and residual add + RMSNorm against the torch expressions (Hugging Face
    LlamaRMSNorm's two roundings): the mean of squares is summed in another order than torch's,
    so a rare normalized element may round one bf16 step apart, which the weight's multiply and
    rounding can widen to two, never more (a row's scale is shared by all its elements: where it
    differs in its last bit, a few percent of that row can round apart, so the bound on their
    share allows for one such row); the residual sum is exact;
    fp32 (a strided view) within float32 rounding."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    x, delta = (torch.randn(rows, n, generator=gen).bfloat16() * 3 for _ in range(2))
    w = (torch.rand(n, generator=gen) + 0.5).bfloat16()

    def want(v):
        return w * torch.nn.functional.rms_norm(v.float(), (n,), eps=1e-5).to(v.dtype)

    for got, expect in ((ops.rms_norm(x, w, 1e-5), want(x)),
                        ops.add_rms_norm(x, d := delta.clone(), w, 1e-5)[1:] + (want(x + delta),)):
        ulps = bf16_ulps(got, expect)
        assert ulps.max() <= 2 and (ulps > 0).float().mean() < 0.05
    assert torch.equal(d, x + delta)  # the sum, written over delta
    xf, wf = x.float(), w.float()
    got = ops.rms_norm(xf[:, : n // 2], wf[: n // 2], 1e-6)  # a strided view of the rows
    ref = wf[: n // 2] * torch.nn.functional.rms_norm(xf[:, : n // 2], (n // 2,), eps=1e-6)
    assert torch.allclose(got, ref, rtol=2e-5, atol=1e-6)


@needs_ops
@pytest.mark.parametrize("rows,hq,hk,d", [(1, 9, 3, 64), (4, 8, 2, 128), (2, 4, 4, 32)])
def test_rope_store_equals_torch_bit_for_bit(rows, hq, hk, d):
    """Rotary embedding of q and k in place and the K/V write to shuffled slots, against
    ``addcmul(x cos, rotate_half(x), sin)`` in torch and ``index_copy_``."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    y = torch.randn(rows, (hq + 2 * hk) * d, generator=gen).bfloat16()
    ang = torch.rand(rows, d // 2, generator=gen) * 6.3
    cos, sin = (torch.cat((f(ang), f(ang)), -1).bfloat16() for f in (torch.cos, torch.sin))
    pair = torch.randn(2, 6, BS, hk, d, generator=gen).bfloat16()
    slots = torch.randperm(6 * BS, generator=gen)[:rows]
    want_pair, want_y = pair.clone(), y.clone()
    qk = want_y[:, :(hq + hk) * d].view(rows, hq + hk, d)
    half = d // 2
    rot = torch.cat((-qk[..., half:], qk[..., :half]), -1)
    qk.copy_(torch.addcmul(qk * cos[:, None], rot, sin[:, None]))  # torch.addcmul: one rounding
    want_pair.view(2, -1, hk, d).index_copy_(
        1, slots, want_y[:, hq * d:].view(rows, 2, hk, d).transpose(0, 1))
    ops.rope_store(y, cos, sin, pair, slots, hq, hk, d)
    assert torch.equal(y, want_y) and torch.equal(pair, want_pair)


def test_build_all_builds_every_source_into_the_cache(monkeypatch, tmp_path):
    if cpu_build._compiler() is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("LOCALGEN_KERNEL_CACHE", str(tmp_path))
    cpu_build.load.cache_clear()
    try:
        built = cpu_build.build_all()
        sources = {p.stem for p in cpu_build.CSRC.glob("*.c")}
        assert sources >= {"layer_ops_cpu", "paged_decode_cpu", "gguf_matmul"}
        assert built == dict.fromkeys(sources, True)
        assert sorted(p.name.split("-")[0] for p in tmp_path.glob("*.so")) == sorted(built)
    finally:
        cpu_build.load.cache_clear()
