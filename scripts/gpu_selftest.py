"""GPU self-test (run on a CUDA machine): Triton kernels vs a float64 reference on fresh random
inputs, and the engine on CUDA vs transformers on the same tiny weights.

    python scripts/gpu_selftest.py              # everything
    python scripts/gpu_selftest.py --int4-kv    # only the 4-bit KV write and decode kernels

Needs torch, triton, transformers (no localgen install: the repo root is put on sys.path and
kernels/ is loaded as localgen.kernels).
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _alias_kernels() -> None:
    """Make ``localgen.kernels`` resolve to ``kernels/`` in a bare checkout."""
    import localgen

    spec = importlib.util.spec_from_file_location(
        "localgen.kernels", ROOT / "kernels" / "__init__.py",
        submodule_search_locations=[str(ROOT / "kernels")])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["localgen.kernels"] = mod
    spec.loader.exec_module(mod)
    localgen.kernels = mod


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out.double() - ref).norm() / ref.norm())


def check_decode(dev, dtype, heads, kv_heads, head_dim, lens, phi=None, **kw) -> float:
    from localgen.kernels import paged_attention_ref as ref
    from localgen.kernels import paged_decode

    bs = 16
    B, maxb = len(lens), max(-(-n // bs) for n in lens)
    nb = B * maxb + 64  # spare blocks, so the tables are a shuffled subset
    k = torch.randn(nb, bs, kv_heads, head_dim, device=dev, dtype=dtype)
    v = torch.randn_like(k)
    perm = torch.randperm(nb, device=dev)[:B * maxb].view(B, maxb)
    cl = torch.tensor(lens, device=dev)
    q = torch.randn(B, heads, head_dim, device=dev, dtype=dtype)
    want = ref.paged_decode_attention(q.double(), k.double(), v.double(), perm, cl, head_dim ** -0.5)
    out = torch.full_like(q, float("nan"))
    paged_decode.paged_decode_attention(q, k, v, perm, cl, head_dim ** -0.5, phi=phi, out=out, **kw)
    torch.cuda.synchronize()
    return rel_err(out, want)


def _int4_case(dev, dtype, heads, kv_heads, head_dim, lens, bs=16):
    """A random int4 decode case: (q, quantized K/V, their float64 dequantizations, shuffled
    block tables ``[B, max_blocks]`` over spare blocks, context lens)."""
    from localgen.kernels import quant_ref

    B, maxb = len(lens), max(-(-n // bs) for n in lens)
    nb = B * maxb + 64
    k = torch.randn(nb, bs, kv_heads, head_dim, device=dev, dtype=dtype)
    v = torch.randn_like(k)
    qk, qv = quant_ref.quantize_kv(k), quant_ref.quantize_kv(v)
    kd, vd = quant_ref.dequantize_kv(qk, torch.float64), quant_ref.dequantize_kv(qv, torch.float64)
    perm = torch.randperm(nb, device=dev)[:B * maxb].view(B, maxb)
    q = torch.randn(B, heads, head_dim, device=dev, dtype=dtype)
    return q, qk, qv, kd, vd, perm, torch.tensor(lens, device=dev)


def check_decode_int4(dev, dtype, heads, kv_heads, head_dim, lens, phi=None, own=False, **kw) -> float:
    """int4 KV decode vs float64 attention over the dequantized cache. ``own``: each sequence's
    own block is read in fp from a pool row (the first sequence has none), and the reference
    reads those slots from the pool too."""
    from localgen.kernels import paged_attention_ref as ref
    from localgen.kernels import paged_decode

    bs = 16
    q, qk, qv, kd, vd, perm, cl = _int4_case(dev, dtype, heads, kv_heads, head_dim, lens, bs)
    if own:
        B = len(lens)
        pool_k = torch.randn(B + 3, bs, kv_heads, head_dim, device=dev, dtype=dtype)
        pool_v = torch.randn_like(pool_k)
        rows = torch.randperm(B + 3, device=dev)[:B]
        rows[0] = -1
        for i, (row, n) in enumerate(zip(rows.tolist(), lens)):
            if row >= 0:
                blk, m = int(perm[i, (n - 1) // bs]), (n - 1) % bs + 1
                kd[blk, :m], vd[blk, :m] = pool_k[row, :m].double(), pool_v[row, :m].double()
        kw = dict(kw, own_k=pool_k, own_v=pool_v, own_rows=rows)
    want = ref.paged_decode_attention(q.double(), kd, vd, perm, cl, head_dim ** -0.5)
    out = torch.full_like(q, float("nan"))
    paged_decode.paged_decode_attention_int4(q, qk, qv, perm, cl, head_dim ** -0.5, phi=phi,
                                             out=out, **kw)
    torch.cuda.synchronize()
    return rel_err(out, want)


def check_own_blocks(dev, dtype, h, kvh, d, lens, tol) -> int:
    """The own-block variant over the launch forms; prints a line each, returns the failures."""
    fails = 0
    for kw in (dict(), dict(phi=0.0), dict(fused=False), dict(num_splits=1)):
        e = check_decode_int4(dev, dtype, h, kvh, d, lens, own=True, **kw)
        fails += not e < tol
        print(f"int4 decode, own block fp {str(dtype):15s} h{h} kv{kvh} d{d} {kw}: rel err {e:.2e} "
              f"{'ok' if e < tol else 'FAIL'}")
    return fails


def check_write_int4(dev) -> list[str]:
    """The Triton quantize-and-write kernel is bit-identical to the torch reference on the GPU
    (exact division and round-half-even there too); returns the failing cases."""
    from localgen.kernels import kv_write, quant_ref

    bad = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for kvh, d in ((8, 128), (3, 80), (1, 64), (32, 128)):
            n, nb, bs = 300, 64, 16
            fused = torch.randn(n, 3 * kvh, d, device=dev, dtype=dtype) * 3
            k, v = fused[:, kvh:2 * kvh], fused[:, 2 * kvh:]
            slots = torch.randperm(nb * bs, device=dev)[:n]
            ng = -(-d // 64)
            got = [quant_ref.QuantizedKV(torch.randint(0, 256, (nb, bs, kvh, d // 2), device=dev, dtype=torch.uint8),
                                         torch.randn(nb, bs, kvh, ng, device=dev).half(),
                                         torch.randn(nb, bs, kvh, ng, device=dev).half()) for _ in range(2)]
            want = [quant_ref.QuantizedKV(c.packed.clone(), c.scale.clone(), c.min.clone()) for c in got]
            kv_write.write_kv_int4(got[0], got[1], k, v, slots)
            quant_ref.write_kv_int4(want[0], want[1], k, v, slots)
            same = all(torch.equal(getattr(a, f).view(torch.uint8), getattr(b, f).view(torch.uint8))
                       for a, b in zip(got, want) for f in ("packed", "scale", "min"))
            if not same:
                bad.append(f"{dtype} kv{kvh} d{d}")
    return bad


def int4_kv_main(dev) -> int:
    """Only the 4-bit KV kernels: quantize-and-write, int4 decode with and without the own block."""
    bad = check_write_int4(dev)
    print("int4 write (Triton vs torch, bit-identical):", "ok" if not bad else f"FAIL {bad}")
    fails = len(bad)
    for dtype, h, kvh, d in ((torch.bfloat16, 32, 8, 128), (torch.float16, 32, 32, 128),
                             (torch.bfloat16, 9, 3, 64), (torch.float16, 16, 2, 96)):
        tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
        fails += check_own_blocks(dev, dtype, h, kvh, d, [17, 1, 300, 4099, 32], tol)
    print("int4 kv selftest failures:", fails)
    return 1 if fails else 0


def check_prefill(dev, dtype, heads, kv_heads, head_dim) -> float:
    from localgen.kernels import paged_attention_ref as ref
    from localgen.kernels import paged_prefill

    bs, nb = 16, 512
    k = torch.randn(nb, bs, kv_heads, head_dim, device=dev, dtype=dtype)
    v = torch.randn_like(k)
    ctx, ql = [37, 300, 129], [37, 45, 1]
    maxb = max(-(-n // bs) for n in ctx)
    tables = torch.randperm(nb, device=dev)[:3 * maxb].view(3, maxb)
    q = torch.randn(sum(ql), heads, head_dim, device=dev, dtype=dtype)
    want = ref.paged_prefill_attention(q.double(), k.double(), v.double(), tables, ctx, ql,
                                       head_dim ** -0.5)
    out = paged_prefill.paged_prefill_attention(q, k, v, tables, ctx, ql, head_dim ** -0.5)
    torch.cuda.synchronize()
    return rel_err(out, want)


NS = 4  # token counts per case (the CPU smoke run of this function lowers it)


def check_fused(dev, dtype) -> list[tuple[str, float]]:
    """Fused elementwise kernels (add+RMSNorm, q/k rope, silu*mul) vs float64 on odd sizes."""
    from localgen.kernels import fused_act, fused_norm, fused_rope

    res = []
    for hidden in (576, 4096, 8192):
        for n in (1, 7, 33, 1000)[:NS]:
            for with_res in (False, True):
                x = torch.randn(n, hidden, device=dev, dtype=dtype) * 3
                r = torch.randn(n, hidden, device=dev, dtype=dtype) if with_res else None
                w = (1 + 0.5 * torch.randn(hidden, device=dev)).to(dtype)
                out = torch.full_like(x, float("nan"))
                nres = torch.full_like(x, float("nan")) if with_res else None
                y, hr = fused_norm.add_rms_norm(x, r, w, 1e-5, out=out, residual_out=nres)
                h64 = x.double() + (r.double() if with_res else 0)
                want = w.double() * h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + 1e-5)
                torch.cuda.synchronize()
                e = max(rel_err(y, want), rel_err(hr, h64))
                res.append((f"add_rms_norm hidden{hidden} n{n} res={with_res}", e))
    for d, hq, hk in ((128, 32, 8), (64, 9, 3), (128, 32, 32), (80, 32, 32)):
        for n in (1, 7, 33, 1000)[:NS]:
            qkv = torch.randn(n, (hq + 2 * hk) * d, device=dev, dtype=dtype)
            q, k, _ = qkv.split([hq * d, hk * d, hk * d], dim=-1)
            q, k = q.view(n, hq, d), k.view(n, hk, d)
            pos = torch.randint(0, 131072, (n,), device=dev)
            inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device=dev).float() / d))
            wq, wk = fused_rope.rope_qk_ref(q.double(), k.double(), pos, inv)
            qo, ko = fused_rope.rope_qk(q, k, pos, inv)
            torch.cuda.synchronize()
            res.append((f"rope_qk d{d} h{hq} kv{hk} n{n}", max(rel_err(qo, wq), rel_err(ko, wk))))
            ang = pos.float()[:, None] * inv[None, :]
            emb = torch.cat((ang, ang), -1).double()
            qo, ko = fused_rope.rope_qk_cos_sin(q, k, emb.cos().float(), emb.sin().float())
            torch.cuda.synchronize()
            res.append((f"rope_qk_cos_sin d{d} h{hq} kv{hk} n{n}", max(rel_err(qo, wq), rel_err(ko, wk))))
    for inter in (11008, 1000, 14336):
        for n in (1, 33, 1000)[:NS]:
            gu = torch.randn(n, 2 * inter, device=dev, dtype=dtype) * 4
            g, u = gu.double().chunk(2, -1)
            out = fused_act.silu_mul_fused(gu)
            torch.cuda.synchronize()
            res.append((f"silu_mul I{inter} n{n}", rel_err(out, torch.nn.functional.silu(g) * u)))
    return res


INT4_SHAPES = ((4096, 4096), (12288, 4096), (4096, 11008), (1000, 600))  # [N, K]: q/o, qkv, down, odd


def check_int4_linear(dev, shapes=INT4_SHAPES) -> list[tuple[str, float, float]]:
    """Int4 linears through the FlashDecoding++ §5 dispatcher on CUDA: both weight layouts
    (FlexGen g=64 along N, GGUF Q4_1 g=32 along K), Llama-2-7B shapes and an odd one, every
    implementation at every M into NaN-poisoned outputs, and the routed call, vs float64
    ``x @ dequant(W).T``; plus the offloaded layer's call site (``unpack_layer`` keeps the matrices
    packed behind the dispatcher). -> ``[(name, rel err, tol)]``."""
    from localgen.kernels import dispatch
    from localgen.quant import int4
    from localgen.runtime.offload.timers import Timers
    from localgen.runtime.offload.weights import LayerWeights

    res = []
    tols = {torch.bfloat16: 2e-2, torch.float16: 5e-3}
    for layout, gdim, g in (("n64", 0, 64), ("k32", 1, 32)):
        for n, k in shapes:
            t = int4.quantize(torch.randn(n, k, device=dev) * 0.02, g, dim=gdim)
            w64 = int4.dequantize(t, torch.float64)
            for dtype, tol in tols.items():
                lin = int4.as_linear(t, dtype)
                for m in (1, 7, 16, 33, 64, 128, 300)[:NS + 3]:
                    x = torch.randn(m, k, device=dev, dtype=dtype)
                    want = x.double() @ w64.t()
                    for impl in dispatch.IMPLS:
                        out = torch.full((m, n), float("nan"), device=dev, dtype=dtype)
                        lin.run(impl, x, out=out)
                        torch.cuda.synchronize()
                        res.append((f"{layout} [{n},{k}] {dtype} M={m} {impl}", rel_err(out, want), tol))
                    route = lin.route(x)
                    y = lin(x)
                    torch.cuda.synchronize()
                    ok_route = route in dispatch.IMPLS
                    res.append((f"{layout} [{n},{k}] {dtype} M={m} routed->{route}",
                                rel_err(y, want) if ok_route else float("inf"), tol))
    # the call site: a layer on the "gpu" tier keeps its 4-bit matrices behind the dispatcher
    layer = {"q": int4.quantize(torch.randn(512, 256) * 0.02, 64, dim=0),
             "down": int4.quantize(torch.randn(256, 512) * 0.02, 32, dim=1), "norm": torch.ones(256)}
    lw = LayerWeights([layer], ["gpu"], torch.bfloat16, dev, None, Timers(dev))
    w = lw.get(0)
    for key in ("q", "down"):
        x = torch.randn(3, layer[key].shape[1], device=dev, dtype=torch.bfloat16)
        want = x.double() @ int4.dequantize(layer[key], torch.float64).to(dev).t()
        packed = isinstance(w[key], dispatch.Int4Linear)
        e = rel_err(w[key](x), want) if packed else float("inf")
        res.append((f"offload call site {key} packed={packed}", e, 2e-2))
    lw.close()
    return res


def tiny_llama(num_layers: int = 2):
    """A random Llama (GQA, 256 hidden, vocab 500) -> (transformers model on the CPU, its
    ModelConfig, a weight store over its state dict)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from localgen.models.config import ModelConfig

    torch.manual_seed(0)
    hc = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=num_layers,
                     num_attention_heads=8, num_key_value_heads=2, vocab_size=500,
                     max_position_embeddings=1024)
    m = LlamaForCausalLM(hc).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.15)
    sd = m.state_dict()

    class Store:
        names = lambda self: list(sd)  # noqa: E731
        get = lambda self, n: sd[n]  # noqa: E731

    return m, ModelConfig.from_hf_dict({**hc.to_dict(), "architectures": ["LlamaForCausalLM"]}), Store()


