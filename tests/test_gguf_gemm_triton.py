"""The Triton GGUF matmuls (kernels/gguf_gemm.py, kernels/gguf_gemv.py) against
gguf.quants.dequantize and a float64 matmul at small shapes: compiled on a GPU, else on the CPU
under the Triton interpreter."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("kernel_device")

from localgen.kernels import gguf_gemm, gguf_gemv  # noqa: E402

Q = gguf.GGMLQuantizationType
# byte offsets of each block's fp16 fields: random bytes there could be inf/NaN
FP16_FIELDS = {Q.Q4_0: (0,), Q.Q8_0: (0,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def random_blocks(qtype, n: int, k: int, seed: int) -> np.ndarray:
    """``[n, row_bytes]`` uint8 of random blocks with finite fp16 scales in [-2**-4, 2**-4]."""
    rng = np.random.default_rng(seed)
    nb, bb = k // gguf_gemm.BLOCK_WEIGHTS[qtype], gguf_gemm.BLOCK_BYTES[qtype]
    raw = rng.integers(0, 256, size=(n, nb, bb), dtype=np.uint8)
    for off in FP16_FIELDS[qtype]:
        d = (rng.uniform(-1, 1, size=(n, nb)) / 16).astype(np.float16)
        raw[:, :, off:off + 2] = d.view(np.uint8).reshape(n, nb, 2)
    return raw.reshape(n, nb * bb)


def reference(raw: np.ndarray, qtype, k: int) -> np.ndarray:
    return gguf.quants.dequantize(raw, qtype).reshape(raw.shape[0], k).astype(np.float64)


@pytest.mark.parametrize("qtype", sorted(gguf_gemm.BLOCK_BYTES))
def test_dequantize_equals_gguf(qtype, kernel_device):
    raw = random_blocks(qtype, 5, 512, seed=qtype)
    got = gguf_gemm.dequantize(torch.from_numpy(raw).to(kernel_device), qtype, 512, torch.float32)
    np.testing.assert_array_equal(got.cpu().numpy(), reference(raw, qtype, 512).astype(np.float32))


def check_matmul(qtype, m: int, cfg, kernel_device, n: int = 37, k: int = 512) -> None:
    """``gguf_gemm.matmul`` under ``cfg`` against gguf.quants.dequantize and a float64 matmul
    (n not a multiple of any row tile). Tolerance: float32 products summed in another order,
    relative to the row's ``|x|·|W|`` (the "shift" codes, ``1 + q/2**B``, take the group's ``Σ x``
    back off, about one more rounding of that scale)."""
    raw = random_blocks(qtype, n, k, seed=100 + qtype)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m), device="cpu")
    y = gguf_gemm.matmul(x.to(kernel_device), torch.from_numpy(raw).to(kernel_device), qtype, k,
                         cfg).cpu()
    w = reference(raw, qtype, k)
    want = x.double().numpy() @ w.T
    tol = 1e-5 * np.abs(x.double().numpy()) @ np.abs(w).T + 1e-6
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert (np.abs(y.double().numpy() - want) <= tol).all()


@pytest.mark.parametrize("qtype", sorted(gguf_gemm.BLOCK_BYTES))
@pytest.mark.parametrize("m,splits", [(1, 0), (3, 3), (16, 2), (20, 0)])
def test_file_kernel_matches_float64(qtype, m, splits, kernel_device):
    check_matmul(qtype, m, gguf_gemv.DecodeConfig("file", block_n=32, split_k=splits),
                 kernel_device)


@pytest.mark.parametrize("qtype", gguf_gemv.TYPES)
@pytest.mark.parametrize("m,cfg", [
    (1, gguf_gemv.DecodeConfig("gemv", block_n=16, split_k=1)),
    (1, gguf_gemv.DecodeConfig("gemv", block_n=16, split_k=2, codes="i2f")),
    (1, gguf_gemv.DecodeConfig("gemv", block_n=8, split_k=3, codes="shift")),
    (1, gguf_gemv.DecodeConfig("dot", block_n=32, split_k=2)),
    (3, gguf_gemv.DecodeConfig("gemv", block_n=16, split_k=1)),  # M > 1: the dot kernel
    (16, gguf_gemv.DecodeConfig("dot", block_n=16, split_k=2)),
])
def test_group_kernels_match_float64(qtype, m, cfg, kernel_device):
    check_matmul(qtype, m, cfg, kernel_device)


@pytest.mark.parametrize("qtype", gguf_gemv.TYPES)
def test_default_at_16_rows_matches_float64(qtype, kernel_device):
    """The table's config at 16 rows: within the 8-bit activation bound where it rounds x (the
    int8 tensor-core kernel), within float32 summation where it does not."""
    if gguf_gemv.rounds_x(qtype, 16):
        check_q8_matmul(None, kernel_device, qtype, m=16)
    else:
        check_matmul(qtype, 16, None, kernel_device)


@pytest.mark.parametrize("qtype", gguf_gemv.TYPES)
@pytest.mark.parametrize("cfg", [
    gguf_gemv.DecodeConfig("gemv", block_n=16, split_k=1, blocks_per_step=2),
    gguf_gemv.DecodeConfig("gemv", block_n=8, split_k=2, blocks_per_step=4, codes="shift"),
])
def test_gemv_blocks_per_step(qtype, cfg, kernel_device):
    """Several blocks a loop step over 3 tiles a row: a step past the slice's end reads its last
    block again, with those activations masked to 0."""
    check_matmul(qtype, 1, cfg, kernel_device, k=768)


@pytest.mark.parametrize("qtype", sorted(gguf_gemm.BLOCK_BYTES))
def test_default_decode_path_matches_float64(qtype, kernel_device):
    """What ``PackedGGUFWeight`` calls: no config, M = 1; the default gguf_gemv config must
    run here, not fall back with a warning (a "q8" default within its rounding bound)."""
    q8 = gguf_gemv.default_config(qtype, 1).codes == "q8"
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        check_q8_matmul(None, kernel_device, qtype) if q8 else check_matmul(qtype, 1, None,
                                                                            kernel_device)
    assert not gguf_gemm.FAILED_DEFAULTS


def test_failing_default_falls_back_with_a_warning(monkeypatch, kernel_device):
    """A default config that fails (a compile error on some GPU) warns once and the file kernel
    serves the call; a config given explicitly raises."""
    from triton.errors import TritonError

    def broken(*args, **kwargs):
        raise TritonError("no such instruction")

    monkeypatch.setattr(gguf_gemv, "matmul", broken)
    monkeypatch.setattr(gguf_gemm, "FAILED_DEFAULTS", {})
    with pytest.warns(RuntimeWarning, match="no such instruction"):
        check_matmul(Q.Q4_K, 1, None, kernel_device)
    assert list(gguf_gemm.FAILED_DEFAULTS) == [(Q.Q4_K, True)]
    with warnings.catch_warnings():  # remembered: no second try, no second warning
        warnings.simplefilter("error", RuntimeWarning)
        check_matmul(Q.Q4_K, 1, None, kernel_device)
    with pytest.raises(TritonError):
        check_matmul(Q.Q4_K, 1, gguf_gemv.DecodeConfig("gemv"), kernel_device)


def test_every_default_config_serves_its_type_and_m():
    """The table's configs run as themselves (no gemv past M = 1, "q8" codes only where the
    kernel has them); a type the table does not name takes the file kernel."""
    for qtype in gguf_gemv.TYPES:
        for m in (1, 16):
            assert gguf_gemv.serves(gguf_gemv.default_config(qtype, m), qtype, m)
    assert gguf_gemv.default_config(Q.Q8_0, 1) == gguf_gemv.FILE_CONFIG


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("qtype", gguf_gemv.TYPES)
@pytest.mark.parametrize("m", [1, 5])
def test_group_kernels_half_activations(dtype, qtype, m, kernel_device):
    """bf16/fp16 activations (a served model's dtype) through the group kernels (the masked-code
    gemv at M = 1, the dot kernel above): the codes are exact in either, so only the output's
    rounding separates them from the float64 product: within one unit in the last place of the
    dtype (truncation or rounding)."""
    if dtype == torch.bfloat16 and m > 1 and kernel_device.type == "cpu":
        pytest.skip("the Triton interpreter's bf16 tl.dot is wrong (the file kernel's as well)")
    n, k = 33, 256
    raw = random_blocks(qtype, n, k, seed=7)
    w = reference(raw, qtype, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m), device="cpu").to(dtype)
    cfg = gguf_gemv.DecodeConfig("gemv" if m == 1 else "dot", block_n=16 if m == 1 else 32)
    y = gguf_gemm.matmul(x.to(kernel_device), torch.from_numpy(raw).to(kernel_device), qtype,
                         k, cfg).cpu()
    want = x.double().numpy() @ w.T
    tol = torch.finfo(dtype).eps * np.abs(want) + 1e-5 * np.abs(x.double().numpy()) @ np.abs(w).T
    assert y.dtype == dtype and (np.abs(y.double().numpy() - want) <= tol).all()


def test_new_kernel_refuses_other_types_and_m():
    raw = torch.zeros(4, 144, dtype=torch.uint8)
    with pytest.raises(ValueError, match="Q4_K/Q5_K/Q6_K"):
        gguf_gemv.matmul(torch.zeros(17, 256), raw, Q.Q4_K, 256)
    with pytest.raises(ValueError, match="Q4_K/Q5_K/Q6_K"):
        gguf_gemv.matmul(torch.zeros(1, 256), raw, Q.Q8_0, 256)


def test_bad_shapes_are_named():
    raw = torch.zeros(4, 144, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"uint8 \[N, 288\]"):
        gguf_gemm.matmul(torch.zeros(1, 512), raw, Q.Q4_K, 512)
    with pytest.raises(ValueError, match="no Triton kernel"):
        gguf_gemm.matmul(torch.zeros(1, 256), raw, Q.IQ2_XS, 256)


def test_sweep_runs_every_config(kernel_device):
    """``gguf_gemm_bench --sweep``'s code at a tiny shape (on the CPU: each config once under
    the interpreter, untimed): every config runs and agrees with the reference."""
    from localgen.bench import gguf_gemm_bench

    result = gguf_gemm_bench.sweep({"tiny": (20, 256)}, gguf_gemm_bench.SWEEP_QTYPES, (1, 2),
                                   kernel_device, torch.float16)
    cells = result["cells"]
    assert [c for c in cells if "error" in c] == []
    want = sum(gguf_gemm_bench.sweep_serves(c, qt, m) for c in gguf_gemm_bench.sweep_configs()
               for qt in gguf_gemm_bench.SWEEP_QTYPES for m in (1, 2))
    assert len(cells) == want
    assert set(result["ranking"]) == {"type 12 M=1", "type 12 M=2", "type 14 M=1", "type 14 M=2"}


def test_unaligned_blocks_take_the_file_kernel(kernel_device):
    """Raw data 2 bytes off a 16-byte boundary (a view into a larger buffer): the default path
    runs the file kernel, which reads bytes, and still matches the reference."""
    qtype, n, k = Q.Q4_K, 9, 256
    raw = random_blocks(qtype, n, k, seed=3)
    buf = torch.zeros(raw.size + 16, dtype=torch.uint8, device=kernel_device)
    base = (-buf.data_ptr()) % 16 + 2
    view = buf[base:base + raw.size].view(n, raw.shape[1])
    view.copy_(torch.from_numpy(raw))
    assert view.data_ptr() % 16 == 2
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(0), device="cpu")
    y = gguf_gemm.matmul(x.to(kernel_device), view, qtype, k).cpu()
    w = reference(raw, qtype, k)
    tol = 1e-5 * np.abs(x.double().numpy()) @ np.abs(w).T + 1e-6
    assert (np.abs(y.double().numpy() - x.double().numpy() @ w.T) <= tol).all()


@pytest.mark.parametrize("qtype", gguf_gemv.Q8_TYPES)
@pytest.mark.parametrize("cfg", [
    gguf_gemv.DecodeConfig("gemv", block_n=16, split_k=1, codes="q8"),
    gguf_gemv.DecodeConfig("gemv", block_n=8, split_k=2, blocks_per_step=2, codes="q8"),
    gguf_gemv.DecodeConfig("gemv", block_n=4, split_k=3, blocks_per_step=4, codes="q8"),
])
def test_q8_activations_within_their_rounding(qtype, cfg, kernel_device):
    """Split K (the output zeroed in the rounding kernel's launch) and several blocks a step,
    the last step past the slice's end."""
    check_q8_matmul(cfg, kernel_device, qtype)


def q8_x(m: int = 1) -> torch.Tensor:
    """The activations ``check_q8_matmul`` multiplies (CPU, ``[m, 768]``)."""
    return torch.randn(m, 768, generator=torch.Generator().manual_seed(5), device="cpu")


def check_q8_matmul(cfg, kernel_device, qtype=Q.Q4_K, x8=None, m: int = 1) -> None:
    """Q4_K, Q5_K or Q6_K against 8-bit activations (``gguf_q8.quantize``: int8 per 32-group,
    ``d = max|x|/127``, round half away from zero). Each activation moves by at most ``d/2``.
    Q4_K, Q5_K: only the scale term ``a·q`` meets it (the min term uses the exact ``Σ x``), so
    ``|y - y64| <= Σ_j |a q_j|·d_g(j)/2`` (``a·q``: the weight dequantized with ``dmin`` set
    to 0); Q6_K: the whole weight ``a·(q - 32)`` meets it, so ``Σ_j |w_j|·d_g(j)/2``; plus
    float32 summation (hand-derived bounds), for each of the ``m`` rows with its own steps.
    ``x8``: ``gguf_q8.quantize`` of :func:`q8_x`."""
    n, k = 37, 768
    raw = random_blocks(qtype, n, k, seed=11)
    w = reference(raw, qtype, k)
    if qtype in (Q.Q4_K, Q.Q5_K):
        no_min = raw.reshape(n, -1, gguf_gemm.BLOCK_BYTES[qtype]).copy()
        no_min[:, :, 2:4] = 0
        meets = np.abs(reference(no_min.reshape(n, -1), qtype, k))
    else:
        meets = np.abs(w)
    x, raw_d = q8_x(m), torch.from_numpy(raw).to(kernel_device)
    if x8 is None:
        y = gguf_gemm.matmul(x.to(kernel_device), raw_d, qtype, k, cfg)
    else:
        y = gguf_gemv.matmul(x.to(kernel_device), raw_d, qtype, k, cfg, x8=x8)
    y = y.cpu().double().numpy()
    xn = x.double().numpy()
    half_step = np.repeat(np.abs(xn).reshape(m, -1, 32).max(axis=2) / 127 / 2, 32, axis=1)
    bound = half_step @ meets.T + 1e-5 * np.abs(xn) @ np.abs(w).T + 1e-6
    err = np.abs(y - xn @ w.T)
    assert y.shape == (m, n) and (err <= bound).all()
    assert err.max() > 0  # the activations were rounded: this is not the float kernel


@pytest.mark.parametrize("qtype", gguf_gemv.Q8_TYPES)
@pytest.mark.parametrize("m,cfg", [
    (2, gguf_gemv.DecodeConfig("gemv", block_n=2, split_k=1, num_warps=1, codes="q8")),
    (5, gguf_gemv.DecodeConfig("gemv", block_n=4, split_k=2, blocks_per_step=2, codes="q8")),
    (16, gguf_gemv.DecodeConfig("gemv", block_n=8, split_k=1, num_warps=2, blocks_per_step=4,
                                codes="q8")),
])
def test_q8_rows_within_their_rounding(qtype, m, cfg, kernel_device):
    """Several activation rows (M padded to a power of two, the padding masked), each rounded
    with its own steps: split K, several blocks a step past the slice's end."""
    assert gguf_gemv.serves(cfg, qtype, m)
    check_q8_matmul(cfg, kernel_device, qtype, m=m)


@pytest.mark.parametrize("qtype", gguf_gemv.Q8_TYPES)
@pytest.mark.parametrize("block_n,num_warps,blocks_per_step", [(2, 1, 1), (4, 4, 2), (8, 4, 1)])
def test_q8_rows_sm90_build_keeps_its_registers(qtype, block_n, num_warps, blocks_per_step,
                                                 tmp_path):
    """Sweep tiles of the multi-row q8 kernels at 16 rows build for sm_90 with no register
    spilled to the stack."""
    from tests.sm90_build import stack_bytes

    ptrs = ["xq_ptr", "xd_ptr"] + (["xs_ptr"] if qtype == Q.Q4_K else [])
    ptrs += ["w_ptr", "y_ptr", "part_ptr", "cnt_ptr"]
    ints = ["M", "N", "num_tiles", "tiles_per_split", "splits",
            "row_16b" if qtype == Q.Q4_K else "stride_wn", "stride_ym"]
    types = ["*i8"] + ["*fp32"] * (len(ptrs) - 5) + ["*u8", "*bf16", "*fp32", "*i32"]
    sig = dict(zip(ptrs + ints, types + ["i32"] * len(ints)))
    consts = dict(BLOCK_N=block_n, KB=blocks_per_step, M_PAD=16, SPLIT=False, ASM=True)
    kernel = "_q4k_rows_q8" if qtype == Q.Q4_K else "_q6k_rows_q8"
    aligned = list(range(len(ptrs))) + [len(sig) - 1]
    assert stack_bytes("localgen.kernels.gguf_q8", kernel, sig, consts, aligned, num_warps,
                       tmp_path) == 0


def test_q8_rows_refuse_a_rounding_of_other_rows(kernel_device):
    from localgen.kernels import gguf_q8

    x = q8_x(3).to(kernel_device)
    cfg = gguf_gemv.DecodeConfig("gemv", block_n=4, split_k=1, codes="q8")
    raw = torch.zeros(2, 3 * 210, dtype=torch.uint8, device=kernel_device)
    with pytest.raises(ValueError, match="quantize of 3 rows"):
        gguf_gemv.matmul(x, raw, Q.Q6_K, 768, cfg, x8=gguf_q8.quantize(x[:2]))


def test_q8_rows_take_one_rounding_of_every_row(kernel_device):
    """``gguf_q8.quantize`` of ``[M, k]`` in one launch serves both types: stored word-major for
    M padded to a power of two, its rows equal the one-row rounding of each row of x, and the
    padding rows are zeros."""
    from localgen.kernels import gguf_q8

    x = q8_x(3).to(kernel_device)
    x8 = gguf_q8.quantize(x)
    assert x8.xq.shape == (768 // 4, 4, 4) and x8.xd.shape == x8.xs.shape == (768 // 32, 4)
    for i in range(3):
        one = gguf_q8.quantize(x[i:i + 1])
        assert torch.equal(x8.xq[:, i].reshape(-1), one.xq)
        assert torch.equal(x8.xd[:, i], one.xd) and torch.equal(x8.xs[:, i], one.xs)
    assert not x8.xq[:, 3].any() and not x8.xd[:, 3].any() and not x8.xs[:, 3].any()
    cfg = gguf_gemv.DecodeConfig("gemv", block_n=4, split_k=1, codes="q8")
    for qtype in gguf_gemv.Q8_TYPES:
        check_q8_matmul(cfg, kernel_device, qtype, x8=x8, m=3)


def test_q8_activations_shared_between_matrices(kernel_device):
    """One ``gguf_q8.quantize`` of x serves a Q4_K and a Q6_K matrix (as q/k/v read one x),
    split K included (the output then zeroed apart from the rounding launch)."""
    from localgen.kernels import gguf_q8

    x8 = gguf_q8.quantize(q8_x().to(kernel_device))
    for qtype in gguf_gemv.Q8_TYPES:
        for split in (1, 2):
            cfg = gguf_gemv.DecodeConfig("gemv", block_n=8, split_k=split, codes="q8")
            check_q8_matmul(cfg, kernel_device, qtype, x8=x8)


def test_q8_codes_refuse_other_types():
    raw = torch.zeros(1, 176, dtype=torch.uint8)
    with pytest.raises(ValueError, match="q8"):
        gguf_gemv.matmul(torch.zeros(1, 256), raw, Q.Q5_K, 256,
                         gguf_gemv.DecodeConfig("gemv", codes="q8"))


def _winners_file(tmp_path, winners) -> str:
    path = tmp_path / "sweep.json"
    path.write_text(__import__("json").dumps({"winners": winners}))
    return str(path)


def test_env_configs_take_the_nearest_measured_m_at_or_above(tmp_path, monkeypatch):
    """``LOCALGEN_GGUF_DECODE_CONFIGS``: a sweep's winners replace the table's defaults, each M
    taking the entry of the nearest measured M at or above it; the table serves the rest."""
    q8 = gguf_gemv.DecodeConfig("gemv", block_n=4, split_k=1, blocks_per_step=4, codes="q8")
    wide = gguf_gemv.DecodeConfig("file", block_n=64)
    path = _winners_file(tmp_path, [dict(qtype=12, m=1, cfg=q8.__dict__),
                                    dict(qtype=12, m=16, cfg=wide.__dict__)])
    table = {(qt, m): gguf_gemv.default_config(qt, m) for qt in (12, 14) for m in (1, 5, 40)}
    monkeypatch.setenv(gguf_gemv.ENV_CONFIGS, path)
    assert gguf_gemv.default_config(Q.Q4_K, 1) == q8
    assert gguf_gemv.default_config(Q.Q4_K, 5) == wide
    assert gguf_gemv.default_config(Q.Q4_K, 40) == table[(12, 40)]  # none measured at or above
    assert gguf_gemv.default_config(Q.Q6_K, 1) == table[(14, 1)]  # the file names no Q6_K


@pytest.mark.parametrize("content,match", [
    (None, "No such file"),
    ({"cells": []}, "'winners'"),
    ({"winners": [{"qtype": 12, "m": 1, "cfg": {"kernel": "gemv", "tile": 3}}]}, "tile"),
    ({"winners": [{"qtype": 12, "m": 16, "cfg": {"kernel": "gemv"}}]}, "does not serve"),
])
def test_env_configs_refuse_a_bad_file_naming_it(content, match, tmp_path, monkeypatch):
    path = tmp_path / "sweep.json"
    if content is not None:
        path.write_text(__import__("json").dumps(content))
    monkeypatch.setenv(gguf_gemv.ENV_CONFIGS, str(path))
    with pytest.raises(ValueError, match=match) as err:
        gguf_gemv.default_config(Q.Q4_K, 1)
    assert gguf_gemv.ENV_CONFIGS in str(err.value) and str(path) in str(err.value)


def test_dry_run_writes_winners_that_the_decode_takes(tmp_path, monkeypatch):
    """``gguf_gemm_bench --dry-run --out`` as the lead runs it, in its own process (so the
    module sets the interpreter itself): it exits 0 and its JSON's winners, one per type and
    M, become ``default_config``'s choices through ``LOCALGEN_GGUF_DECODE_CONFIGS``."""
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "dry.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-m", "localgen.bench.gguf_gemm_bench", "--dry-run",
                    "--sweep-qtypes", "14", "--out", str(out)], check=True, env=env,
                   capture_output=True, timeout=600)
    result = json.loads(out.read_text())
    winners, measured = result["winners"], {(c["qtype"], c["m"]) for c in result["cells"]}
    assert sorted((w["qtype"], w["m"]) for w in winners) == sorted(measured)
    assert (14, 1) in measured and len(measured) > 1
    monkeypatch.setenv(gguf_gemv.ENV_CONFIGS, str(out))
    for w in winners:
        assert gguf_gemv.default_config(Q.Q6_K, w["m"]) == gguf_gemv.DecodeConfig(**w["cfg"])


