"""CPU decode attention over a paged KV cache at offloading shapes (issue 6's CPU delegation):
the reference (fused SDPA over gathered, masked K/V) beside plain-matmul variants, per dtype, with
the KV bytes read per second. Run where the offloaded runs happen (the GPU machine's CPU):

    python3 scripts/cpu_attention_bench.py [--fresh]   # --fresh: glibc malloc defaults
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels import paged_attention_ref as ref  # noqa: E402
from localgen.hostmem import keep_freed_host_memory  # noqa: E402


def gather_bhld(cache, bt, n, dtype=None):
    """Blocks of each sequence -> ``[B, kvh, n*bs, D]`` contiguous (one copy, optional cast)."""
    B = bt.shape[0]
    bs, kvh, D = cache.shape[1:]
    x = cache.index_select(0, bt[:, :n].reshape(-1)).view(B, n * bs, kvh, D).transpose(1, 2)
    return x.to(dtype or cache.dtype, memory_format=torch.contiguous_format)


def matmul_variant(dtype):
    def f(q, kc, vc, bt, cl, scale):
        B, H, D = q.shape
        kvh, bs = kc.shape[2], kc.shape[1]
        n = -(-int(cl.max()) // bs)
        K, V = gather_bhld(kc, bt, n, dtype), gather_bhld(vc, bt, n, dtype)
        qg = q.view(B, kvh, H // kvh, D).to(K.dtype)
        s = torch.matmul(qg, K.transpose(-1, -2)).float() * scale
        s.masked_fill_(~(torch.arange(n * bs)[None, :] < cl[:, None])[:, None, None, :], float("-inf"))
        p = torch.softmax(s, -1).to(V.dtype)
        return torch.matmul(p, V).view(B, H, D).to(q.dtype)
    f.__name__ = f"matmul_{str(dtype).split('.')[-1] if dtype else 'native'}"
    return f


def per_seq_variant(q, kc, vc, bt, cl, scale):
    """One sequence at a time, its blocks gathered to [kvh, L, D] fp32 (FlexGen-like)."""
    B, H, D = q.shape
    kvh, bs = kc.shape[2], kc.shape[1]
    outs = []
    for i in range(B):
        L = int(cl[i]); n = -(-L // bs)
        K = gather_bhld(kc, bt[i:i + 1], n, torch.float32)[0, :, :L]
        V = gather_bhld(vc, bt[i:i + 1], n, torch.float32)[0, :, :L]
        qi = q[i].view(kvh, H // kvh, D).float()
        p = torch.softmax(torch.matmul(qi, K.transpose(-1, -2)) * scale, -1)
        outs.append(torch.matmul(p, V).view(H, D))
    return torch.stack(outs).to(q.dtype)


def per_seq_strided(q, kc, vc, bt, cl, scale):
    """One sequence at a time in the cache dtype: its blocks gathered as [L, kvh, D] (one copy
    of whole blocks) and read as [kvh, L, D] strided matrices by bmm (no transpose copy)."""
    B, H, D = q.shape
    kvh, bs = kc.shape[2], kc.shape[1]
    g = H // kvh
    out = torch.empty_like(q)
    for i in range(B):
        L = int(cl[i]); n = -(-L // bs)
        ids = bt[i, :n]
        K = kc.index_select(0, ids).view(n * bs, kvh, D)[:L].transpose(0, 1)
        V = vc.index_select(0, ids).view(n * bs, kvh, D)[:L].transpose(0, 1)
        qi = q[i].view(kvh, g, D)
        s = torch.bmm(qi, K.transpose(1, 2)).float() * scale
        p = torch.softmax(s, -1).to(V.dtype)
        out[i] = torch.bmm(p, V).view(H, D)
    return out


def main() -> int:
    torch.manual_seed(0)
    kept = "--fresh" not in sys.argv and keep_freed_host_memory()  # as the offload runner does
    print("threads", torch.get_num_threads(), "torch", torch.__version__,
          "freed host memory kept" if kept else "malloc defaults (fresh mmaps)", flush=True)
    shapes = [("llama-2-7b gbs16", 16, 32, 32, 128, 544), ("opt-30b gbs32", 32, 56, 56, 128, 544),
              ("opt-6.7b gbs32", 32, 32, 32, 128, 544)]
    variants = [ref.paged_decode_attention, matmul_variant(None), matmul_variant(torch.float32),
                matmul_variant(torch.bfloat16), per_seq_variant, per_seq_strided]
    for name, B, H, kvh, D, L in shapes:
        bs = 16
        nb = B * (-(-L // bs))
        for dt in (torch.float16, torch.bfloat16):
            kc = torch.randn(nb, bs, kvh, D).to(dt)
            vc = torch.randn(nb, bs, kvh, D).to(dt)
            q = torch.randn(B, H, D).to(dt)
            bt = torch.randperm(nb).view(B, -1)
            cl = torch.randint(L - 32, L + 1, (B,))
            want = ref.paged_decode_attention(q[:2].double(), kc.double(), vc.double(), bt[:2], cl[:2], D ** -0.5)
            kv_bytes = 2 * int(cl.sum()) * kvh * D * kc.element_size()
            for f in variants:
                out = f(q, kc, vc, bt, cl, D ** -0.5)
                err = ((out[:2].double() - want).norm() / want.norm()).item()
                ts = []
                for _ in range(3):
                    t = time.perf_counter()
                    f(q, kc, vc, bt, cl, D ** -0.5)
                    ts.append(time.perf_counter() - t)
                t = min(ts)
                print(f"{name:18s} {str(dt):15s} {f.__name__:24s} {t * 1e3:8.2f} ms  "
                      f"{kv_bytes / t / 1e9:6.1f} GB/s of KV  err {err:.1e}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
