"""The paged Triton kernels' sliding window, logit soft-cap and sinks (``kernels/score_features``)
against the float64 reference twin (``paged_attention_ref.paged_feature_attention``, itself
checked against a hand-written softmax in tests/test_attention_backends.py), through every
decode case (single pass, fused and unfused split, synchronized and asynchronized softmax), the
4-bit cache's decode and the prefill, with GQA; the Triton backend against the reference backend
on the same steps; and the backend choice for such specs on CUDA. Compiled on a GPU, else under
the Triton interpreter (tests/conftest.py), at small sizes.

Keys before each query's window are poisoned with NaN, and whole KV blocks behind it are pointed
at a shared NaN block (what the block manager does with the blocks it gives back): a kernel that
read one would return NaN.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from localgen.attention import select  # noqa: E402
from localgen.attention.reference import TorchReferenceBackend  # noqa: E402
from localgen.attention.spec import AttentionSpec  # noqa: E402
from localgen.kernels import paged_attention_ref as ref  # noqa: E402
from localgen.kernels import quant_ref as qr  # noqa: E402
from localgen.kernels.paged_decode import (paged_decode_attention,  # noqa: E402
                                           paged_decode_attention_int4)
from localgen.kernels.paged_prefill import paged_prefill_attention  # noqa: E402
from tests.conftest import KERNEL_DEVICE  # noqa: E402
from tests.test_attention_backends import D, Steps, paged_view, run  # noqa: E402
from tests.test_families_dense import reference  # noqa: E402,F401  (transformers' tokens)
from tests.test_kernels import (BS, TOL, decode_case, make_cache, make_q,  # noqa: E402
                                make_tables, rel_err)

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 32  # GQA: four query heads per KV head
SCALE = HEAD_DIM ** -0.5
# window starts at a KV block edge (48 - 16 = 32), one past it (33), one before (47), and a
# context shorter than the window (5)
DECODE_LENS = [5, 48, 49, 63]


def features(name: str, heads: int = HEADS) -> dict:
    """The kernels' keyword arguments of one named case."""
    sinks = torch.linspace(-2.0, 3.0, heads)  # some heads' sinks dominate their rows
    return {"window-edges": dict(sliding_window=16),  # starts at, after and before a block edge
            "window-mid-block": dict(sliding_window=21),
            "window-one": dict(sliding_window=1),  # each query sees only itself
            "window-longer": dict(sliding_window=500),
            "softcap": dict(logit_softcap=1.5),
            "sinks": dict(sinks=sinks),
            "all": dict(sliding_window=24, logit_softcap=2.0, sinks=sinks)}[name]


CASES = ["window-edges", "window-mid-block", "window-one", "window-longer", "softcap", "sinks",
         "all"]