def _qkv_mats(kernel_device, k: int = 512):
    """Q4_K q ``[40, k]`` and k ``[24, k]``, Q6_K v ``[24, k]`` (Q4_K_M's mix) as (raw, qtype)."""
    return [(torch.from_numpy(random_blocks(qt, n, k, seed=n + qt)).to(kernel_device), qt)
            for n, qt in ((40, Q.Q4_K), (24, Q.Q4_K), (24, Q.Q6_K))]


@pytest.mark.parametrize("q6k_q8", [False, True])
def test_matmuls_same_x_rounds_once_with_the_values_apart(q6k_q8, tmp_path, monkeypatch,
                                                          kernel_device):
    """q, k and v of one x: the matrices whose default configs round x to 8 bits unsplit (Q4_K
    here; Q6_K too where a sweep's winners say "q8") share one rounding launch, and each output
    equals its own ``gguf_gemm.matmul`` bit for bit."""
    if q6k_q8:
        cfg = gguf_gemv.DecodeConfig("gemv", block_n=8, split_k=1, codes="q8")
        monkeypatch.setenv(gguf_gemv.ENV_CONFIGS,
                           _winners_file(tmp_path, [dict(qtype=14, m=1, cfg=cfg.__dict__)]))
    assert _roundings_of_qkv(1, monkeypatch, kernel_device) == 1  # one for those that take it


