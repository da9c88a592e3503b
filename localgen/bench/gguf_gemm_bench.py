"""GGUF-quantized matmul on CUDA: the Triton kernels of ``kernels/gguf_gemm.py`` beside the
read-bandwidth bound and cuBLAS on the same weights in bf16, measured in one run.

    python -m localgen.bench.gguf_gemm_bench --out gguf_gemm.json

For each weight shape (Llama-2-7B's by default), type and M: the kernel's time per call (CUDA-graph
replays over weight copies that together exceed L2, as in a decode step), the bytes of
quantized weight it must read, those bytes over a measured read-only pass's rate (the floor),
and ``x @ W_bf16.T`` with the dequantized weight resident (what an expanded model runs).
Weights are random blocks with finite scales; speed does not depend on the values.
"""

from __future__ import annotations

import argparse
import functools

import torch

from localgen.fileio import atomic_write_json

SHAPES = {"7b_qkvo": (4096, 4096), "7b_gate_up": (11008, 4096), "7b_down": (4096, 11008)}


def _random_blocks(qtype: int, n: int, k: int, device) -> torch.Tensor:
    from localgen.kernels import gguf_gemm

    nb, bb = k // gguf_gemm.BLOCK_WEIGHTS[qtype], gguf_gemm.BLOCK_BYTES[qtype]
    raw = torch.randint(0, 256, (n, nb, bb), dtype=torch.uint8, device=device)
    scales = {2: (0,), 8: (0,), 12: (0, 2), 13: (0, 2), 14: (208,)}[qtype]
    for off in scales:
        d = (torch.rand(n, nb, device=device) / 64).to(torch.float16)
        raw[:, :, off:off + 2] = d.view(torch.uint8).view(n, nb, 2)
    return raw.view(n, nb * bb)


def _time_us(fns, reps: int = 20) -> float:
    """Median microseconds per call of ``fns`` (one call per weight copy, so each call reads its
    weight from memory, not L2), replayed as one CUDA graph so that launch costs are not timed:
    the engine replays its decode steps as CUDA graphs too."""
    import triton.testing

    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for fn in fns:  # warm-up: compile and allocate outside the capture
            fn()
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for fn in fns:
            fn()
    return triton.testing.do_bench(graph.replay, warmup=5, rep=reps * 10,
                                   return_mode="median") * 1e3 / len(fns)


def _copies(nbytes: int) -> int:
    """Weight copies to rotate through so that together they are 4x 60 MB, more than the L2
    of the GPUs the kernels are tuned for, so that every timed call reads its weight from HBM."""
    return max(2, -(-4 * 60_000_000 // nbytes))

def read_gbps(device) -> float:
    """GB/s of a read-only pass (a sum) over 1 GiB: the bound of a kernel that reads W once."""
    src = torch.ones(1 << 28, dtype=torch.float32, device=device)
    us = _time_us([lambda: src.sum()])
    return src.numel() * 4 / us / 1e3


def run(shapes: dict[str, tuple[int, int]], qtypes: list[int], ms: list[int],
        block_ns: list[int], dtype: torch.dtype = torch.bfloat16) -> dict:
    """One row per (shape, type, M): the best of ``block_ns`` (output rows a program) for the
    fused kernel; the prefill path (M > 16) has no such choice."""
    from localgen.kernels import gguf_gemm

    dev = torch.device("cuda")
    floor = read_gbps(dev)
    rows = []
    for name, (n, k) in shapes.items():
        for qt in qtypes:
            raws = [_random_blocks(qt, n, k, dev) for _ in range(_copies(n * k // 2))]
            w16s = [gguf_gemm.dequantize(r, qt, k, dtype) for r in raws[:_copies(n * k * 2)]]
            raw, w16 = raws[0], w16s[0]
            for m in ms:
                x = torch.randn(m, k, device=dev, dtype=dtype)
                ref = x.float() @ w16.float().t()
                err = (gguf_gemm.matmul(x, raw, qt, k).float() - ref).abs().max()
                blocks = block_ns if m <= gguf_gemm.DECODE_MAX_M else block_ns[:1]
                tried = {bn: _time_us([functools.partial(gguf_gemm.matmul, x, r, qt, k, block_n=bn)
                                       for r in raws]) for bn in blocks}
                block_n = min(tried, key=tried.get)
                ours = tried[block_n]
                cublas = _time_us([functools.partial(torch.matmul, x, w.t()) for w in w16s])
                rows.append(dict(shape=name, n=n, k=k, qtype=qt, m=m, us=ours, block_n=block_n,
                                 us_by_block_n=tried, cublas_bf16_us=cublas,
                                 weight_bytes=raw.numel(), gbps=raw.numel() / ours / 1e3,
                                 share_of_read=raw.numel() / ours / 1e3 / floor,
                                 speedup_vs_bf16=cublas / ours, max_abs_err=float(err)))
                r = rows[-1]
                print(f"{name:11s} {n:5d}x{k:5d} type {qt:2d} M={m:4d}: {ours:8.1f} us "
                      f"(BN {block_n:3d}, {r['gbps']:6.0f} GB/s, {r['share_of_read']:5.1%} of read) "
                      f"bf16 cuBLAS {cublas:8.1f} us -> {cublas / ours:5.2f}x  err {float(err):.2e}",
                      flush=True)
            del raws, w16s
    return dict(device=torch.cuda.get_device_name(), read_gbps=floor, dtype=str(dtype),
                rows=rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--qtypes", default="12,14,8,13,2", help="GGMLQuantizationType values")
    p.add_argument("--ms", default="1,4,16,64,512")
    p.add_argument("--block-n", default="32,64,128", help="output rows a program, tried per cell")
    a = p.parse_args()
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    atomic_write_json(a.out, run(SHAPES, ints(a.qtypes), ints(a.ms), ints(a.block_n)))


if __name__ == "__main__":
    main()
