"""Policy: where every tensor lives and how the zig-zag block schedule batches (FlexGen §4.2,
App. A.3).

This is the one dataclass the offload runtime consumes. Fractions are of the whole model, cache
and activations: ``wg/wc/wd`` weights on GPU/CPU/disk, ``cg/cc/cd`` KV cache, ``hg/hc/hd``
activations (hidden states). A zig-zag block (FlexGen §4.1) is ``bls = gbs * num_gpu_batches`` sequences that share
each loaded layer; it is not the paged cache's 16-token KV block.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

FRACTIONS = ("wg", "wc", "wd", "cg", "cc", "cd", "hg", "hc", "hd")
_GROUPS = {"weights": ("wg", "wc", "wd"), "cache": ("cg", "cc", "cd"), "activations": ("hg", "hc", "hd")}
SUM_TOL = 1e-6


@dataclass
class Policy:
    """An offloading policy (FlexGen §4.2 notation).

    Raises ValueError from ``validate`` (also called by ``from_dict``) naming the field at fault:
    a batch size < 1, a fraction outside [0, 1], or a group not summing to 1 within 1e-6.
    """

    gbs: int = 1  # GPU batch size
    num_gpu_batches: int = 1
    wg: float = 1.0
    wc: float = 0.0
    wd: float = 0.0
    cg: float = 1.0
    cc: float = 0.0
    cd: float = 0.0
    hg: float = 1.0
    hc: float = 0.0
    hd: float = 0.0
    compress_weight: bool = False  # 4-bit group-wise, g=64 (FlexGen §5)
    compress_cache: bool = False
    cpu_cache_compute: bool = False  # attention over CPU/disk cache runs on the CPU (§4.2)

    @property
    def bls(self) -> int:
        """Zig-zag block size (FlexGen §4.1): sequences processed together per layer load."""
        return self.gbs * self.num_gpu_batches

    def fractions(self) -> tuple[float, ...]:
        """The 9 fractions in FlexGen order (wg, wc, wd, cg, cc, cd, hg, hc, hd)."""
        return tuple(getattr(self, f) for f in FRACTIONS)

    def validate(self) -> "Policy":
        for f in ("gbs", "num_gpu_batches"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"Policy.{f} must be an int >= 1, got {v!r}")
        for f in FRACTIONS:
            v = getattr(self, f)
            if not (0.0 <= v <= 1.0):
                raise ValueError(f"Policy.{f} must be in [0, 1], got {v!r}")
        for group, names in _GROUPS.items():
            total = sum(getattr(self, n) for n in names)
            if abs(total - 1.0) > SUM_TOL:
                raise ValueError(f"Policy {group} fractions {'+'.join(names)} sum to {total}, not 1")
        return self

    @classmethod
    def from_fractions(cls, x, **kw) -> "Policy":
        """Build from 9 fractions (LP solution order); clips solver noise (|v| < 1e-9, v > 1)."""
        vals = [min(1.0, max(0.0, float(v))) for v in x]
        vals = [0.0 if v < 1e-9 else v for v in vals]
        for i in (0, 3, 6):  # renormalize each group so it sums to exactly 1
            s = sum(vals[i:i + 3])
            vals[i:i + 3] = [v / s for v in vals[i:i + 3]]
        return cls(**dict(zip(FRACTIONS, vals)), **kw).validate()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Policy":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names}).validate()

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "Policy":
        return cls.from_dict(json.loads(text))

    def percent_str(self) -> str:
        """FlexGen's ``--percent`` order: wg wc cg cc hg hc, rounded to whole percents."""
        return " ".join(f"{round(100 * getattr(self, f))}" for f in ("wg", "wc", "cg", "cc", "hg", "hc"))

    @property
    def delegates_attention(self) -> bool:
        """Decode attention runs on the CPU for the cache held off the GPU (FlexGen §4.2);
        ``cpu_cache_compute`` means nothing when the whole cache is on the GPU."""
        return self.cpu_cache_compute and self.cg < 1

    def cache_tiers(self, num_layers: int) -> list[str]:
        """The tier of each layer's KV cache as the runtime places it (``assign_tiers``)."""
        return assign_tiers([1] * num_layers, (self.cg, self.cc, self.cd))

    def describe(self) -> str:
        """One line: batch shape, placement percentages and options."""
        opts = [o for o, on in (("4-bit weights", self.compress_weight), ("4-bit KV", self.compress_cache),
                                ("CPU attention", self.delegates_attention)) if on]
        w = f"weights {self.wg:.0%}/{self.wc:.0%}/{self.wd:.0%}"
        c = f"cache {self.cg:.0%}/{self.cc:.0%}/{self.cd:.0%}"
        h = f"activations {self.hg:.0%}/{self.hc:.0%}/{self.hd:.0%}"
        return (f"gbs {self.gbs} x {self.num_gpu_batches} (zig-zag block {self.bls}); {w}, {c}, {h} "
                f"(GPU/CPU/disk)" + (f"; {', '.join(opts)}" if opts else ""))


def assign_tiers(sizes: list[int], fractions: tuple[float, float, float]) -> list[str]:
    """Tier of each item (layer) so that about ``fractions`` (gpu, cpu, disk) of the total bytes
    land on each tier, in item order: an item goes where the midpoint of its byte range falls
    (FlexGen's ``get_choice`` on cumulative sizes). Items are whole: layer granularity."""
    total = float(sum(sizes)) or 1.0
    g, c, _ = fractions
    out, cum = [], 0.0
    for s in sizes:
        mid = (cum + s / 2) / total
        cum += s
        out.append("gpu" if mid < g else "cpu" if mid < g + c else "disk")
    return out