def _roundings_of_qkv(m: int, monkeypatch, kernel_device) -> int:
    """``gguf_q8.quantize`` launches of ``matmuls_same_x`` over :func:`_qkv_mats` at ``m``
    rows, having checked that each output equals its own ``gguf_gemm.matmul`` bit for bit."""
    from localgen.kernels import gguf_q8

    mats, k = _qkv_mats(kernel_device), 512
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1), device="cpu")
    x = x.to(kernel_device)
    apart = [gguf_gemm.matmul(x, raw, qt, k) for raw, qt in mats]
    calls = []
    quantize = gguf_q8.quantize
    monkeypatch.setattr(gguf_q8, "quantize", lambda *a: calls.append(a) or quantize(*a))
    together = gguf_gemm.matmuls_same_x(x, mats, k)
    assert all(torch.equal(a, b) for a, b in zip(apart, together))
    return len(calls)


@pytest.mark.parametrize("at_16", ["q8", "file", "table"])
def test_matmuls_same_x_at_several_rows(at_16, tmp_path, monkeypatch, kernel_device):
    """At M = 4: where the M = 16 configs round x (a sweep's "q8" winners, or the table's int8
    tensor-core entries), q, k and v share one rounding of the four rows; where the file kernel
    serves them, nothing is rounded. Each output equals its own ``gguf_gemm.matmul`` bit for
    bit."""
    cfg = {"q8": gguf_gemv.DecodeConfig("gemv", block_n=4, split_k=1, num_warps=2, codes="q8"),
           "file": gguf_gemv.FILE_CONFIG}.get(at_16)
    if cfg is not None:
        monkeypatch.setenv(gguf_gemv.ENV_CONFIGS, _winners_file(
            tmp_path, [dict(qtype=qt, m=16, cfg=cfg.__dict__) for qt in gguf_gemv.Q8_TYPES]))
    gguf_gemv.measured_winners.cache_clear()
    rounds = any(gguf_gemv.rounds_x(qt, 4) for qt in gguf_gemv.Q8_TYPES)
    assert rounds == (at_16 != "file")
    assert _roundings_of_qkv(4, monkeypatch, kernel_device) == (1 if rounds else 0)


