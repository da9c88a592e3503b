"""Every case the paged decode kernel launches (``paged_decode.DecodeModes``: plain or 4-bit cache,
synchronized or asynchronized softmax, single pass or split, the split combined in the launch or
by a second one, the 4-bit cache's own KV block from the fp pool) against the float64 reference,
at a small size: compiled on a GPU, else under the Triton interpreter (tests/conftest.py)."""

from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("kernel_device")

from localgen.kernels import paged_attention_ref as ref  # noqa: E402
from localgen.kernels import quant_ref as qr  # noqa: E402
from localgen.kernels.paged_decode import (DecodeModes, paged_decode_attention,  # noqa: E402
                                           paged_decode_attention_int4)
from tests.test_kernels import decode_case, rel_err  # noqa: E402

SCALE = 0.125


def test_modes_name_each_launched_case():
    """The factories and the split choice give the kernels' switches; only an unfused split
    needs the combine launch."""
    off = dict(WINDOW=0, SOFTCAP2=0.0, SINKS=False)  # no score features: the plain kernel
    plain = DecodeModes.plain(async_softmax=False)
    assert plain.constexprs() == dict(ASYNC=False, QUANT=False, OWN_FP=False, **off)
    int4 = DecodeModes.int4_cache(async_softmax=True, own_fp=True)
    assert int4.constexprs() == dict(ASYNC=True, QUANT=True, OWN_FP=True, **off)
    assert int4.single_pass().stage1_constexprs()["ONE_SPLIT"]
    assert not int4.single_pass().combine_launch
    assert int4.split(fused=True).stage1_constexprs() == dict(
        ASYNC=True, QUANT=True, OWN_FP=True, ONE_SPLIT=False, FUSED=True, **off)
    assert not int4.split(fused=True).combine_launch and int4.split(fused=False).combine_launch


@pytest.mark.parametrize("cache", ["plain", "int4", "int4_own"])
@pytest.mark.parametrize("softmax", ["sync", "async"])
def test_every_split_case_matches_float64(seed, cache, softmax):
    """Single pass, fused split and unfused split of one input: each within the dtype's error of
    the float64 reference; the fused and unfused combines are the same code over the same
    partials, so they agree bit for bit."""
    q, k, v, bt, cl = decode_case(torch.float16, 8, 2, 64, [5, 37, 70])
    kw = dict(phi=0.0 if softmax == "async" else None, block_n=16)
    if cache == "plain":
        want = ref.paged_decode_attention(q.double(), k.double(), v.double(), bt, cl, SCALE)
        run = lambda **o: paged_decode_attention(q, k, v, bt, cl, SCALE, **kw, **o)  # noqa: E731
    else:
        qk, qv = qr.quantize_kv(k), qr.quantize_kv(v)
        kd, vd = qr.dequantize_kv(qk, torch.float64), qr.dequantize_kv(qv, torch.float64)
        want = ref.paged_decode_attention(q.double(), kd, vd, bt, cl, SCALE)
        own = {}
        if cache == "int4_own":  # the pool rows (reversed) hold each last KV block's values
            last = bt[torch.arange(3), (cl - 1) // 16]
            rows = torch.tensor([2, 1, 0])
            pool_k, pool_v = torch.zeros(2, 3, 16, 2, 64, dtype=torch.float16)
            pool_k[rows], pool_v[rows] = kd[last].half(), vd[last].half()
            own = dict(own_k=pool_k, own_v=pool_v, own_rows=rows)
        run = lambda **o: paged_decode_attention_int4(q, qk, qv, bt, cl, SCALE,  # noqa: E731
                                                       **kw, **own, **o)
    outs = {}
    for splits, fused in itertools.product((1, 3), (True, False)):
        got = run(num_splits=splits, fused=fused, out=torch.full_like(q, float("nan")))
        assert rel_err(got, want) < 5e-3, f"seed={seed} splits={splits} fused={fused}"
        outs[splits, fused] = got
    assert torch.equal(outs[3, True], outs[3, False]), f"seed={seed}"
