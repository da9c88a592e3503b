"""Where the evaluation data (WikiText-2, LAMBADA, MT-Bench, AlpacaEval prompts) is found.

``$LOCALGEN_DATA_DIR`` if set, else the ``shared/data`` folder beside the repository checkout
(``../shared/data`` from the repo root, as the project lays it out)."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def data_dir() -> Path:
    env = os.environ.get("LOCALGEN_DATA_DIR")
    return Path(env) if env else REPO_ROOT.parent / "shared" / "data"
