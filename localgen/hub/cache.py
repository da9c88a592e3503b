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
from typing import Any

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


# ---- listing and removing what the cache holds ------------------------------------------------


class NotCachedError(FileNotFoundError):
    """`remove` was asked for a repo or quant the cache does not hold; the message names it."""


@dataclass(frozen=True)
class CachedModel:
    """One model of the cache at one revision: a GGUF file (a split set once) or a safetensors
    directory. ``name`` is how ``--model`` names it; ``path`` the GGUF (part 1) or snapshot
    directory; ``files`` the repo paths it takes; ``size_bytes`` their bytes on disk; ``quant``
    the GGUF quant its file name states, or the safetensors checkpoint's dtype."""

    repo_id: str
    name: str
    format: str  # "gguf" | "safetensors"
    quant: str | None
    path: Path
    files: tuple[str, ...]
    size_bytes: int
    commit: str

    @property
    def file(self) -> str:
        """The file to show for it: the GGUF's repo path, or the snapshot's weights."""
        return self.files[0] if self.format == "gguf" else ", ".join(
            f for f in self.files if f.endswith(".safetensors"))


def cached_models(cache_dir: str | os.PathLike | None = None) -> list[CachedModel]:
    """Every model in the hub cache (``scan_cache_dir``; no network), by repo then name: each
    GGUF model of each repo's revision that ``main`` points to (else its newest), or its
    safetensors directory. An empty or missing cache lists nothing."""
    from huggingface_hub import CacheNotFound, scan_cache_dir

    try:
        info = scan_cache_dir(hub_cache_dir(cache_dir))
    except CacheNotFound:
        return []
    out: list[CachedModel] = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        rev = next((r for r in repo.revisions if "main" in r.refs),
                   max(repo.revisions, key=lambda r: r.last_modified))
        out += _revision_models(repo.repo_id, rev)
    return out


def _revision_models(repo_id: str, rev) -> list[CachedModel]:
    from localgen.hub.refs import SPLIT_RE, gguf_models, hf_dir_files, quant_of, split_set

    snap = Path(rev.snapshot_path)
    sizes = {f.file_path.relative_to(snap).as_posix(): f.size_on_disk for f in rev.files}
    models = []
    if is_hf_dir_repo(sizes) and _hf_dir_complete(snap):
        files = tuple(hf_dir_files(sizes))
        models.append(CachedModel(repo_id, repo_id, "safetensors", checkpoint_dtype(snap), snap,
                                  files, sum(sizes[f] for f in files), rev.commit_hash))
    for first in gguf_models(sizes):
        m = SPLIT_RE.match(first)
        if m and int(m.group("part")) != 1:
            continue
        try:
            parts = tuple(split_set(first, sizes))
        except RefError:  # a split set missing a part cannot load
            continue
        quant = quant_of(first)
        models.append(CachedModel(repo_id, f"{repo_id}:{_tag_for(repo_id, first, quant, sizes)}",
                                  "gguf", quant, snap / first, parts,
                                  sum(sizes[p] for p in parts), rev.commit_hash))
    return models


def _tag_for(repo_id: str, file: str, quant: str | None, files) -> str:
    """The tag that names `file` in ``repo:TAG``: its quant when that picks it alone, else
    its path."""
    from localgen.hub.refs import select_gguf

    try:
        return quant if quant and select_gguf(ModelRef(repo_id, quant), files)[0] == file else file
    except RefError:
        return file


def checkpoint_dtype(model_dir: Path) -> str | None:
    """A safetensors model directory's weight type as config.json states it: the quantization
    method when it has one, else its dtype upper-cased (``BF16``, ``F32``)."""
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    method = (cfg.get("quantization_config") or {}).get("quant_method")
    dtype = cfg.get("torch_dtype") or cfg.get("dtype")
    names = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
    return str(method).upper() if method else (names.get(str(dtype), dtype) if dtype else None)


@dataclass(frozen=True)
class Removal:
    """What `plan_removal` would delete: ``what`` (``repo`` or ``repo:TAG``), the cached
    models it takes, and huggingface_hub's ``DeleteCacheStrategy`` (``execute()`` deletes,
    ``expected_freed_size`` in bytes: blobs another file still uses are kept)."""

    what: str
    models: tuple[CachedModel, ...]
    strategy: Any


def plan_removal(ref: ModelRef, cache_dir: str | os.PathLike | None = None) -> Removal:
    """How to delete `ref` from the hub cache, through huggingface_hub's cache API (nothing is
    deleted until ``strategy.execute()``). ``repo`` takes every revision of the repo;
    ``repo:QUANT`` (or ``repo:FILE.gguf``) takes that GGUF's files from each revision, or the
    whole repo when no other model file would remain in it.

    Raises NotCachedError (a FileNotFoundError) naming the repo or tag the cache lacks and the
    quants it has.
    """
    from huggingface_hub import CacheNotFound, scan_cache_dir

    try:
        info = scan_cache_dir(hub_cache_dir(cache_dir))
    except CacheNotFound:
        info = None
    repo = next((r for r in info.repos if r.repo_id == ref.repo_id and r.repo_type == "model"),
                None) if info else None
    if repo is None:
        raise NotCachedError(f"{ref.repo_id} is not in the Hugging Face cache "
                             f"({hub_cache_dir(cache_dir)})")
    every = [m for rev in repo.revisions for m in _revision_models(repo.repo_id, rev)]
    if ref.tag is None:
        return Removal(str(ref), tuple(every),
                       info.delete_revisions(*(r.commit_hash for r in repo.revisions)))
    chosen = [m for m in every if m.format == "gguf" and _names(ref, m)]
    if not chosen:
        have = sorted({m.name.partition(":")[2] or m.format for m in every})
        raise NotCachedError(f"{ref} is not in the Hugging Face cache; cached from "
                             f"{ref.repo_id}: {', '.join(have) or 'no model files'}")
    if len(chosen) == len(every):  # nothing else would remain: the repo goes whole
        return Removal(str(ref), tuple(chosen),
                       info.delete_revisions(*(r.commit_hash for r in repo.revisions)))
    wanted = {(m.commit, f) for m in chosen for f in m.files}
    files = [f for rev in repo.revisions for f in rev.files
             if (rev.commit_hash, f.file_path.relative_to(rev.snapshot_path).as_posix()) in wanted]
    return Removal(str(ref), tuple(chosen), info.delete_files(*files))


def _names(ref: ModelRef, model: CachedModel) -> bool:
    """Whether the tag of `ref` names `model` (a quant case-insensitively, or its path)."""
    if ref.names_file:
        return model.files[0].lower() == ref.tag.lower()
    return (model.quant or "").upper() == ref.tag.upper()
