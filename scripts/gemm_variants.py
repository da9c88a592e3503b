"""Int4 flat GEMM variants on CUDA: each checked against float64 and timed as CUDA-graph replays
over weights rotated past L2 (``dispatch.cuda_timer``), beside cuBLAS on the dense fp16/bf16
weight (the peer a 4-bit weight must beat: it reads 4x the bytes) and the bytes-over-bandwidth
floor. Prints one row per (shape, M, variant): microseconds, GB/s of weight bytes, x cuBLAS.

    python scripts/gemm_variants.py --shapes 4096x4096,11008x4096,4096x11008 --ms 1,4,16 \
        --variants '{}' '{"deq": 0}' '{"block_k": 128}'
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_selftest import _alias_kernels  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="4096x4096,11008x4096,4096x11008,22016x4096")
    ap.add_argument("--ms", default="1,2,4,8,16")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    ap.add_argument("--variants", nargs="*", default=["{}"], help="JSON kwargs of flat_gemm_int4")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    _alias_kernels()
    from localgen.kernels.dispatch import cuda_timer, rotation_copies
    from localgen.kernels.flat_gemm import flat_gemm_int4
    from localgen.kernels.quant_ref import dequantize_weight, quantize_weight

    dtype = getattr(torch, a.dtype)
    variants = [json.loads(v) for v in a.variants]
    rows = []
    print(torch.cuda.get_device_name(), "torch", torch.__version__, a.dtype, flush=True)
    for s in a.shapes.split(","):
        n, k = (int(v) for v in s.split("x"))
        ws = [quantize_weight(torch.randn(n, k, device="cuda") * 0.02)
              for _ in range(rotation_copies(n * k // 2))]
        dense = [dequantize_weight(w, dtype) for w in ws[:rotation_copies(2 * n * k)]]
        wbytes = sum(t.numel() * t.element_size() for t in (ws[0].packed, ws[0].scale, ws[0].min))
        for m in (int(x) for x in a.ms.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            ref = (x.double() @ dequantize_weight(ws[0], torch.float64).T)
            t_cublas = cuda_timer([lambda d=d: x @ d.T for d in dense])
            for kw in variants:
                try:
                    out = flat_gemm_int4(x, ws[0], **kw)
                    err = float((out.double() - ref).norm() / ref.norm())
                    t = cuda_timer([lambda w=w: flat_gemm_int4(x, w, **kw) for w in ws])
                except Exception as e:  # noqa: BLE001  (a variant that does not compile: report it)
                    print(f"[{n},{k}] M={m} {kw}: FAILED {e!r}"[:300], flush=True)
                    continue
                row = {"N": n, "K": k, "M": m, "variant": kw, "us": t * 1e6, "rel_err": err,
                       "GBps": wbytes / t / 1e9, "cublas_us": t_cublas * 1e6, "vs_cublas": t_cublas / t}
                rows.append(row)
                print(f"[{n:5d},{k:5d}] M={m:3d} {json.dumps(kw):32s} {t * 1e6:8.2f} us  "
                      f"{row['GBps']:7.0f} GB/s  cuBLAS dense {t_cublas * 1e6:7.2f} us  "
                      f"x{row['vs_cublas']:.2f}  err {err:.1e}{'' if err < 1e-2 else '  FAIL'}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["rel_err"] < 1e-2 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
