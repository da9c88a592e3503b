"""Model references ``REPO[:QUANT|:FILE]`` and which files of a repo they name (no network).

A GGUF repo holds one file (or one split set) per quantization, named after its quant type
(``Model-Q4_K_M.gguf``, ``model.q8_0.gguf``, ``Q4_K_M/Model-Q4_K_M-00001-of-00003.gguf``). The
tag picks one case-insensitively; without a tag the default is Q4_K_M, as llama.cpp's ``-hf``
chooses, else the repo's first GGUF. A repo of Hugging Face safetensors weights gets its config,
tokenizer and weights only.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Iterable

DEFAULT_QUANT = "Q4_K_M"
_REPO_RE = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
_TAG_RE = re.compile(r"^[\w.\-/]+$")
# llama.cpp's split naming (llama-gguf-split, gguf-py's GGUFWriter): PREFIX-00001-of-00003.gguf
SPLIT_RE = re.compile(r"^(?P<prefix>.*)-(?P<part>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
# a quant type as it appears in file names: Q4_K_M, IQ4_XS, Q8_0, UD-Q4_K_XL's Q4_K_XL, F16, BF16...
_QUANT_RE = re.compile(
    r"(?<![A-Za-z0-9])(I?Q\d(?:_[A-Z0-9]+)*|T?Q\d_\d|BF16|F16|F32|FP16|FP32|MXFP4(?:_MOE)?)(?=[-.]|$)",
    re.IGNORECASE,
)
# Not model weights, though they end in .gguf: vision projectors, imatrix data, LoRA adapters.
_NOT_MODEL_RE = re.compile(r"(^|[/\-_.])(mmproj|imatrix|lora)", re.IGNORECASE)

# What a safetensors repo needs: config, generation config, tokenizer files, chat template, weights.
HF_DIR_PATTERNS = [
    "config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "*.tiktoken", "chat_template.*",
    "model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json",
]


class RefError(ValueError):
    """A model reference that cannot name a file of its repo; the message says what the repo has."""


@dataclass(frozen=True)
class ModelRef:
    """``repo_id`` (``org/name``) and the optional ``tag``: a quant type or a ``.gguf`` path."""

    repo_id: str
    tag: str | None = None

    def __str__(self) -> str:
        return self.repo_id + (f":{self.tag}" if self.tag else "")

    @property
    def names_file(self) -> bool:
        return bool(self.tag) and self.tag.lower().endswith(".gguf")


def parse_ref(text: str) -> ModelRef | None:
    """``"org/name"``, ``"org/name:Q4_K_M"`` or ``"org/name:path/in/repo.gguf"`` as a ModelRef;
    None when `text` is not shaped like a hub reference (a path, say)."""
    repo, sep, tag = text.partition(":")
    if not _REPO_RE.match(repo) or repo.endswith(".gguf"):
        return None
    if sep and not (tag and _TAG_RE.match(tag) and ".." not in tag.split("/")):
        return None
    return ModelRef(repo, tag or None)


def quant_of(filename: str) -> str | None:
    """The quant type a GGUF file name states (upper case), e.g. ``"Q4_K_M"``; None if none."""
    base = filename.rsplit("/", 1)[-1]
    m = SPLIT_RE.match(base)
    stem = m.group("prefix") if m else base[: -len(".gguf")] if base.lower().endswith(".gguf") else base
    found = _QUANT_RE.findall(stem)
    return found[-1].upper() if found else None


def gguf_models(files: Iterable[str]) -> list[str]:
    """The repo's model GGUF files, sorted (projectors, imatrix and LoRA files left out)."""
    return sorted(f for f in files if f.lower().endswith(".gguf") and not _NOT_MODEL_RE.search(f))


