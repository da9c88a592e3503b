"""Heuristic dataflow for the linear layers of decode (FlashDecoding++ §5).

For each weight shape ``[N, K]`` of a model, the best GEMM implementation changes with ``M`` (the
number of tokens in the step). Profiled offline, each ``[N, K]`` gets two inflection points:

    M <= M1        -> "flat":  Triton int4 flat GEMM, M tile 16 (``flat_gemm_int4``)
    M1 < M <= M2   -> "tiled": the same kernel with a 64-row M tile
    M  > M2        -> "torch": torch.matmul (cuBLAS) on the dequantized weight

``GemmDispatchTable`` holds the table (JSON in ``profiles/``), ``profile_inflection_points``
measures it, ``route`` is the whole routing decision (a pure function of device type, M, [N, K],
weight layout and table) and ``Int4Linear`` calls what it picks. Shapes the table lacks use
``DEFAULT_POINTS`` (M1=16: one 16-row tile of the flat kernel; M2=2048: the 64-row tiled kernel
below that, dequantize + cuBLAS above, where the dequantization's fixed cost is small against
the GEMM; the shipped tables are in ``profiles/gemm_*.json``). Off CUDA every M takes the
reference twin (dequantize + ``torch.matmul``).

Both int4 weight layouts run in the Triton kernel: FlexGen's g=64 along the output channels
(``group_dim`` 0) and GGUF Q4_1's g=32 along the input channels (``group_dim`` 1, see
``flat_gemm``); a table may hold points per layout (JSON ``"group_dim": 1``), else the layout-0
points of the shape serve both. Run offline on the GPU:

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

from localgen.fileio import atomic_write_json

from .quant_ref import QuantizedWeight, dequantize_weight, quantize_weight

IMPLS = ("flat", "tiled", "torch")
REFERENCE = "reference"  # off CUDA: dequantize + torch.matmul, the pure-torch twin
DEFAULT_MS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
DEFAULT_POINTS = (16, 2048)
NO_LIMIT = 1 << 30
# a streamed (uncached) weight is dequantized this many bytes at a time for the dequantize +
# matmul paths: a prefill GEMM then holds its output and one slice, not the whole dense matrix
# (Llama-2-7B's fused gate/up: 64 MiB against 172 MiB, what fits a 4-bit model under a 6 GiB cap)
DENSE_CHUNK_BYTES = 64 << 20


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
        m2 = _extrapolated_crossover(timings, ms)
    if all(best[m] == "flat" for m in ms):
        m1 = m2  # flat up to where cuBLAS takes over
    return min(m1, m2), m2


def _extrapolated_crossover(timings: dict[int, dict[str, float]], ms: list[int]) -> int:
    """Where cuBLAS would overtake the Triton kernels past the largest M measured: lines through
    the last two Ms of the faster kernel and of "torch" (a kernel's time grows with M at its
    tensor-core rate, "torch"'s fixed dequantization cost does not), ``NO_LIMIT`` when they do
    not meet. A sweep that stops at M=1024 may see no crossover while a prefill runs thousands of
    tokens: the extrapolation places M2 where the two lines would meet."""
    if len(ms) < 2 or any("torch" not in timings[m] for m in ms[-2:]):
        return NO_LIMIT
    a, b = ms[-2], ms[-1]
    kernel = min((i for i in timings[b] if i != "torch"), key=timings[b].get, default=None)
    if kernel is None or kernel not in timings[a]:
        return NO_LIMIT
    gap = timings[b]["torch"] - timings[b][kernel]
    grow = (timings[b][kernel] - timings[a][kernel]) - (timings[b]["torch"] - timings[a]["torch"])
    if grow <= 0:
        return NO_LIMIT
    return b + int(gap / grow * (b - a))


@dataclass
class GemmDispatchTable:
    """``{(N, K): (M1, M2)}`` for one GPU and dtype (FlexGen layout); ``(N, K, 1)`` keys hold
    points measured on the GGUF layout (grouped along K). Unknown shapes use ``default``."""

    entries: dict[tuple[int, ...], tuple[int, int]] = field(default_factory=dict)
    default: tuple[int, int] = DEFAULT_POINTS
    device_name: str = ""
    dtype: str = "bfloat16"

    def points(self, n: int, k: int, group_dim: int = 0) -> tuple[int, int]:
        if group_dim and (n, k, group_dim) in self.entries:
            return self.entries[(n, k, group_dim)]
        return self.entries.get((n, k), self.default)

    def impl(self, m: int, n: int, k: int, group_dim: int = 0) -> str:
        return choose_impl(m, *self.points(n, k, group_dim))

    def to_json(self) -> dict:
        return {"device_name": self.device_name, "dtype": self.dtype, "default": list(self.default),
                "entries": [{"N": key[0], "K": key[1], "M1": a, "M2": b,
                             **({"group_dim": key[2]} if len(key) > 2 else {})}
                            for key, (a, b) in sorted(self.entries.items())]}

    @classmethod
    def from_json(cls, d: dict) -> "GemmDispatchTable":
        def key(e):
            return (e["N"], e["K"], e["group_dim"]) if e.get("group_dim") else (e["N"], e["K"])
        return cls({key(e): (e["M1"], e["M2"]) for e in d.get("entries", [])},
                   tuple(d.get("default", DEFAULT_POINTS)), d.get("device_name", ""),
                   d.get("dtype", "bfloat16"))

    def save(self, path: str) -> None:
        """Write ``to_json()`` to ``path`` atomically. Raises OSError naming the path."""
        atomic_write_json(path, self.to_json())

    @classmethod
    def load(cls, path: str) -> "GemmDispatchTable":
        with open(path) as f:
            return cls.from_json(json.load(f))


def route(device_type: str, m: int, n: int, k: int, table: GemmDispatchTable,
          group_dim: int = 0) -> str:
    """The implementation for ``x [M, K] @ W.T`` with an int4 ``W [N, K]``: on CUDA one of
    ``IMPLS`` by M from ``table`` (FlashDecoding++ §5), elsewhere ``REFERENCE``."""
    if device_type != "cuda":
        return REFERENCE
    return table.impl(m, n, k, group_dim)


class Int4Linear:
    """``y = x @ W.T (+ bias)`` with W int4, dispatched by M over ``IMPLS`` (FlashDecoding++ §5)
    through ``route``. ``qw``: a ``QuantizedWeight`` in either layout, or a
    ``localgen.quant.Int4Tensor`` (the same fields). With ``cache_dense`` the dense weight for the "torch" and
    reference paths is dequantized once, on first use, and kept; without it (a streamed layer,
    where keeping it would undo the compression) it is dequantized on each such call."""

    def __init__(self, qw: QuantizedWeight, table: GemmDispatchTable | None = None,
                 dtype: torch.dtype = torch.bfloat16, cache_dense: bool = True):
        self.qw, self.table, self.dtype = qw, table or GemmDispatchTable(), dtype
        self.group_dim = qw.dim
        self.cache_dense = cache_dense
        self._dense: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.qw.shape)

    def dense(self) -> torch.Tensor:
        if self._dense is not None:
            return self._dense
        w = _dequantize(self.qw, self.dtype)
        if self.cache_dense:
            self._dense = w
        return w

    def dense_rows(self, n0: int, n1: int) -> torch.Tensor:
        """Rows ``n0 .. n1-1`` of the dense weight (``n0`` a multiple of ``row_align``)."""
        q, g = self.qw, self.qw.group_size
        if q.dim == 0:  # codes paired and grouped along N
            part = QuantizedWeight(q.packed[n0 // 2:-(-n1 // 2)], q.scale[n0 // g:-(-n1 // g)],
                                   q.min[n0 // g:-(-n1 // g)], g, 0)
        else:
            part = QuantizedWeight(q.packed[n0:n1], q.scale[n0:n1], q.min[n0:n1], g, 1)
        return _dequantize(part, self.dtype)

    @property
    def row_align(self) -> int:
        """Row slices start at multiples of this (whole groups and nibble pairs)."""
        g = self.qw.group_size
        return g if self.group_dim == 0 else 1

    def _dense_matmul(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """``x @ W.T`` through the dense weight: the cached one, else dequantized in row slices of
        at most ``DENSE_CHUNK_BYTES``, each GEMM writing its columns of ``out`` in place."""
        n, k = self.shape
        align = self.row_align
        rows = max(align, DENSE_CHUNK_BYTES // (k * x.element_size()) // align * align)
        if self.cache_dense or rows >= n:
            return torch.matmul(x, self.dense().to(x.dtype).t(), out=out)
        if out is None:
            out = x.new_empty(x.shape[0], n)
        for n0 in range(0, n, rows):
            n1 = min(n, n0 + rows)
            torch.mm(x, self.dense_rows(n0, n1).to(x.dtype).t(), out=out[:, n0:n1])
        return out

    def route(self, x2: torch.Tensor) -> str:
        """``route`` for this weight and a ``[M, K]`` input (under TRITON_INTERPRET=1 a CPU tensor
        counts as CUDA, so the CPU tests run the Triton kernels)."""
        n, k = self.shape
        dev = "cuda" if (x2.is_cuda or _interpreting()) else x2.device.type
        return route(dev, x2.shape[0], n, k, self.table, self.group_dim)

    def run(self, impl: str, x: torch.Tensor, out: torch.Tensor | None = None,
            bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [M, K] @ W.T (+ bias)`` by ``impl`` (``out``: an ``[M, N]`` tensor to write
        into). The Triton kernel adds the bias in its store, a launch fewer per call."""
        if impl in ("torch", REFERENCE) or (not x.is_cuda and not _interpreting()):
            y = self._dense_matmul(x, out)
            return y if bias is None else y + bias
        from .flat_gemm import choose_split_k, flat_gemm_int4
        from .triton_common import num_sms
        block_m = 16 if impl == "flat" else 64
        n, k = self.shape
        split_k = 1
        if x.is_cuda:
            split_k = choose_split_k(x.shape[0], n, k, num_sms(x.device, 1), block_m)
        return flat_gemm_int4(x, self.qw, block_m=block_m, split_k=split_k, out=out, bias=bias)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        n, k = self.shape
        lead = x.shape[:-1]
        x2 = x.reshape(-1, k)
        y = self.run(self.route(x2), x2, bias=bias)
        return y.reshape(*lead, n)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _dequantize(qw: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    if qw.packed.is_cuda or _interpreting():  # one Triton launch, not six torch passes
        from .dequant import dequantize_weight as dequantize_triton
        return dequantize_triton(qw, dtype)
    return dequantize_weight(qw, dtype)


def cuda_timer(fns: Callable[[], object] | list[Callable[[], object]], warmup: int = 3,
               repeat: int = 20) -> float:
    """Median GPU seconds of one call: ``fns`` (one callable or several, e.g. the same GEMM over
    different weights) captured once each in a CUDA graph whose replays are timed by CUDA events,
    divided by the number of calls. A graph times the kernels, not the Python that launches them
    (eager event timing of one call would add the launch overhead, alike for every shape and M);
    callables over weights that together exceed the L2 cache time HBM reads, as a model's
    consecutive layers do."""
    fns = fns if isinstance(fns, list) else [fns]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream (compilation, allocator)
        for _ in range(warmup):
            for fn in fns:
                fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / len(fns))
    return statistics.median(times)


L2_ROTATE_BYTES = 256 << 20  # weights rotated through per timing: several times any GPU's L2


def rotation_copies(nbytes: int, most: int = 16) -> int:
    """How many copies of an ``nbytes`` operand a timing rotates through so that together they
    pass ``L2_ROTATE_BYTES`` (1 for operands that large already, at most ``most``)."""
    return max(1, min(most, L2_ROTATE_BYTES // max(1, nbytes)))


LAYOUTS = {"n64": 0, "k32": 1}  # FlexGen §5 (along output channels, g=64); GGUF Q4_1 (input, g=32)


def profile_inflection_points(n: int, k: int, ms=DEFAULT_MS, device="cuda",
                              dtype: torch.dtype = torch.bfloat16,
                              timer: Callable[[Callable[[], object]], float] | None = None,
                              group_dim: int = 0, dense_cached: bool = False
                              ) -> tuple[tuple[int, int], dict[int, dict[str, float]]]:
    """Time every impl at each M for a random ``[N, K]`` int4 weight -> ((M1, M2), timings).

    "torch" is timed as the runtime runs it: dequantize + ``torch.matmul`` on every call (the
    runtime keeps only the 4-bit weight); ``dense_cached`` times cuBLAS on a kept dense weight
    instead (FlashDecoding++'s comparison, for a runtime that can afford the dense copy)."""
    timer = timer or cuda_timer
    lins = []
    for _ in range(rotation_copies(n * k // 2)):  # int4: N*K/2 bytes a weight
        w = torch.randn(n, k, device=device, dtype=torch.float32) * 0.02
        lin = Int4Linear(quantize_weight(w, 32 if group_dim else 64, group_dim), dtype=dtype,
                         cache_dense=dense_cached)
        lin.dense()
        lins.append(lin)
    timings: dict[int, dict[str, float]] = {}
    for m in ms:
        x = torch.randn(m, k, device=device, dtype=dtype)
        timings[m] = {impl: timer([lambda lin=lin, impl=impl: lin.run(impl, x) for lin in lins])
                      for impl in IMPLS}
    return inflection_points(timings), timings


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="profile GEMM inflection points M1/M2 per [N, K]")
    ap.add_argument("--shapes", required=True, help="comma list of NxK, e.g. 4096x4096,11008x4096")
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default=",".join(map(str, DEFAULT_MS)))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--layouts", default="n64",
                    help="comma list of weight layouts: n64 (FlexGen, g=64 along N), k32 (GGUF Q4_1)")
    ap.add_argument("--dense-cached", action="store_true",
                    help="time 'torch' on a kept dense weight (default: dequantize every call, "
                         "as the runtime does)")
    args = ap.parse_args(argv)
    ms = [int(m) for m in args.ms.split(",")]
    dtype = getattr(torch, args.dtype)
    table = GemmDispatchTable(device_name=torch.cuda.get_device_name(), dtype=args.dtype)
    raw = []
    for layout in args.layouts.split(","):
        gd = LAYOUTS[layout]
        for s in args.shapes.split(","):
            n, k = (int(v) for v in s.lower().split("x"))
            (m1, m2), t = profile_inflection_points(n, k, ms, dtype=dtype, group_dim=gd,
                                                    dense_cached=args.dense_cached)
            table.entries[(n, k, gd) if gd else (n, k)] = (m1, m2)
            raw.append({"N": n, "K": k, "layout": layout, "M1": m1, "M2": m2,
                        "us": {str(m): {i: round(v * 1e6, 2) for i, v in d.items()}
                               for m, d in t.items()}})
            print(f"{layout} [{n}, {k}]: M1={m1} M2={m2}  " + "  ".join(
                f"M={m}:{min(d, key=d.get)}({min(d.values()) * 1e6:.1f}us)" for m, d in t.items()),
                flush=True)
    d = table.to_json()
    d["dense_cached"] = args.dense_cached
    d["timings"] = raw
    atomic_write_json(args.out, d)


if __name__ == "__main__":
    main()
