"""Find a model reference in the Hugging Face cache without the network.

The cache is huggingface_hub's layout (``models--org--name/{refs,snapshots,blobs}``). A file
appears in a snapshot only once downloaded whole (huggingface_hub moves it in place when done),
so a snapshot that holds every file a reference needs is a complete model.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from localgen.hub.refs import ModelRef, RefError, is_hf_dir_repo, select_files

_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class Resolved:
    """Where a reference's files are: ``format`` "gguf" (``path`` = the file, part 1 of a split
    set) or "hf" (``path`` = the snapshot directory); ``files`` = the repo paths it uses."""

    ref: ModelRef
    format: str
    path: Path
    files: tuple[str, ...]
    commit: str


def hub_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """`cache_dir`, else huggingface_hub's cache (``HF_HUB_CACHE``, ``HF_HOME``/hub) read now."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if env:
        return Path(env).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def repo_folder(repo_id: str, cache_dir: str | os.PathLike | None = None) -> Path:
    return hub_cache_dir(cache_dir) / ("models--" + repo_id.replace("/", "--"))


def cached_commit(repo_id: str, revision: str | None, cache_dir=None) -> str | None:
    """The commit `revision` (default ``main``) points to in the cache, or None."""
    revision = revision or "main"
    if _COMMIT_RE.match(revision):
        return revision
    ref_file = repo_folder(repo_id, cache_dir) / "refs" / revision
    try:
        commit = ref_file.read_text().strip()
    except OSError:
        return None
    return commit if _COMMIT_RE.match(commit) else None


def snapshot_files(snapshot: Path) -> list[str]:
    """Repo paths present in a snapshot folder (links whose blob is gone are left out)."""
    if not snapshot.is_dir():
        return []
    return sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())


def _hf_dir_complete(snapshot: Path) -> bool:
    index = snapshot / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError):
            return False
        return all((snapshot / s).is_file() for s in shards)
    return (snapshot / "model.safetensors").is_file()


def find_cached(ref: ModelRef, revision: str | None = None, cache_dir=None) -> Resolved | None:
    """The cached files `ref` names at `revision`, or None when the cache does not hold them all.

    Without a tag a cached safetensors directory wins; else a cached GGUF: the one the tag
    names; with no tag the cached Q4_K_M, else the first GGUF model the snapshot holds (so a
    tag-less reference uses the quant pulled before instead of downloading another).
    """
    commit = cached_commit(ref.repo_id, revision, cache_dir)
    if commit is None:
        return None
    snapshot = repo_folder(ref.repo_id, cache_dir) / "snapshots" / commit
    files = snapshot_files(snapshot)
    if ref.tag is None and is_hf_dir_repo(files):
        if not _hf_dir_complete(snapshot):
            return None
        return Resolved(ref, "hf", snapshot, tuple(select_files(ref, files)[1]), commit)
    try:
        fmt, chosen = select_files(ref, files)
    except RefError:  # not cached (or a split set missing a part): not found here
        return None
    return Resolved(ref, fmt, snapshot / chosen[0], tuple(chosen), commit)
