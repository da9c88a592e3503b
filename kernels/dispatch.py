"""Heuristic dataflow for the linear layers of decode (FlashDecoding++ §5).

For each weight shape ``[N, K]`` of a model, the best GEMM implementation changes with ``M`` (the
number of tokens in the step). Profiled offline, each ``[N, K]`` gets two inflection points:

    M <= M1        -> "flat":  Triton int4 flat GEMM, M tile 16 (``flat_gemm_int4``)
    M1 < M <= M2   -> "tiled": the same kernel with a 64-row M tile
    M  > M2        -> "torch": torch.matmul (cuBLAS) on the dequantized weight

``GemmDispatchTable`` holds the table (JSON in ``profiles/``), ``profile_inflection_points``
measures it, ``Int4Linear`` dispatches by M. Run offline on the GPU:

    python -m localgen.kernels.dispatch --shapes 2048x2048,8192x2048,2048x8192 --out gemm.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from dataclasses import dataclass, field
from typing import Callable

import torch

from .quant_ref import QuantizedWeight, dequantize_weight, quantize_weight

IMPLS = ("flat", "tiled", "torch")
DEFAULT_MS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
NO_LIMIT = 1 << 30


def choose_impl(m: int, m1: int, m2: int) -> str:
    return "flat" if m <= m1 else ("tiled" if m <= m2 else "torch")


def inflection_points(timings: dict[int, dict[str, float]]) -> tuple[int, int]:
    """(M1, M2) from ``{M: {impl: seconds}}``: M1 is the last M of the leading run where "flat" is
    fastest, M2 the last M before "torch" is fastest for good (FlashDecoding++ §5 assumes the
    order flat -> tiled -> cuBLAS as M grows). ``NO_LIMIT`` where a later impl never wins."""
    ms = sorted(timings)
    best = {m: min(timings[m], key=timings[m].get) for m in ms}
    m1 = 0
    for m in ms:
        if best[m] != "flat":
            break
        m1 = m
    m2 = m1
    for m in ms:
        if m <= m1:
            continue
        if best[m] == "torch":
            break
        m2 = m
    if all(best[m] != "torch" for m in ms if m > m1):
        m2 = NO_LIMIT
    if m2 == NO_LIMIT and all(best[m] == "flat" for m in ms):
        m1 = NO_LIMIT
    return m1, m2


@dataclass
class GemmDispatchTable:
    """``{(N, K): (M1, M2)}`` for one GPU and dtype; unknown shapes use ``default``."""

    entries: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)
    default: tuple[int, int] = (16, 128)
    device_name: str = ""
    dtype: str = "bfloat16"

    def points(self, n: int, k: int) -> tuple[int, int]:
        return self.entries.get((n, k), self.default)

    def impl(self, m: int, n: int, k: int) -> str:
        return choose_impl(m, *self.points(n, k))

    def to_json(self) -> dict:
        return {"device_name": self.device_name, "dtype": self.dtype, "default": list(self.default),
                "entries": [{"N": n, "K": k, "M1": a, "M2": b}
                            for (n, k), (a, b) in sorted(self.entries.items())]}

    @classmethod
    def from_json(cls, d: dict) -> "GemmDispatchTable":
        return cls({(e["N"], e["K"]): (e["M1"], e["M2"]) for e in d.get("entries", [])},
                   tuple(d.get("default", (16, 128))), d.get("device_name", ""),
                   d.get("dtype", "bfloat16"))

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=2)

    @classmethod
    def load(cls, path: str) -> "GemmDispatchTable":
        with open(path) as f:
            return cls.from_json(json.load(f))


class Int4Linear:
    """``y = x @ W.T`` with W int4 (FlexGen §5), dispatched by M over ``IMPLS`` (FlashDecoding++
    §5). The dense weight for the "torch" path is dequantized once, on first use."""

    def __init__(self, qw: QuantizedWeight, table: GemmDispatchTable | None = None,
                 dtype: torch.dtype = torch.bfloat16):
        self.qw, self.table, self.dtype = qw, table or GemmDispatchTable(), dtype
        self._dense: torch.Tensor | None = None

    def dense(self) -> torch.Tensor:
        if self._dense is None:
            self._dense = dequantize_weight(self.qw, self.dtype)
        return self._dense

    def run(self, impl: str, x: torch.Tensor) -> torch.Tensor:
        if impl == "torch" or (not x.is_cuda and not _interpreting()):
            return torch.matmul(x, self.dense().t())
        from .flat_gemm import flat_gemm_int4
        return flat_gemm_int4(x, self.qw, block_m=16 if impl == "flat" else 64)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n, k = self.qw.shape
        lead = x.shape[:-1]
        x2 = x.reshape(-1, k)
        return self.run(self.table.impl(x2.shape[0], n, k), x2).reshape(*lead, n)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def cuda_timer(fn: Callable[[], object], warmup: int = 5, repeat: int = 20) -> float:
    """Median seconds of ``fn`` by CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def profile_inflection_points(n: int, k: int, ms=DEFAULT_MS, device="cuda",
                              dtype: torch.dtype = torch.bfloat16,
                              timer: Callable[[Callable[[], object]], float] | None = None
                              ) -> tuple[tuple[int, int], dict[int, dict[str, float]]]:
    """Time every impl at each M for a random ``[N, K]`` int4 weight -> ((M1, M2), timings)."""
    timer = timer or cuda_timer
    w = torch.randn(n, k, device=device, dtype=torch.float32) * 0.02
    lin = Int4Linear(quantize_weight(w), dtype=dtype)
    lin.dense()
    timings: dict[int, dict[str, float]] = {}
    for m in ms:
        x = torch.randn(m, k, device=device, dtype=dtype)
        timings[m] = {impl: timer(lambda impl=impl: lin.run(impl, x)) for impl in IMPLS}
    return inflection_points(timings), timings


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="profile GEMM inflection points M1/M2 per [N, K]")
    ap.add_argument("--shapes", required=True, help="comma list of NxK, e.g. 4096x4096,11008x4096")
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default=",".join(map(str, DEFAULT_MS)))
    args = ap.parse_args(argv)
    ms = [int(m) for m in args.ms.split(",")]
    table = GemmDispatchTable(device_name=torch.cuda.get_device_name())
    raw = []
    for s in args.shapes.split(","):
        n, k = (int(v) for v in s.lower().split("x"))
        (m1, m2), t = profile_inflection_points(n, k, ms)
        table.entries[(n, k)] = (m1, m2)
        raw.append({"N": n, "K": k, "M1": m1, "M2": m2,
                    "us": {str(m): {i: round(v * 1e6, 2) for i, v in d.items()} for m, d in t.items()}})
        print(f"[{n}, {k}]: M1={m1} M2={m2}  " + "  ".join(
            f"M={m}:{min(d, key=d.get)}" for m, d in t.items()), flush=True)
    d = table.to_json()
    d["timings"] = raw
    with open(args.out, "w") as f:
        json.dump(d, f, indent=2)


if __name__ == "__main__":
    main()
