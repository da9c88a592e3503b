"""Saved default policies, one JSON file per model in the user config dir (written by `localgen tune`,
read by `chat` and `batch` through ``load_saved_policy``)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from localgen.fileio import atomic_write_json
from localgen.policy.policy import Policy
from localgen.profiler.hardware import user_config_dir


def policy_path(model_name: str) -> Path:
    """``<config dir>/policies/<model name, unsafe characters as '_'>.json``."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", model_name.strip()).strip("_") or "model"
    return user_config_dir() / "policies" / f"{safe}.json"


def save_policy(model_name: str, policy: Policy, meta: dict[str, Any] | None = None) -> Path:
    """Write ``{"model", "policy", "meta"}`` (meta: workload, profile, predicted throughput...)
    to ``policy_path(model_name)`` atomically; returns the path. Raises OSError naming the path
    (an older saved policy is then intact)."""
    p = policy_path(model_name)
    p.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_json(p, {"model": model_name, "policy": policy.validate().to_dict(),
                                 "meta": meta or {}})


def load_saved_policy(model_name: str) -> Policy | None:
    """The policy `localgen tune` saved for ``model_name``, or None if there is none.

    Raises ValueError if the saved file is not a valid policy (corrupt or hand-edited badly).
    """
    p = policy_path(model_name)
    if not p.is_file():
        return None
    return Policy.from_dict(json.loads(p.read_text())["policy"])


def load_saved_meta(model_name: str) -> dict[str, Any] | None:
    p = policy_path(model_name)
    return json.loads(p.read_text()).get("meta") if p.is_file() else None
