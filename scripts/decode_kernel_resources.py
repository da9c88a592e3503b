"""Registers, spills and shared memory of the compiled paged decode kernels (issue 5), on one CUDA
GPU, and the programs per SM they allow: what ``decode_config``'s ``resident_per_sm`` stands for.

Runs the bench's shape (32 query heads, 8 KV heads, head_dim 128, bf16) once per variant (sync,
async, int4, int4 async, split and unsplit), then reads Triton's compiled-kernel cache.

    python3 scripts/decode_kernel_resources.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from localgen.bench.kernels_bench import (import_kernels, quantize_chunked,  # noqa: E402
                                          random_paged_case)


def compiled_kernels(jit_fn):
    """(key, CompiledKernel) pairs from a JITFunction's per-device caches (Triton 3.x)."""
    for cache in getattr(jit_fn, "device_caches", {}).values():
        kernels = cache[0] if isinstance(cache, tuple) else cache
        yield from kernels.items()


def constexprs(kern, names=("ASYNC", "QUANT", "ONE_SPLIT", "FUSED", "BLOCK_N")) -> str:
    """The named constexpr values a kernel was compiled with, from its ASTSource."""
    src = kern.src
    fn = getattr(src, "fn", None)
    got = {}
    for k, v in getattr(src, "constants", {}).items():
        idx = k[0] if isinstance(k, tuple) else k
        name = fn.arg_names[idx] if isinstance(idx, int) and fn is not None else str(idx)
        if name in names:
            got[name] = v
    return " ".join(f"{n}={got[n]}" for n in names if n in got)


def main() -> None:
    pd, _, qr = import_kernels()
    q, k, v, tables, lens = random_paged_case(8, 4096, torch.Generator(device="cuda").manual_seed(0))
    qk, qv = quantize_chunked(k, qr), quantize_chunked(v, qr)
    for splits in (1, 4):
        for phi in (None, 0.0):
            pd.paged_decode_attention(q, k, v, tables, lens, 0.088, phi=phi, num_splits=splits)
            pd.paged_decode_attention_int4(q, qk, qv, tables, lens, 0.088, phi=phi,
                                           num_splits=splits)
    torch.cuda.synchronize()
    props = torch.cuda.get_device_properties(0)
    regs_per_sm = getattr(props, "regs_per_multiprocessor", 65536)
    smem_per_sm = getattr(props, "shared_memory_per_multiprocessor", 233472)
    print(f"{props.name}: {props.multi_processor_count} SMs, {regs_per_sm} registers and "
          f"{smem_per_sm} B shared memory per SM")
    for _, kern in compiled_kernels(pd._decode_stage1):
        md = kern.metadata
        warps = md.num_warps
        shared = md.shared
        by_regs = regs_per_sm // max(1, kern.n_regs * 32 * warps)
        by_smem = smem_per_sm // shared if shared else 99
        print(f"regs {kern.n_regs:4d} spills {kern.n_spills:4d} shared {shared:6d} B warps {warps} "
              f"stages {md.num_stages}: {min(by_regs, by_smem)} programs per SM "
              f"(registers {by_regs}, shared {by_smem})  {constexprs(kern)}")


if __name__ == "__main__":
    main()
