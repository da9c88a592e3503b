"""The CPU decode kernels in C (kernels/csrc/) beside the torch ops they replace, same process,
same inputs: decode attention over a shuffled paged cache (the CPU attention backend with its C
kernel, ``CpuKernelBackend``, and without, ``CpuBackend``), RMSNorm and rotary + K/V write (SmolLM2-135M's shapes by default). Each cell
is the median of ``--repeat`` timings of ``--calls`` calls. With ``--cold`` a 64 MiB buffer is
read between calls, evicting the cache as a decode step's weights do, so the attention rows come
from memory as they do in a real step.

    python scripts/cpu_decode_kernels_bench.py [--threads 2] [--cold]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from localgen.kernels import layer_ops_cpu as ops
from localgen.attention.cpu import CpuBackend, CpuKernelBackend
from localgen.attention.metadata import AttentionMetadata, LayerKV
from localgen.attention.spec import AttentionSpec
from localgen.kernels import paged_decode_cpu as kernel

BS = 16


def attention_case(seqs: int, heads: int, kv_heads: int, d: int, ctx: int, dtype):
    """q, a shuffled paged cache holding ``ctx`` tokens per sequence, and the step's metadata."""
    per = -(-ctx // BS)
    pair = torch.randn(2, seqs * per + 4, BS, kv_heads, d).to(dtype)
    tables = torch.randperm(seqs * per + 4)[:seqs * per].view(seqs, per)
    meta = AttentionMetadata(False, torch.zeros(seqs, dtype=torch.long), tables,
                             torch.full((seqs,), ctx), [1] * seqs, [ctx] * seqs)
    return torch.randn(seqs, heads, d).to(dtype), LayerKV(pair[0], pair[1], pair), meta


def timed(fn, calls: int, repeat: int, flush: torch.Tensor | None) -> float:
    """Median µs per call; a flush (a full read of ``flush``) between calls is not counted."""
    fn()
    runs = []
    for _ in range(repeat):
        total = 0.0
        for _ in range(calls):
            if flush is not None:
                flush.sum()
            t = time.perf_counter()
            fn()
            total += time.perf_counter() - t
        runs.append(total / calls * 1e6)
    return statistics.median(runs)


def attention_row(shape, dtype, args, flush) -> str:
    q, kv, meta = attention_case(*shape, dtype)
    spec = AttentionSpec(shape[3] ** -0.5)

    def run(backend):
        def call():
            meta.clear_plans()  # plan per call, as the first layer of a step does
            return backend.decode(kv, q, None, None, meta, spec)
        return timed(call, args.calls, args.repeat, flush)

    c, t = run(CpuKernelBackend()), run(CpuBackend())
    seqs, heads, kvh, d, ctx = shape
    gbs = 2 * seqs * ctx * kvh * d * q.element_size() / (c * 1e-6) / 1e9
    return (f"attention {seqs}x{heads}/{kvh}x{d} ctx {ctx} {str(dtype)[6:]:9s} C {c:8.1f} µs "
            f"({gbs:5.1f} GB/s of K/V)  torch {t:8.1f} µs  torch/C {t / c:5.2f}x")


def layer_ops_rows(hidden: int, heads: int, kv_heads: int, d: int, args, flush) -> list[str]:
    x = torch.randn(1, hidden).bfloat16()
    w = torch.rand(hidden).bfloat16()
    norm_c = timed(lambda: ops.rms_norm(x, w, 1e-5), args.calls, args.repeat, flush)
    norm_t = timed(lambda: w * torch.nn.functional.rms_norm(x.float(), (hidden,), eps=1e-5)
                   .to(x.dtype), args.calls, args.repeat, flush)
    y = torch.randn(1, (heads + 2 * kv_heads) * d).bfloat16()
    cos, sin = torch.randn(1, d).bfloat16(), torch.randn(1, d).bfloat16()
    pair = torch.zeros(2, 8, BS, kv_heads, d, dtype=torch.bfloat16)
    slots = torch.tensor([5])
    rope_c = timed(lambda: ops.rope_store(y, cos, sin, pair, slots, heads, kv_heads, d),
                   args.calls, args.repeat, flush)
    qk = y[:, :(heads + kv_heads) * d].view(1, heads + kv_heads, d)
    half = torch.cat((-sin[:, :d // 2], sin[:, d // 2:]), -1)[:, None]

    def rope_torch():
        torch.addcmul(qk * cos[:, None], qk.view(1, -1, 2, d // 2).flip(2).view(qk.shape), half,
                      out=qk)
        pair.view(2, -1, kv_heads, d).index_copy_(
            1, slots, y[:, heads * d:].view(1, 2, kv_heads, d).transpose(0, 1))

    rope_t = timed(rope_torch, args.calls, args.repeat, flush)
    return [f"rms_norm 1x{hidden} bf16      C {norm_c:6.1f} µs  torch {norm_t:6.1f} µs  "
            f"torch/C {norm_t / norm_c:5.2f}x",
            f"rope + K/V write {heads}/{kv_heads}x{d}  C {rope_c:6.1f} µs  torch {rope_t:6.1f} µs  "
            f"torch/C {rope_t / rope_c:5.2f}x"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--cold", action="store_true", help="evict the caches between calls")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not (kernel.available() and ops.available()):
        print("the C kernels are not built here (no compiler?): nothing to compare")
        return 1
    flush = torch.ones(16 << 20) if args.cold else None
    print(f"threads {torch.get_num_threads()}, {'cold' if args.cold else 'warm'} caches")
    shapes = [(1, 9, 3, 64, 540), (16, 9, 3, 64, 540), (1, 32, 8, 128, 4096),
              (8, 32, 32, 128, 544)]
    for shape in shapes:
        for dtype in (torch.bfloat16, torch.float32):
            print(attention_row(shape, dtype, args, flush), flush=True)
    for row in layer_ops_rows(576, 9, 3, 64, args, flush):
        print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