def split_set(first: str, files: Iterable[str]) -> list[str]:
    """All parts of the split GGUF whose part 1 is `first`, in order (just [first] if unsplit).

    Raises RefError when a part is not among `files` (a repo or cache missing one)."""
    m = SPLIT_RE.match(first)
    if not m:
        return [first]
    count, have = int(m.group("count")), set(files)
    parts = [f"{m.group('prefix')}-{i:05d}-of-{m.group('count')}.gguf" for i in range(1, count + 1)]
    missing = [p for p in parts if p not in have]
    if missing:
        raise RefError(f"split GGUF {first} lacks part(s) {', '.join(missing)}")
    return parts


def _first_parts(ggufs: list[str]) -> list[str]:
    """One entry per model file: unsplit files and the first part of each split set."""
    out = []
    for f in ggufs:
        m = SPLIT_RE.match(f)
        if m is None or int(m.group("part")) == 1:
            out.append(f)
    return out


def available_quants(files: Iterable[str]) -> list[str]:
    """The quant types the repo's GGUF files state, sorted, each once."""
    return sorted({q for f in _first_parts(gguf_models(files)) if (q := quant_of(f))})


def select_gguf(ref: ModelRef, files: Iterable[str]) -> list[str]:
    """The GGUF file(s) `ref` names among `files` (a repo's paths): all parts of a split set.

    Tag ``*.gguf``: that path. A quant tag: the file whose name states it (case-insensitive).
    No tag: Q4_K_M, else the first model GGUF. Raises RefError listing the quants (or files)
    the repo has when none matches, or when several distinct files state the tag.
    """
    files = list(files)
    ggufs = gguf_models(files)
    if not ggufs:
        raise RefError(f"{ref.repo_id} has no GGUF files" + (f", so it has no {ref.tag}" if ref.tag else ""))
    firsts = _first_parts(ggufs)
    if ref.names_file:
        hits = [f for f in files if f.lower() == ref.tag.lower()]
        if not hits:
            raise RefError(f"{ref.repo_id} has no file {ref.tag}; its GGUF files: {', '.join(firsts)}")
        return split_set(hits[0], files)
    want = (ref.tag or DEFAULT_QUANT).upper()
    hits = [f for f in firsts if quant_of(f) == want]
    if not hits and ref.tag is None:
        hits = firsts[:1]
    if not hits:
        have = available_quants(files)
        listed = ", ".join(have) if have else "none named by quant; files: " + ", ".join(firsts)
        raise RefError(f"{ref.repo_id} has no {ref.tag} GGUF; its quants: {listed}")
    if len(hits) > 1:
        raise RefError(f"{ref.repo_id}: {want} matches several files ({', '.join(hits)}); "
                       f"name one as {ref.repo_id}:FILE.gguf")
    return split_set(hits[0], files)


def hf_dir_files(files: Iterable[str]) -> list[str]:
    """The files of a safetensors repo that a model directory needs (top level only), sorted."""
    return sorted(f for f in files
                  if "/" not in f and any(fnmatch.fnmatch(f, p) for p in HF_DIR_PATTERNS))


def is_hf_dir_repo(files: Iterable[str]) -> bool:
    """Whether the repo holds a Hugging Face model directory: config.json and safetensors weights."""
    names = set(files)
    return "config.json" in names and any(
        f == "model.safetensors" or fnmatch.fnmatch(f, "model-*-of-*.safetensors") for f in names)


def select_files(ref: ModelRef, files: Iterable[str]) -> tuple[str, list[str]]:
    """``(format, paths)`` to download for `ref`: ``("gguf", parts)`` or ``("hf", files)``.

    A tag always means GGUF; no tag takes the safetensors directory when the repo has one, else
    the default GGUF. Raises RefError as `select_gguf`, or when the repo has neither format.
    """
    files = list(files)
    if ref.tag is None and is_hf_dir_repo(files):
        return "hf", hf_dir_files(files)
    if ref.tag is None and not gguf_models(files):
        raise RefError(f"{ref.repo_id} holds neither GGUF files nor a Hugging Face model directory "
                       "(config.json and model*.safetensors), the formats localgen reads")
    return "gguf", select_gguf(ref, files)
