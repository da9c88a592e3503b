"""Fused elementwise kernels (kernels/fused_norm.py, fused_rope.py, fused_act.py) vs float64
references, compiled on a GPU, else under the Triton interpreter: fresh random inputs each run,
outputs poisoned with NaN."""

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("kernel_device")

from localgen.kernels import fused_act, fused_norm, fused_rope  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite output (unwritten NaN poison?)"
    return float((out.double() - ref).norm() / ref.norm())


def _poison(t: torch.Tensor) -> torch.Tensor:
    return t.fill_(float("nan"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 4096])
@pytest.mark.parametrize("n", [1, 7, 33])
@pytest.mark.parametrize("with_res", [False, True])
def test_add_rms_norm(dtype, hidden, n, with_res):
    eps = 1e-5 if hidden == 4096 else 1e-6
    x = torch.randn(n, hidden, dtype=dtype) * 3
    res = torch.randn(n, hidden, dtype=dtype) if with_res else None
    w = (1 + 0.5 * torch.randn(hidden)).to(dtype)
    out = _poison(torch.empty_like(x))
    nres = _poison(torch.empty_like(x)) if with_res else None
    y, r = fused_norm.add_rms_norm(x, res, w, eps, out=out, residual_out=nres)
    assert y.data_ptr() == out.data_ptr() and y.dtype == dtype
    h64 = x.double() + (res.double() if with_res else 0)
    want = w.double() * h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + eps)
    assert rel_err(y, want) < TOL[dtype]
    if with_res:
        assert r.data_ptr() == nres.data_ptr()
        assert rel_err(r, h64) < TOL[dtype]
    else:
        assert r is x
    # the twin agrees too (it is what the CPU path runs)
    y_ref, _ = fused_norm.add_rms_norm_ref(x.double(), None if res is None else res.double(), w.double(), eps)
    assert rel_err(y_ref, want) < 1e-6  # float32 statistics, as HF


def test_add_rms_norm_default_outputs_and_3d():
    x, res = torch.randn(2, 3, 64), torch.randn(2, 3, 64)
    w = torch.rand(64)
    y, r = fused_norm.add_rms_norm(x, res, w, 1e-6)
    want, hw = fused_norm.add_rms_norm_ref(x.double(), res.double(), w.double(), 1e-6)
    assert y.shape == x.shape and rel_err(y, want) < 1e-5 and rel_err(r, hw) < 1e-6


def _positions(n):
    # spread over a long context: large angles exercise the float32 argument reduction
    return torch.randint(0, 100_000, (n,), dtype=torch.int64)


def _inv_freq(d, theta=10000.0):
    return 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d,heads,kv_heads", [(64, 9, 3), (128, 32, 8), (64, 4, 4)])
@pytest.mark.parametrize("n", [1, 7, 33])
def test_rope_qk(dtype, d, heads, kv_heads, n):
    # q/k as strided views of one fused qkv output, like the model's projection
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, dtype=dtype)
    q, k, _ = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k = q.view(n, heads, d), k.view(n, kv_heads, d)
    pos, inv = _positions(n), _inv_freq(d)
    want_q, want_k = fused_rope.rope_qk_ref(q.double(), k.double(), pos, inv)
    qo, ko = fused_rope.rope_qk(q, k, pos, inv)
    assert qo.shape == q.shape and ko.shape == k.shape and qo.dtype == dtype and qo.is_contiguous()
    assert rel_err(qo, want_q) < TOL[dtype] and rel_err(ko, want_k) < TOL[dtype]
    # precomputed cos/sin tables (float32) through the same kernel
    ang = pos.float()[:, None] * inv[None, :]
    emb = torch.cat((ang, ang), -1).double()
    qo2, ko2 = fused_rope.rope_qk_cos_sin(q, k, emb.cos().float(), emb.sin().float())
    assert rel_err(qo2, want_q) < TOL[dtype] and rel_err(ko2, want_k) < TOL[dtype]
    # in place: poison-free check that it writes into the views and leaves v alone
    v_before = qkv[:, (heads + kv_heads) * d:].clone()
    qi, ki = fused_rope.rope_qk(q, k, pos, inv, inplace=True)
    assert qi.data_ptr() == q.data_ptr() and ki.data_ptr() == k.data_ptr()
    assert rel_err(q, want_q) < TOL[dtype] and rel_err(k, want_k) < TOL[dtype]
    assert torch.equal(qkv[:, (heads + kv_heads) * d:], v_before)


