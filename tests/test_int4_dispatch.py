"""Int4 linears through the FlashDecoding++ §5 dispatcher (issue 5, "one call site") at small shapes:
compiled on a GPU, else on the CPU under the Triton interpreter.

Both weight layouts (FlexGen g=64 along the output channels; GGUF Q4_1 g=32 along the input
channels, including real Q4_1 bytes through the importer) and every implementation the dispatcher
picks by M (flat, tiled, torch, and the reference twin off CUDA) are compared with a float64
``x @ dequant(W).T`` on inputs drawn fresh each run (the seed is in every failure message), into
outputs poisoned with NaN. The routing decision is a pure function (``dispatch.route``,
``int4.keeps_packed``) and is tested as such; the model-level call site is checked by running the
offloaded model with the CUDA decision forced (in the interpreter a CPU tensor counts as CUDA) and
counting the dispatcher's calls.
"""

from __future__ import annotations

import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("kernel_device")

from localgen.kernels import dispatch  # noqa: E402
from localgen.kernels.dispatch import (DEFAULT_POINTS, REFERENCE, GemmDispatchTable,  # noqa: E402
                                       Int4Linear, route)
from localgen.kernels.flat_gemm import flat_gemm_int4  # noqa: E402
from localgen.quant import int4  # noqa: E402
from localgen.quant.gguf_import import q4_1_blocks_to_int4  # noqa: E402

TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-5}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out.double() - ref).norm() / ref.norm())


def weight(layout: str, n: int, k: int) -> int4.Int4Tensor:
    w = torch.randn(n, k)
    if layout == "n64":
        return int4.quantize(w, 64, dim=0)
    return int4.quantize(w, 32, dim=1)


def random_q4_1(n: int, k: int) -> int4.Int4Tensor:
    """Random Q4_1 blocks as llama.cpp stores them, through the GGUF importer."""
    nb = k // 32
    raw = np.random.randint(0, 256, (n, nb, 20), dtype=np.uint8)
    raw[..., 0:2] = np.random.uniform(0.01, 0.1, (n, nb)).astype(np.float16)[..., None].view(np.uint8)
    raw[..., 2:4] = np.random.uniform(-0.8, 0.0, (n, nb)).astype(np.float16)[..., None].view(np.uint8)
    return q4_1_blocks_to_int4(raw.reshape(n, nb * 20), n, k).to(torch.get_default_device())


def want(x: torch.Tensor, t: int4.Int4Tensor) -> torch.Tensor:
    return x.double() @ int4.dequantize(t, torch.float64).t()


