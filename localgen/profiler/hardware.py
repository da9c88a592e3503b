"""HardwareProfile: the measured (or published) speeds and capacities the policy cost model reads.

Units: bandwidths in bytes/s, compute in FLOP/s, capacities in bytes.
Field names follow FlexGen (Sheng et al. 2023, §4.3 and App. A.3): ``ctog_bdw`` is CPU->GPU,
``gtoc_bdw`` GPU->CPU, ``dtoc_bdw`` disk->CPU, ``ctod_bdw`` CPU->disk.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localgen.fileio import atomic_write_text
from localgen.profile_files import profiles_dir

GiB = 1 << 30
PROFILE_FILE = "hardware.json"


class ProfileNotFoundError(FileNotFoundError):
    """No shipped, saved or on-disk profile has the requested name."""


@dataclass
class HardwareProfile:
    """Speeds and capacities of one machine.

    A CPU-only machine has ``gpu_name is None``, ``gpu_mem == 0`` and the GPU link terms None; then
    ``mm_flops*``/``bmm_flops*`` describe the CPU, which is the compute device.
    ``source`` maps a field name to where its number comes from (measurement, paper, datasheet).
    Raises ValueError from ``validate`` naming the first field out of range.
    """

    name: str
    date: str  # ISO date of the measurement or publication
    cpu_name: str
    cpu_mem: int  # bytes usable for weights/cache/activations
    disk_mem: int  # bytes free in the offload dir (FlexGen "nmem")
    dtoc_bdw: float  # disk->CPU read, page cache bypassed
    ctod_bdw: float  # CPU->disk write, page cache bypassed
    mm_flops: float  # matmul on the compute device at prefill shapes (large M)
    mm_flops_gen: float  # matmul at decode shapes (M = batch)
    bmm_flops: float  # batched matmul (attention) at prefill shapes
    bmm_flops_gen: float  # batched matmul at decode shapes; memory bound, ~ bytes/s for fp16 MHA
    cpu_flops: float  # CPU attention at decode shapes (FlexGen's delegation path)
    gpu_name: str | None = None
    gpu_mem: int = 0
    ctog_bdw: float | None = None  # pinned host buffer
    gtoc_bdw: float | None = None  # pinned host buffer
    ctog_bdw_pageable: float | None = None
    gtoc_bdw_pageable: float | None = None
    gtoc_bdw_cache: float | None = None  # FlexGen's strided KV store; None: use gtoc_bdw
    gpu_mem_bdw: float | None = None  # device-memory copy bandwidth (roofline of decode matmuls)
    cpu_mem_bdw: float | None = None  # DRAM copy bandwidth (roofline on a CPU-only machine)
    # seconds one small (sub-MB) kernel of a CUDA-graph replay takes, whatever little it does:
    # what a graphed decode step's norms, rotary, K/V writes and residual adds cost. None: 0
    gpu_kernel_floor: float | None = None
    # bytes/s of 4-bit KV cache (codes + scale/min) the paged int4 decode kernel reads, which
    # unpacks in registers and runs below the copy bandwidth. None: gpu_mem_bdw
    gpu_int4_attn_bdw: float | None = None
    # host seconds of one eager decoder-layer call (per GPU batch) of localgen's offloaded
    # runtime: Python, launches, stream/event bookkeeping; CUDA-graph replays skip it. None: 0
    gpu_layer_host_s: float | None = None
    cpu_cores: int | None = None
    # FlexGen's fitted small-batch correction of CPU attention FLOP/s, (c1, c2, c3): the rate is
    # cpu_flops * max(0.1, 1 + c1*a*b - c2*a - c3*b), a = max(0, log2(64/gbs)), b = max(0, log2(4096/h1))
    # (FlexGen experimental/cost_model.py, solve_lp "non-linear cpu_flops"). None: no correction.
    cpu_flops_fit: list[float] | None = None
    offload_dir: str | None = None
    source: dict[str, str] = field(default_factory=dict)

    @property
    def has_gpu(self) -> bool:
        return self.gpu_name is not None and self.gpu_mem > 0

    @property
    def compute_device(self) -> str:
        return "cuda" if self.has_gpu else "cpu"

    def validate(self) -> "HardwareProfile":
        for f in ("cpu_mem", "disk_mem", "dtoc_bdw", "ctod_bdw", "mm_flops", "mm_flops_gen",
                  "bmm_flops", "bmm_flops_gen", "cpu_flops"):
            if not getattr(self, f) > 0:
                raise ValueError(f"HardwareProfile.{f} must be > 0, got {getattr(self, f)!r}")
        if self.has_gpu:
            for f in ("ctog_bdw", "gtoc_bdw"):
                v = getattr(self, f)
                if v is None or not v > 0:
                    raise ValueError(f"HardwareProfile.{f} must be > 0 on a GPU machine, got {v!r}")
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "HardwareProfile":
        """Build from ``to_dict`` output; unknown keys are ignored (forward compatibility)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names}).validate()

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "HardwareProfile":
        return cls.from_dict(json.loads(text))

    def save(self, path: str | os.PathLike | None = None) -> Path:
        """Write JSON to ``path`` (default: ``user_config_dir()/hardware.json``) atomically,
        creating its folder; returns the path. Raises OSError naming the path (the old file, if
        any, is then intact)."""
        p = Path(path) if path is not None else user_config_dir() / PROFILE_FILE
        p.parent.mkdir(parents=True, exist_ok=True)
        return atomic_write_text(p, self.to_json())