def test_rope_ref_matches_model_rope():
    from localgen.models.rope import apply_rope, rope_cos_sin

    q, k = torch.randn(5, 4, 64, dtype=torch.float64), torch.randn(5, 2, 64, dtype=torch.float64)
    pos, inv = _positions(5), _inv_freq(64)
    cos, sin = rope_cos_sin(inv, pos, torch.float64)
    rq, rk = fused_rope.rope_qk_ref(q, k, pos, inv)
    assert torch.allclose(rq, apply_rope(q, cos, sin), atol=1e-6)  # torch: float32 cos
    assert torch.allclose(rk, apply_rope(k, cos, sin), atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1536, 1000])
@pytest.mark.parametrize("n", [1, 7, 33])
def test_silu_mul(dtype, inter, n):
    gate_up = torch.randn(n, 2 * inter, dtype=dtype) * 4
    g, u = gate_up.double().chunk(2, -1)
    want = torch.nn.functional.silu(g) * u
    out = fused_act.silu_mul_fused(gate_up)
    assert out.shape == (n, inter) and out.dtype == dtype
    assert rel_err(out, want) < TOL[dtype]
    assert rel_err(fused_act.silu_mul_ref(g, u), want) < 1e-12


def _tiny_llama(dtype, act="silu", fused_weights=True, heads=4, kv_heads=2, d=32, hidden=96, inter=160):
    from types import SimpleNamespace

    from localgen.models import llama

    cfg = SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads, head_dim=d, q_size=heads * d,
                          kv_size=kv_heads * d, norm_eps=1e-6, activation=act)
    g = lambda *s: (torch.randn(*s) * s[-1] ** -0.5).to(dtype)  # noqa: E731
    w = {"input_norm": (1 + 0.1 * torch.randn(hidden)).to(dtype),
         "post_norm": (1 + 0.1 * torch.randn(hidden)).to(dtype),
         "q": g(heads * d, hidden), "k": g(kv_heads * d, hidden), "v": g(kv_heads * d, hidden),
         "o": g(hidden, heads * d), "gate": g(inter, hidden), "up": g(inter, hidden),
         "down": g(hidden, inter)}
    return cfg, (llama.fuse_weights(cfg, w) if fused_weights else w)


def _kv_meta(n, kv_heads, d, dtype):
    from localgen.kv.attention import AttentionMetadata, LayerKV

    bs, nb = 16, -(-n // 16)
    kv = LayerKV(torch.zeros(nb, bs, kv_heads, d, dtype=dtype), torch.zeros(nb, bs, kv_heads, d, dtype=dtype))
    meta = AttentionMetadata(True, torch.arange(n), torch.arange(nb)[None], torch.tensor([n]), [n], [n])
    return kv, meta


@pytest.mark.parametrize("act,fused_weights", [("silu", True), ("silu", False), ("gelu_pytorch_tanh", True)])
def test_llama_fused_path_matches_torch_path(act, fused_weights):
    """The model wiring: forward_layers (carried residual, RotaryPositions) and layer's fused branch
    vs the torch layer path, in float32 (on CPU under the interpreter)."""
    from localgen.models import llama
    from localgen.models.rope import RotaryPositions, rope_cos_sin

    dtype, n, nl = torch.float32, 9, 2
    layers = [_tiny_llama(dtype, act, fused_weights) for _ in range(nl)]
    cfg = layers[0][0]
    ws = [w for _, w in layers]
    h0 = torch.randn(n, 96, dtype=dtype)
    pos = torch.arange(3, 3 + n)
    inv = _inv_freq(cfg.head_dim)
    cs = rope_cos_sin(inv, pos, dtype)

    gw = {"norm": ws[0]["post_norm"], "embed": torch.randn(50, 96)}
    want = h0
    orig = llama.fused_enabled
    llama.fused_enabled = lambda h: False  # the torch path, on a GPU too
    try:
        for w in ws:
            want = llama.layer(cfg, w, want, cs, *_kv_meta(n, 2, cfg.head_dim, dtype))
        want_lg = llama.logits(cfg, gw, want)
    finally:
        llama.fused_enabled = orig
    kvs = [_kv_meta(n, 2, cfg.head_dim, dtype) for _ in ws]
    got = llama.forward_layers(cfg, ws, h0, RotaryPositions(pos, inv), [kv for kv, _ in kvs], kvs[0][1])
    assert rel_err(got, want.double()) < 1e-5
    # layer()'s fused branch with (cos, sin) tables, as the offload runner calls it
    llama.fused_enabled = lambda h: True
    try:
        got2 = h0
        for w in ws:
            got2 = llama.layer(cfg, w, got2, cs, *_kv_meta(n, 2, cfg.head_dim, dtype))
        lg = llama.logits(cfg, gw, got2)
    finally:
        llama.fused_enabled = orig
    assert rel_err(got2, want.double()) < 1e-5
    assert rel_err(lg, want_lg.double()) < 1e-5