def _llama_cfg():
    from localgen.models.config import ModelConfig

    return ModelConfig("LlamaForCausalLM", "llama", 64, 512, 1024, 1, 10, 6, 4, 64)


def test_project_qkv_reads_a_stacked_qk_as_the_three_apart(kernel_device):
    """``fuse.project_qkv`` over ``qk`` (q and k of one GGUF type stacked) beside ``v`` gives
    the q, k, v of the three matrices apart (CPU weights: fuse_qkv itself keeps them apart,
    since the CPU decode paths read them by name)."""
    from localgen.models import fuse
    from localgen.quant.gguf_blocks import PackedGGUFWeight

    cfg = _llama_cfg()
    q, k, v = (PackedGGUFWeight(raw.cpu(), qt, (raw.shape[0], 512))
               for raw, qt in _qkv_mats("cpu"))
    apart = {"q": q, "k": k, "v": v}
    fused = dict(apart)
    fuse.fuse_qkv(fused)
    assert fused.keys() == apart.keys()  # mixed types on the CPU: left as they are
    stacked = {"qk": PackedGGUFWeight.cat_rows([q, k]), "v": v}
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(2), device="cpu")
    for want, got in zip(fuse.project_qkv(cfg, apart, x), fuse.project_qkv(cfg, stacked, x)):
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="q and k stack on CUDA only")
def test_fuse_qkv_stacks_qk_on_cuda_and_projects_as_apart():
    """On CUDA, Q4_K_M's q/k stack (``qk``) beside the Q6_K v, and ``project_qkv`` (one 8-bit
    rounding of x for the matrices whose kernels take it) agrees with each matrix's own call
    within float32 summation order (the stacked matrix may split K otherwise)."""
    from localgen.models import fuse
    from localgen.quant.gguf_blocks import PackedGGUFWeight

    cfg = _llama_cfg()
    q, k, v = (PackedGGUFWeight(raw, qt, (raw.shape[0], 512))
               for raw, qt in _qkv_mats(torch.device("cuda")))
    w = {"q": q, "k": k, "v": v}
    fuse.fuse_qkv(w)
    assert set(w) == {"qk", "v"}
    x = torch.randn(1, 512, device="cuda")
    want = [m(x) for m in (q, k, v)]
    for a, b in zip(want, fuse.project_qkv(cfg, w, x)):
        b = b.reshape(1, -1)
        assert torch.allclose(b, a, rtol=1e-4, atol=1e-4 * a.abs().max().item())