def poison_behind_window(k, v, bt, first_seen: list[int]):
    """NaN at every position of sequence i before ``first_seen[i]``; its table's entries for KV
    blocks wholly before it point at one spare block of NaN. Returns the new table."""
    bt = bt.clone()
    spare = sorted(set(range(k.shape[0])) - set(bt.flatten().tolist()))[0]
    for cache in (k, v):
        cache[spare] = float("nan")
    for i, first in enumerate(first_seen):
        for p in range(first):
            for cache in (k, v):
                cache[int(bt[i, p // BS]), p % BS] = float("nan")
        bt[i, :first // BS] = spare
    return bt


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("softmax", ["sync", "async"])
def test_decode_features_match_float64(seed, kernel_device, case, softmax):
    """Single pass, fused split and unfused split (three splits: with a window some splits of a
    short span have no keys) within float32 rounding of the reference, with the keys behind the
    window poisoned."""
    kw = features(case)
    q, k, v, bt, cl = decode_case(torch.float32, HEADS, KV_HEADS, HEAD_DIM, DECODE_LENS)
    want = ref.paged_feature_attention(q.double(), k.double(), v.double(), bt, DECODE_LENS,
                                       [1] * len(DECODE_LENS), SCALE, **kw)
    window = kw.get("sliding_window")
    bt = poison_behind_window(k, v, bt, [max(0, n - window) if window else 0 for n in DECODE_LENS])
    phi = 0.0 if softmax == "async" else None
    for splits, fused in ((1, True), (3, True), (3, False)):
        got = paged_decode_attention(q, k, v, bt, cl, SCALE, phi=phi, num_splits=splits,
                                     fused=fused, block_n=16, out=torch.full_like(q, float("nan")),
                                     **kw)
        assert rel_err(got, want) < TOL[torch.float32], f"seed={seed} splits={splits} fused={fused}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 1)])  # MHA, MQA
def test_decode_features_in_16_bit(seed, kernel_device, dtype, heads, kv_heads):
    kw = features("all", heads)
    q, k, v, bt, cl = decode_case(dtype, heads, kv_heads, HEAD_DIM, DECODE_LENS)
    want = ref.paged_feature_attention(q.double(), k.double(), v.double(), bt, DECODE_LENS,
                                       [1] * len(DECODE_LENS), SCALE, **kw)
    got = paged_decode_attention(q, k, v, bt, cl, SCALE, num_splits=2, block_n=16, **kw)
    assert rel_err(got, want) < TOL[dtype], f"seed={seed}"


def test_async_softmax_recomputes_rows_a_sink_would_overflow(seed, kernel_device):
    """A sink far above the unified max lies outside the safe range: its rows are flagged and
    recomputed synchronously, and stay exact; rows whose sinks are in range are not flagged."""
    q, k, v, bt, cl = decode_case(torch.float32, HEADS, KV_HEADS, HEAD_DIM, DECODE_LENS)
    sinks = torch.zeros(HEADS)
    sinks[:HEADS // KV_HEADS] = 70.0  # KV head 0's query heads: e^70 is past the bound e^64
    want = ref.paged_feature_attention(q.double(), k.double(), v.double(), bt, DECODE_LENS,
                                       [1] * len(DECODE_LENS), SCALE, sinks=sinks)
    for splits in (1, 3):
        got, flags = paged_decode_attention(q, k, v, bt, cl, SCALE, phi=0.0, num_splits=splits,
                                            block_n=16, sinks=sinks, return_flags=True)
        assert rel_err(got, want) < TOL[torch.float32], f"seed={seed} splits={splits}"
        assert flags[:, :HEADS // KV_HEADS].all() and not flags[:, HEADS // KV_HEADS:].any()


def test_window_longer_than_every_context_is_the_plain_kernel(seed, kernel_device):
    """Same tiles, same splits: bit for bit the launch without a window."""
    q, k, v, bt, cl = decode_case(torch.float32, HEADS, KV_HEADS, HEAD_DIM, DECODE_LENS)
    for splits in (1, 3):
        plain = paged_decode_attention(q, k, v, bt, cl, SCALE, num_splits=splits, block_n=16)
        long = paged_decode_attention(q, k, v, bt, cl, SCALE, num_splits=splits, block_n=16,
                                      sliding_window=max(DECODE_LENS))
        assert torch.equal(plain, long), f"seed={seed} splits={splits}"


@pytest.mark.parametrize("case", ["window-edges", "window-one", "all"])
@pytest.mark.parametrize("softmax", ["sync", "async"])
def test_int4_decode_features_with_own_blocks_in_the_pool(seed, kernel_device, case, softmax):
    """The 4-bit cache (FlexGen §5) with each sequence's last KV block read from the fp pool
    (one sequence without a pool row): the window's first key may fall in a 4-bit block or in
    the pool's block, against the reference over the same dequantized and pooled values."""
    kw = features(case)
    q, k, v, bt, cl = decode_case(torch.bfloat16, HEADS, KV_HEADS, HEAD_DIM, DECODE_LENS)
    qk, qv = qr.quantize_kv(k), qr.quantize_kv(v)
    kd, vd = qr.dequantize_kv(qk, torch.float64), qr.dequantize_kv(qv, torch.float64)
    pool_k, pool_v = (torch.randn(len(DECODE_LENS), BS, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
                      for _ in "kv")
    rows = torch.arange(len(DECODE_LENS)).flip(0)
    rows[1] = -1
    for i, (row, n) in enumerate(zip(rows.tolist(), DECODE_LENS)):
        if row >= 0:
            blk, m = int(bt[i, (n - 1) // BS]), (n - 1) % BS + 1
            kd[blk, :m], vd[blk, :m] = pool_k[row, :m].double(), pool_v[row, :m].double()
    want = ref.paged_feature_attention(q.double(), kd, vd, bt, DECODE_LENS,
                                       [1] * len(DECODE_LENS), SCALE, **kw)
    for splits, fused in ((1, True), (3, True), (3, False)):
        got = paged_decode_attention_int4(q, qk, qv, bt, cl, SCALE, num_splits=splits,
                                          fused=fused, block_n=16,
                                          phi=0.0 if softmax == "async" else None,
                                          own_k=pool_k, own_v=pool_v, own_rows=rows, **kw)
        assert rel_err(got, want) < 1e-2, f"seed={seed} splits={splits} fused={fused}"


@pytest.mark.parametrize("case", CASES)
def test_prefill_features_match_float64(seed, kernel_device, case):
    """A fresh prompt, new tokens after a cached prefix, and one token: query blocks of 16 whose
    rows' windows start at different keys; keys behind the first query's window poisoned."""
    kw = features(case)
    ctx, ql = [40, 70, 33], [40, 23, 1]
    nb = sum(-(-n // BS) for n in ctx) + 3
    k = make_cache(nb, KV_HEADS, HEAD_DIM, torch.float32)
    v = make_cache(nb, KV_HEADS, HEAD_DIM, torch.float32)
    q = make_q(sum(ql), HEADS, HEAD_DIM, torch.float32)
    bt = make_tables(ctx, nb)
    want = ref.paged_feature_attention(q.double(), k.double(), v.double(), bt, ctx, ql, SCALE, **kw)
    window = kw.get("sliding_window")
    bt = poison_behind_window(k, v, bt, [max(0, c - n - window + 1) if window else 0
                                         for c, n in zip(ctx, ql)])
    got = paged_prefill_attention(q, k, v, bt, ctx, ql, SCALE, block_m=16, block_n=16,
                                  out=torch.full_like(q.contiguous(), float("nan")), **kw)
    assert rel_err(got, want) < TOL[torch.float32], f"seed={seed}"


def test_prefill_features_in_bf16(seed, kernel_device):
    kw = features("all", 4)
    ctx, ql = [37, 50], [37, 20]
    nb = sum(-(-n // BS) for n in ctx) + 3
    k, v = (make_cache(nb, 1, HEAD_DIM, torch.bfloat16) for _ in "kv")
    q = make_q(sum(ql), 4, HEAD_DIM, torch.bfloat16)
    bt = make_tables(ctx, nb)
    want = ref.paged_feature_attention(q.double(), k.double(), v.double(), bt, ctx, ql, SCALE, **kw)
    got = paged_prefill_attention(q, k, v, bt, ctx, ql, SCALE, block_m=16, block_n=16, **kw)
    assert rel_err(got, want) < TOL[torch.bfloat16], f"seed={seed}"


def test_bad_features_are_refused(kernel_device):
    q, k, v, bt, cl = decode_case(torch.float32, HEADS, KV_HEADS, HEAD_DIM, [5])
    for kw, match in ((dict(sliding_window=0), "sliding_window"),
                      (dict(logit_softcap=0.0), "logit_softcap"),
                      (dict(sinks=torch.zeros(HEADS + 1)), r"sinks must be a float \[8\]")):
        with pytest.raises(ValueError, match=match):
            paged_decode_attention(q, k, v, bt, cl, SCALE, **kw)
        with pytest.raises(ValueError, match=match):
            paged_prefill_attention(q, k, v, bt, [5], [1], SCALE, **kw)


# ---- the backend ---------------------------------------------------------------------------

SPECS = {"window-inside-a-block": dict(sliding_window=3),  # test_attention_backends: 4-token blocks
         "window-of-two-blocks": dict(sliding_window=8),
         "softcap": dict(logit_softcap=0.5),
         "all": dict(sliding_window=5, logit_softcap=1.0,
                     sinks=torch.tensor([1.0, 1.0, -2.0, 0.3]))}


@pytest.mark.parametrize("name", SPECS)
def test_triton_backend_computes_spec_features_like_the_reference(name):
    """Prefill, prefill over a cached prefix, then decode steps past the window, through
    ``LayerKV.attend`` with each backend."""
    from localgen.attention.triton import TritonPagedBackend

    spec = AttentionSpec(D ** -0.5, **SPECS[name])
    outputs = []
    for backend, device in ((TritonPagedBackend(), KERNEL_DEVICE),
                            (TorchReferenceBackend(), "cpu")):
        view = paged_view(64, device=device)
        view.backend = backend
        steps = Steps([7, 13], decodes=5, seed=5, device=device)
        outputs.append(run(lambda q, k, v, meta: view.attend(q, k, v, meta, spec), steps))
    for got, want in zip(*outputs):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_cuda_keeps_the_triton_backend_for_every_spec_feature():
    """The choice only (no tensor moves to the GPU): windows, soft-caps and sinks no longer send
    a CUDA model to the reference, and nothing is refused."""
    from localgen.attention.triton import TritonPagedBackend

    specs = [AttentionSpec(0.1), *(AttentionSpec(0.1, **kw) for kw in SPECS.values())]
    for spec in specs:
        assert TritonPagedBackend().supports(spec)
    chosen = select.select_backend(torch.device("cuda", 0), torch.bfloat16, specs, fallback=False)
    assert type(chosen) is TritonPagedBackend


# ---- whole models ----------------------------------------------------------------------------

@pytest.fixture
def load_on_triton(monkeypatch):
    """``load(path)``: an LLM whose paged layers attend through the Triton backend, on the
    kernels' device: chosen by ``select_backend`` on CUDA, forced on the CPU (the interpreter)."""
    from localgen.api import LLM
    from localgen.attention.triton import TritonPagedBackend

    if KERNEL_DEVICE.type == "cpu":
        monkeypatch.setattr("localgen.runtime.model_runner.select_backend",
                            lambda *a, **kw: TritonPagedBackend())

    def load(path):
        llm = LLM.load(str(path), device=KERNEL_DEVICE.type, dtype="float32",
                       kv_cache_memory=1 << 22, block_size=4)
        assert type(llm.engine.runner.attention) is TritonPagedBackend
        return llm
    return load


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "mistral"])
def test_windowed_and_capped_families_give_transformers_tokens(reference, load_on_triton, name):
    """Gemma 2 (window, soft-cap), Gemma 3 (sliding and full layers, MQA), Mistral (window in
    every layer, KV blocks behind it given back): windows of 8 tokens over 4-token KV blocks
    under 20-token prompts, greedy tokens equal to transformers'."""
    from tests.test_families_dense import _greedy, _path

    assert _greedy(load_on_triton(_path(name, "hf"))) == reference(name)[1]


def test_gpt_oss_sinks_give_transformers_tokens(tmp_path, load_on_triton):
    """gpt-oss: sinks in every layer, a sliding layer and a full one."""
    from tests.test_families_moe import GPT_OSS, _variant_dir, assert_greedy_equal, hf_model

    path = _variant_dir(tmp_path, GPT_OSS)
    assert_greedy_equal(load_on_triton(path), hf_model("", path))