def user_config_dir() -> Path:
    """localgen's per-user config folder (platformdirs convention; ``$LOCALGEN_CONFIG_DIR`` wins)."""
    env = os.environ.get("LOCALGEN_CONFIG_DIR")
    if env:
        return Path(env)
    try:
        import platformdirs

        return Path(platformdirs.user_config_dir("localgen", appauthor=False))
    except ImportError:  # the same layout platformdirs uses
        if sys.platform == "win32":
            return Path(os.environ.get("APPDATA", Path.home())) / "localgen"
        if sys.platform == "darwin":
            return Path.home() / "Library" / "Application Support" / "localgen"
        return Path(os.environ.get("XDG_CONFIG_HOME", Path.home() / ".config")) / "localgen"


def default_offload_dir() -> Path:
    """Where the disk probe writes and offloaded tensors go when no ``--offload-dir`` is given:
    ``offload/`` in `user_config_dir`."""
    return user_config_dir() / "offload"


def shipped_profile_names() -> list[str]:
    """Names of the reference profiles shipped in ``localgen.profiles`` (``profiles/`` in the repo)."""
    other = ("gemm_", "softmax_")  # GEMM dispatch tables and softmax calibrations live beside them
    return sorted(p.name[:-5] for p in profiles_dir().iterdir()
                  if p.name.endswith(".json") and not p.name.startswith(other))


def load_profile(name: str | os.PathLike | None = None) -> HardwareProfile:
    """Load a profile by shipped name ("flexgen_t4"), by file path, or (None / "local") the one
    ``localgen profile`` saved. Raises ProfileNotFoundError listing the shipped names."""
    if name is None or str(name) == "local":
        p = user_config_dir() / PROFILE_FILE
        if not p.is_file():
            raise ProfileNotFoundError(f"no saved profile at {p}; run `localgen profile` first")
        return HardwareProfile.from_json(p.read_text())
    p = Path(name)
    if p.suffix == ".json" and p.is_file():
        return HardwareProfile.from_json(p.read_text())
    shipped = profiles_dir() / f"{name}.json"
    if shipped.is_file():
        return HardwareProfile.from_json(shipped.read_text())
    raise ProfileNotFoundError(
        f"no profile {str(name)!r}; shipped: {', '.join(shipped_profile_names())}, or a .json path"
    )
