"""On CUDA: the int4 flat GEMM's bias added in its store equals ``y + bias`` bit for bit (fp16,
bf16; no K split and K split), and the dispatcher call with a bias takes that path."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_selftest import _alias_kernels  # noqa: E402

_alias_kernels()
from localgen.kernels.flat_gemm import flat_gemm_int4  # noqa: E402
from localgen.quant import int4  # noqa: E402

ok = True
for dtype in (torch.float16, torch.bfloat16):
    for n, k, m, split_k in ((7168, 7168, 8, 1), (21504, 7168, 8, 1), (7168, 28672, 8, 4),
                             (200, 256, 3, 1)):
        t = int4.quantize(torch.randn(n, k, device="cuda"), 64, dim=0)
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        b = torch.randn(n, device="cuda", dtype=dtype)
        same = torch.equal(flat_gemm_int4(x, t, bias=b, split_k=split_k),
                           flat_gemm_int4(x, t, split_k=split_k) + b)
        ok &= same
        print(f"{str(dtype):15s} N {n:6d} K {k:6d} M {m} split_k {split_k}: "
              f"{'equal' if same else 'DIFFERENT'}", flush=True)
print("bias epilogue check:", "ok" if ok else "FAILED")