# ---- the kernel, both layouts --------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["n64", "k32", "q4_1"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,block_m,split_k", [(1, 16, 1), (7, 16, 2), (33, 64, 1)])
def test_flat_gemm_both_layouts(seed, layout, dtype, m, block_m, split_k):
    n, k = 192, 160  # 3 N-groups of 64 / 5 K-groups of 32; K not a multiple of BLOCK_K
    t = random_q4_1(n, k) if layout == "q4_1" else weight(layout, n, k)
    assert t.dim == (0 if layout == "n64" else 1)
    x = torch.randn(m, 2 * k, dtype=dtype)[:, ::2]  # strided activations
    out = torch.full((m, n), float("nan"), dtype=dtype)
    got = flat_gemm_int4(x, t, block_m=block_m, split_k=split_k, out=out)
    assert got.data_ptr() == out.data_ptr() and got.dtype == dtype
    assert rel_err(got, want(x, t)) < 2 * TOL[dtype], f"seed={seed}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k,m,block_m,block_n,block_k,split_k", [
    (200, 192, 3, 16, 64, 128, 1),  # N tail: 8 rows past the last full tile; a short last group
    (96, 256, 17, 16, 32, 256, 1),  # two M tiles; a tile of 32 rows inside a group of 64
    (64, 64, 1, 16, 32, 64, 1),
    (200, 256, 16, 16, 32, 64, 3),  # K slices summed in the kernel (the last slice of a tile)
    (96, 192, 33, 64, 64, 256, 2),  # the tiled configuration; K tail inside a slice
    (96, 64, 2, 16, 16, 64, 1),  # a tile under the 16x16 dot: the general kernel
])
def test_flat_gemm_flexgen_row_pairs(seed, dtype, n, k, m, block_m, block_n, block_k, split_k):
    """FlexGen layout: each packed byte row feeds two output rows (low nibble 2i, high 2i + 1)
    with one scale/min row per tile, at tails in N, K and M, with K slices, into a poisoned
    ``out``; strided activations."""
    t = weight("n64", n, k)
    x = torch.randn(m, 2 * k, dtype=dtype)[:, ::2]
    out = torch.full((m, n), float("nan"), dtype=dtype)
    got = flat_gemm_int4(x, t, block_m=block_m, block_n=block_n, block_k=block_k,
                         split_k=split_k, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert rel_err(got, want(x, t)) < TOL[dtype], f"seed={seed}"
    assert rel_err(flat_gemm_int4(x.contiguous(), t, block_n=block_n, block_k=block_k,
                                  split_k=split_k), want(x, t)) < TOL[dtype], f"seed={seed}"


def test_choose_split_k_fills_the_gpu():
    from localgen.kernels.flat_gemm import choose_split_k
    assert choose_split_k(1, 4096, 4096, 132) == 1  # 128 tiles: splitting measured slower
    assert choose_split_k(1, 4096, 11008, 132) == 2  # long K: ~1 program per SM
    assert choose_split_k(1, 1024, 16384, 132) == 4  # 32 tiles, at least 4096 of K per slice
    assert choose_split_k(1, 22016, 4096, 132) == 1  # 688 tiles already
    assert choose_split_k(64, 4096, 11008, 132, block_m=64) == 2  # 128 tiles
    assert choose_split_k(128, 4096, 11008, 132, block_m=64) == 1  # 256 tiles
    assert choose_split_k(1, 64, 96, 132) == 1


# ---- the routing decision (pure) -----------------------------------------------------------------

def test_route_is_a_pure_function_of_device_m_shape_table():
    table = GemmDispatchTable({(256, 128): (8, 64), (256, 128, 1): (2, 4)})
    got = [route("cuda", m, 256, 128, table) for m in (1, 8, 9, 64, 65, 4096)]
    assert got == ["flat", "flat", "tiled", "tiled", "torch", "torch"]
    # the GGUF layout has its own points for this shape; a shape without them uses layout 0's
    assert [route("cuda", m, 256, 128, table, 1) for m in (2, 3, 4, 5)] == \
        ["flat", "tiled", "tiled", "torch"]
    assert route("cuda", 9, 512, 128, GemmDispatchTable({(512, 128): (8, 64)}), 1) == "tiled"
    # shapes not in the table: DEFAULT_POINTS (16, 2048)
    m1, m2 = DEFAULT_POINTS
    assert [route("cuda", m, 7, 7, table) for m in (1, m1, m1 + 1, m2, m2 + 1)] == \
        ["flat", "flat", "tiled", "tiled", "torch"]
    for dev in ("cpu", "mps", "meta"):
        assert {route(dev, m, 256, 128, table) for m in (1, 9, 65)} == {REFERENCE}
    rt = GemmDispatchTable.from_json(json.loads(json.dumps(table.to_json())))
    assert rt.entries == table.entries and rt.default == table.default


def test_keeps_packed_only_on_cuda_with_triton():
    assert int4.keeps_packed("cuda", triton_ok=True)
    assert not int4.keeps_packed("cuda", triton_ok=False)
    assert not int4.keeps_packed("cpu", triton_ok=True)
    assert int4.keeps_packed("cpu") is False


def test_gemm_table_from_file_else_default(tmp_path, monkeypatch):
    int4.gemm_table.cache_clear()
    monkeypatch.delenv(int4.GEMM_TABLE_ENV, raising=False)
    t = int4.gemm_table("no such GPU", "bfloat16")
    assert t.entries == {} and t.points(4096, 4096) == DEFAULT_POINTS
    path = tmp_path / "gemm.json"
    GemmDispatchTable({(4096, 4096): (4, 32), (4096, 4096, 1): (8, 256)}, device_name="X").save(path)
    monkeypatch.setenv(int4.GEMM_TABLE_ENV, str(path))
    int4.gemm_table.cache_clear()
    t = int4.gemm_table("X", "bfloat16")
    assert t.points(4096, 4096) == (4, 32) and t.points(4096, 4096, 1) == (8, 256)
    assert t.points(11008, 4096) == DEFAULT_POINTS
    int4.gemm_table.cache_clear()


def test_shipped_gemm_profiles_parse():
    """Every ``profiles/gemm_*.json`` loads as a table (the GPU command writes them there)."""
    from importlib import resources
    for p in resources.files("localgen.profiles").iterdir():
        if p.name.startswith("gemm_") and p.name.endswith(".json"):
            d = json.loads(p.read_text())
            t = GemmDispatchTable.from_json(d)
            assert d["device_name"] and all(a <= b for a, b in t.entries.values()), p.name


# ---- Int4Linear: every implementation the dispatcher picks ---------------------------------------

@pytest.mark.parametrize("layout", ["n64", "k32", "q4_1"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int4_linear_every_impl(seed, layout, dtype, monkeypatch):
    n, k = 128, 96
    t = random_q4_1(n, k) if layout == "q4_1" else weight(layout, n, k)
    table = GemmDispatchTable({(n, k): (2, 4)})
    lin = int4.as_linear(t, dtype, table)
    assert isinstance(lin, Int4Linear) and lin.shape == (n, k)
    seen = set()
    for m, impl in ((1, "flat"), (2, "flat"), (3, "tiled"), (4, "tiled"), (6, "torch"), (17, "torch")):
        x = torch.randn(m, k, dtype=dtype)
        assert lin.route(x) == impl  # interpreter: a CPU tensor counts as CUDA
        out = torch.full((m, n), float("nan"), dtype=dtype)
        got = lin.run(impl, x, out=out)
        assert got.data_ptr() == out.data_ptr()
        assert rel_err(got, want(x, t)) < 2 * TOL[dtype], f"seed={seed} m={m} {impl}"
        seen.add(impl)
        # the call form the layer functions use: leading dims and a bias
        b = torch.randn(n, dtype=dtype)
        y = lin(x.view(1, m, k), b)
        assert y.shape == (1, m, n)
        assert rel_err(y[0], want(x, t) + b.double()) < 2 * TOL[dtype], f"seed={seed} m={m}"
    assert seen == set(dispatch.IMPLS)
    if t.packed.is_cuda:
        return
    # off CUDA (no interpreter) every M takes the reference twin
    monkeypatch.setattr(dispatch, "_interpreting", lambda: False)
    x = torch.randn(3, k, dtype=dtype)
    assert lin.route(x) == REFERENCE
    out = torch.full((3, n), float("nan"), dtype=dtype)
    assert rel_err(lin.run(REFERENCE, x, out=out), want(x, t)) < 2 * TOL[dtype], f"seed={seed}"
    assert lin._dense is None  # as_linear never keeps a dense copy


@pytest.mark.parametrize("layout", ["n64", "k32", "q4_1"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k", [(128, 96), (70, 160), (192, 64)])
def test_dequant_kernel_equals_the_reference(seed, layout, dtype, n, k):
    """The Triton dequantization (the "torch" impl's first half on CUDA) against the torch twin:
    equal up to the last bit of ``dtype`` (the kernel may fuse the multiply-add), shapes that cut
    the kernel's tiles and a last, shorter group (N = 70 with g = 64), into NaN-free output."""
    from localgen.kernels.dequant import dequantize_weight
    from localgen.kernels.quant_ref import dequantize_weight as reference

    if layout == "q4_1" and k % 32:
        pytest.skip("Q4_1 blocks are 32 wide")
    t = random_q4_1(n, k) if layout == "q4_1" else weight(layout, n, k)
    got, ref = dequantize_weight(t, dtype), reference(t, dtype)
    assert got.shape == (n, k) and got.dtype == dtype and torch.isfinite(got).all()
    ulp = torch.finfo(dtype).eps * ref.float().abs().clamp_min(1e-3)
    assert ((got.float() - ref.float()).abs() <= ulp).all(), f"seed={seed}"


# ---- the call site: offloaded layers ------------------------------------------------------------

def _layer_weights(device_type_packed: bool, monkeypatch, layers):
    from localgen.runtime.offload import weights as ow
    from localgen.runtime.offload.timers import Timers

    monkeypatch.setattr(ow, "keeps_packed", lambda dev: device_type_packed)
    cpu = torch.device("cpu")
    return ow.LayerWeights(layers, ["cpu"] * len(layers), torch.float32, cpu, None, Timers(cpu))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="forces the CUDA decision on CPU tensors: the interpreter's case")
def test_unpack_layer_routes_both_layouts(seed, monkeypatch):
    """``LayerWeights.get`` keeps 4-bit matrices packed behind the dispatcher when the device
    decision says so (CUDA), dequantizes them otherwise (CPU: unchanged); both give x @ W.T."""
    layer = {"q": weight("n64", 128, 64), "down": random_q4_1(64, 96), "norm": torch.randn(64)}
    dense = _layer_weights(False, monkeypatch, [layer]).get(0)
    assert all(isinstance(v, torch.Tensor) for v in dense.values())
    packed = _layer_weights(True, monkeypatch, [layer]).get(0)
    assert isinstance(packed["q"], Int4Linear) and isinstance(packed["down"], Int4Linear)
    assert packed["q"].group_dim == 0 and packed["down"].group_dim == 1
    assert isinstance(packed["norm"], torch.Tensor)
    for key, k in (("q", 64), ("down", 96)):
        for m in (1, 5, 200):  # flat, flat, torch under DEFAULT_POINTS
            x = torch.randn(m, k)
            ref = want(x, layer[key])
            assert rel_err(packed[key](x), ref) < 2e-5, f"seed={seed} {key} m={m}"
            assert rel_err(torch.nn.functional.linear(x, dense[key]), ref) < 2e-5


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="forces the CUDA decision on CPU tensors: the interpreter's case")
@pytest.mark.parametrize("variant", ["llama3", "opt"])
def test_model_call_site_goes_through_the_dispatcher(tmp_path, monkeypatch, variant):
    """The offloaded model with 4-bit weights and the CUDA decision forced: every layer matrix
    call goes through ``dispatch.route`` (decode steps take the flat kernel, prefill the tiled
    kernel or dequantize + matmul by the table), and the logits match the dequantize-first path."""
    from localgen.api import Request, SamplingParams
    from localgen.models.sources import resolve_model
    from localgen.policy import Policy
    from localgen.runtime.engine import EngineConfig
    from localgen.runtime.offload import weights as ow
    from tests.tiny_models import make_hf_model

    src = resolve_model(str(make_hf_model(tmp_path, variant)))
    cfg = EngineConfig(block_size=4, kv_cache_memory=1 << 22, max_num_seqs=4)
    pol = Policy(gbs=2, num_gpu_batches=1, wg=1, wc=0, wd=0, cg=1, cc=0, cd=0, hg=1, hc=0,
                 compress_weight=True).validate()
    table = tmp_path / "gemm.json"
    GemmDispatchTable(default=(2, 20)).save(table)  # small points so a tiny prompt reaches "torch"
    monkeypatch.setenv(int4.GEMM_TABLE_ENV, str(table))
    int4.gemm_table.cache_clear()
    g = torch.Generator().manual_seed(random.randrange(1 << 31))
    prompts = [torch.randint(6, 300, (n,), generator=g).tolist() for n in (3, 30)]
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)

    def run(packed: bool):
        from localgen.api import LLM
        monkeypatch.setattr(ow, "keeps_packed", lambda dev: packed)
        llm = LLM.from_parts(src.config, src.weights, src.tokenizer, cfg, device="cpu", policy=pol)
        eng = llm.engine
        for p in prompts:
            eng.add_request(Request(prompt_token_ids=p, sampling=sp))
        pre = eng.runner.run(eng.scheduler.schedule().seqs, True)
        return pre, llm

    calls = []
    real = dispatch.route
    monkeypatch.setattr(dispatch, "route", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    ref, _ = run(False)
    assert calls == []  # the CPU path dequantizes up front
    got, llm = run(True)
    try:
        # one call per 4-bit matrix of each layer: Llama's gate/up fused into one, q/k/v too
        # where their row counts are whole groups (not this Llama's 32-row k and v; this OPT's
        # 64-row ones): Llama q, k, v, o, gate_up, down; OPT qkv, o, fc1, fc2
        qmeta = llm.engine.model.layers.qmeta
        assert all(("gate_up" in meta) == (variant == "llama3") for meta in qmeta)
        assert all(("qkv" in meta) == (variant == "opt") for meta in qmeta)
        per_pass = sum(len(meta) for meta in qmeta)
        assert per_pass == (6 if variant == "llama3" else 4) * src.config.num_layers
        assert len(calls) == per_pass  # one prefill pass over the packed batch
        assert {a[1] for a in calls} == {33}  # M = 3 + 30 tokens
        assert {real(*a) for a in calls} == {"torch"}
        assert rel_err(got, ref.double()) < 1e-4
        # whole generations: prefill passes and decode steps (M = 1 or 2: the flat kernel)
        calls.clear()
        monkeypatch.setattr(ow, "keeps_packed", lambda dev: True)
        from localgen.api import LLM
        llm = LLM.from_parts(src.config, src.weights, src.tokenizer, cfg, device="cpu", policy=pol)
        outs = llm.generate([Request(prompt_token_ids=p, sampling=sp) for p in prompts])
        assert all(len(o.token_ids) == 3 for o in outs)
        assert calls and len(calls) % per_pass == 0
        ms = {a[1] for a in calls}
        assert ms & {1, 2} and {real(*a) for a in calls if a[1] <= 2} == {"flat"}
    finally:
        int4.gemm_table.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k,m,split_k", [(200, 192, 3, 1), (200, 256, 16, 3), (96, 64, 2, 1)])
def test_flat_gemm_bias_in_the_store_equals_a_separate_add(seed, dtype, n, k, m, split_k):
    """The FlexGen kernel's bias, added as it stores (rounded product + bias, rounded), gives
    ``y + bias`` bit for bit: at an N tail, with K slices, and (96 x 64, 16-row tiles) through
    the general kernel's separate add. bf16 within one bf16 step: the interpreter's float32 ->
    bf16 conversion does not round as torch's does (the GPU's cvt.rn does)."""
    t = weight("n64", n, k)
    x = torch.randn(m, k, dtype=dtype)
    bias = torch.randn(n, dtype=dtype)
    kw = dict(block_n=64 if n == 200 else 16, block_k=64, split_k=split_k)
    plain = flat_gemm_int4(x, t, **kw)
    got = flat_gemm_int4(x, t, bias=bias, **kw)
    want = plain + bias
    if dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        steps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
        assert steps.max() <= 1, f"seed={seed}"
    else:
        assert torch.equal(got, want), f"seed={seed}"
