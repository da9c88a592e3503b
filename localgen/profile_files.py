"""The JSON files shipped in ``localgen.profiles`` and the int4 GEMM dispatch tables among them.

``profiles/`` holds hardware profiles (read by ``localgen.profiler.hardware``), int4 GEMM
dispatch tables ``gemm_<gpu>_<dtype>.json`` (FlashDecoding++ §5's inflection points M1/M2 per
``[N, K]``, written by ``python -m localgen.kernels.dispatch``) and softmax calibrations. Read
without torch: the 4-bit linear layers (``localgen.quant.int4``) and the policy's cost model
(``localgen.policy.gemm_times``) both read the GEMM tables, from two layers apart.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

GEMM_TABLE_ENV = "LOCALGEN_GEMM_TABLE"  # a table file to use instead of the shipped profiles


def profiles_dir():
    """``localgen.profiles`` when installed; the repo's ``profiles/`` folder in a source checkout
    (a ``Traversable``: ``iterdir``, ``/``, ``is_file``, ``read_text``)."""
    from importlib import resources

    try:
        return resources.files("localgen.profiles")
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[1] / "profiles"


def gemm_profile_dicts(device_name: str, dtype: str) -> list[dict]:
    """The int4 GEMM dispatch profiles (JSON dicts, ``kernels.dispatch.GemmDispatchTable``'s
    form) for one GPU and compute dtype: the file ``$LOCALGEN_GEMM_TABLE`` if set, else every
    shipped ``gemm_*.json`` whose ``device_name`` and ``dtype`` match, in name order. Raises
    OSError or json.JSONDecodeError for a ``$LOCALGEN_GEMM_TABLE`` that cannot be read."""
    env = os.environ.get(GEMM_TABLE_ENV)
    if env:
        with open(env) as f:
            return [json.load(f)]
    out = []
    for p in sorted(profiles_dir().iterdir(), key=lambda p: p.name):
        if p.name.startswith("gemm_") and p.name.endswith(".json"):
            d = json.loads(p.read_text())
            if d.get("device_name") == device_name and d.get("dtype", "bfloat16") == dtype:
                out.append(d)
    return out
