"""Measured int4 GEMM times for the cost model: the timings behind the GPU's GEMM dispatch table
(``profiles/gemm_<gpu>_<dtype>.json``, written by ``python -m localgen.kernels.dispatch``;
FlashDecoding++ §5's per-``[N, K]`` profile of each implementation over M).

localgen's 4-bit linear layers do not run FlexGen's dequantize-then-GEMM (§5) at every call: below
the inflection point M2 the Triton flat GEMM reads the packed codes and dequantizes in registers,
above it one Triton launch dequantizes and cuBLAS multiplies. A layer's GEMM time is then the sum,
over its matrices, of the fastest measured implementation at that M. Reading the JSON needs no
torch (the policy package stays light).
"""

from __future__ import annotations

import functools

from localgen.profile_files import gemm_profile_dicts

US = 1e-6


class GemmTimes:
    """Best measured seconds of ``x [M, K] @ W.T`` for 4-bit ``W [N, K]``, by ``(N, K)``.

    ``best``: ``(N, K) -> sorted [(M, microseconds)]``, the fastest implementation at each
    measured M. Between measured M the time is interpolated linearly; below the smallest M it is
    that M's time (a GEMM this small reads the weight, whatever M is); above the largest it grows
    along the last segment's slope (compute-bound: linear in M)."""

    def __init__(self, best: dict[tuple[int, int], list[tuple[int, float]]]):
        self.best = best

    @classmethod
    def from_json(cls, d: dict) -> "GemmTimes":
        best = {}
        for e in d.get("timings", []):
            pts = sorted((int(m), min(t.values())) for m, t in e["us"].items() if t)
            if pts:
                best[(int(e["N"]), int(e["K"]))] = pts
        return cls(best)

    def covers(self, shapes: list[tuple[int, int]]) -> bool:
        return all(s in self.best for s in shapes)

    def seconds(self, n: int, k: int, m: float) -> float:
        """Seconds for one ``[m, k] @ [n, k].T`` GEMM. Raises KeyError for an unmeasured shape."""
        pts = self.best[(n, k)]
        if m <= pts[0][0]:
            return pts[0][1] * US
        if len(pts) == 1:
            return pts[0][1] * US * m / pts[0][0]
        for (m0, t0), (m1, t1) in zip(pts, pts[1:]):
            if m <= m1:
                return (t0 + (t1 - t0) * (m - m0) / (m1 - m0)) * US
        (m0, t0), (m1, t1) = pts[-2], pts[-1]
        return (t1 + (t1 - t0) * (m - m1) / (m1 - m0)) * US

    def layer_seconds(self, shapes: list[tuple[int, int]], m: float) -> float:
        """Sum over a layer's matrices ``shapes`` (``(N, K)`` each) at the same M."""
        return sum(self.seconds(n, k, m) for n, k in shapes)


@functools.lru_cache(maxsize=None)
def gemm_times(device_name: str | None, dtype: str = "float16") -> GemmTimes | None:
    """The timings for ``device_name`` (as CUDA names it) and ``dtype``, merged over the
    dispatcher's files (``gemm_profile_dicts``); None when no file matches."""
    if not device_name:
        return None
    merged: dict = {}
    for d in gemm_profile_dicts(device_name, dtype):
        merged.update(GemmTimes.from_json(d).best)
    return GemmTimes(merged) if merged else None