@pytest.mark.parametrize("codes", ["mask", "q8"])
def test_split_gemv_combines_in_the_launch_and_leaves_its_tickets_zero(codes, kernel_device):
    """K slices of the gemv kernels: the last slice of each row tile sums the partials in slice
    order (the same bits on every call) into an output in x's dtype, and sets its ticket
    counter back to zero for the next launch."""
    from localgen.kernels.triton_common import tickets

    qtype, n, k = Q.Q6_K, 37, 768
    raw = torch.from_numpy(random_blocks(qtype, n, k, seed=4)).to(kernel_device)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(4), device="cpu")
    x = x.to(kernel_device)
    cfg = gguf_gemv.DecodeConfig("gemv", block_n=8, split_k=3, codes=codes)
    once = gguf_gemv.matmul(x, raw, qtype, k, cfg)
    again = gguf_gemv.matmul(x, raw, qtype, k, cfg)
    assert once.dtype == x.dtype and torch.equal(once, again)
    assert not tickets(x.device, 8)[:8].any()
    one_slice = gguf_gemv.matmul(x, raw, qtype, k, gguf_gemv.DecodeConfig(
        "gemv", block_n=8, split_k=1, codes=codes))
    assert torch.allclose(once, one_slice, rtol=1e-5, atol=1e-5 * one_slice.abs().max().item())