def check_engine(dev) -> str:
    """Tiny random Llama (GQA) on CUDA in fp32 vs transformers on CPU: first-step logits and
    greedy tokens."""
    from localgen.api import LLM, Request, SamplingParams

    m, cfg, store = tiny_llama()
    torch.backends.cuda.matmul.allow_tf32 = False
    llm = LLM.from_parts(cfg, store, None, device=str(dev), dtype="float32")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 70, 300)]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = llm.generate([Request(prompt_token_ids=p, sampling=sp) for p in prompts])
    same = 0
    for p, o in zip(prompts, outs):
        ids, want, past = torch.tensor([p]), [], None
        with torch.no_grad():
            for _ in range(16):
                r = m(ids, past_key_values=past, use_cache=True)
                past, tok = r.past_key_values, int(r.logits[0, -1].argmax())
                want.append(tok)
                ids = torch.tensor([[tok]])
        same += o.token_ids == want
    return f"{same}/{len(prompts)} greedy sequences equal transformers"


def main() -> int:
    dev = torch.device("cuda")
    _alias_kernels()
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    if sys.argv[1:] == ["--int4-kv"]:
        return int4_kv_main(dev)
    fails = 0
    cases = [(torch.bfloat16, 32, 8, 128), (torch.float16, 32, 8, 128), (torch.bfloat16, 9, 3, 64),
             (torch.float16, 32, 32, 80), (torch.bfloat16, 16, 2, 96), (torch.float32, 8, 1, 64)]
    for dtype, h, kvh, d in cases:
        tol = 2e-2 if dtype == torch.bfloat16 else 5e-3 if dtype == torch.float16 else 1e-3
        for phi in (None, 0.0):
            e = check_decode(dev, dtype, h, kvh, d, [1, 17, 300, 4099, 32768][: 5 if d == 128 else 4], phi)
            ok = e < tol
            fails += not ok
            print(f"decode {str(dtype):15s} h{h} kv{kvh} d{d} phi={phi}: rel err {e:.2e} {'ok' if ok else 'FAIL'}")
        lens = [1, 17, 300, 4099, 32768][: 5 if d == 128 else 4]
        for kw in (dict(fused=False), dict(num_splits=1), dict(num_splits=97, block_n=32),
                   dict(phi=0.0, fused=False), dict(phi=0.0, num_splits=1), dict(phi=200.0)):
            e = check_decode(dev, dtype, h, kvh, d, lens[:4], **kw)
            ok = e < tol
            fails += not ok
            print(f"decode {str(dtype):15s} h{h} kv{kvh} d{d} {kw}: rel err {e:.2e} {'ok' if ok else 'FAIL'}")
        if dtype != torch.float32:
            for kw in (dict(), dict(phi=0.0), dict(fused=False), dict(num_splits=1),
                       dict(phi=200.0, num_splits=3)):
                e = check_decode_int4(dev, dtype, h, kvh, d, lens, **kw)
                ok = e < tol
                fails += not ok
                print(f"int4 decode {str(dtype):15s} h{h} kv{kvh} d{d} {kw}: rel err {e:.2e} {'ok' if ok else 'FAIL'}")
            fails += check_own_blocks(dev, dtype, h, kvh, d, [17, 1, 300, 4099, 32][: 5 if d == 128 else 4], tol)
        e = check_prefill(dev, dtype, h, kvh, d)
        ok = e < tol
        fails += not ok
        print(f"prefill {str(dtype):15s} h{h} kv{kvh} d{d}: rel err {e:.2e} {'ok' if ok else 'FAIL'}")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        tol = 1e-2 if dtype == torch.bfloat16 else 2e-3 if dtype == torch.float16 else 1e-5
        bad = [(name, e) for name, e in check_fused(dev, dtype) if not e < tol]
        for name, e in bad:
            print(f"fused {str(dtype):15s} {name}: rel err {e:.2e} FAIL")
        fails += len(bad)
        print(f"fused elementwise {str(dtype):15s}: {'ok' if not bad else f'{len(bad)} FAIL'}")
    try:
        bad = [(name, e) for name, e, tol in check_int4_linear(dev) if not e < tol]
        for name, e in bad:
            print(f"int4 linear {name}: rel err {e:.2e} FAIL")
        fails += len(bad)
        print("int4 linear (flat/tiled/torch, both layouts, call site):",
              "ok" if not bad else f"{len(bad)} FAIL")
    except Exception as e:  # report and go on
        fails += 1
        print("int4 linear FAILED:", repr(e))
    t = time.time()
    try:
        print("engine on CUDA:", check_engine(dev), f"({time.time() - t:.1f} s)")
    except Exception as e:  # report and go on: the kernel numbers above still count
        fails += 1
        print("engine on CUDA FAILED:", repr(e))
    print("selftest failures:", fails)
    return 1 if fails else 0


if __name__ == "__main__":
    raise SystemExit(main())
