"""The tokenizer of a GGUF file, converted once and kept in localgen's cache folder.

transformers reads a GGUF tokenizer by parsing the whole file's metadata and converting the
vocabulary and merges to a `tokenizers` model: many seconds on a small CPU. The result is saved
with ``save_pretrained`` (``tokenizer.json``, ``tokenizer_config.json``, the chat template) under
``tokenizers/<key>/`` of the cache folder, the key hashing the GGUF's resolved path, size and
modification time and the transformers version, so an edited or replaced file, or a new
transformers, converts again. Later loads read that folder with `PreTrainedTokenizerFast`.

The cache folder is ``$LOCALGEN_CACHE_DIR``, else the user cache folder's ``localgen``
(``~/.cache/localgen`` on Linux). A folder that cannot be written only costs the conversion.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"


def cache_root() -> Path:
    """``$LOCALGEN_CACHE_DIR``, else platformdirs' user cache folder for localgen."""
    env = os.environ.get("LOCALGEN_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("localgen", appauthor=False))


def cache_key(gguf_path: str | os.PathLike) -> str:
    """Hex key of a GGUF file's identity: resolved path, size, mtime (ns), transformers version.
    Raises OSError when the file cannot be stat'ed."""
    from importlib.metadata import PackageNotFoundError, version

    path = Path(gguf_path).resolve()
    st = path.stat()
    try:
        tf = version("transformers")
    except PackageNotFoundError:
        tf = "?"
    ident = f"{path}\0{st.st_size}\0{st.st_mtime_ns}\0{tf}"
    return hashlib.sha256(ident.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def cache_entry(gguf_path: str | os.PathLike, root: str | os.PathLike | None = None) -> Path:
    """The folder holding ``gguf_path``'s converted tokenizer under ``root`` (default
    ``cache_root()``), whether or not it exists yet. Raises OSError as `cache_key` does."""
    return Path(root if root is not None else cache_root()) / "tokenizers" / cache_key(gguf_path)


def cached_gguf_tokenizer(gguf_path: str | os.PathLike, convert: Callable[[], Any],
                          root: str | os.PathLike | None = None) -> Any:
    """The tokenizer of ``gguf_path``: read from the cache when this file's entry exists, else
    ``convert()``-ed (the slow transformers GGUF path) and saved there for the next load.

    ``root`` defaults to ``cache_root()``. A damaged cache entry is removed and converted again;
    an unwritable cache logs a warning and returns the converted tokenizer."""
    entry = cache_entry(gguf_path, root)
    if (entry / TOKENIZER_FILE).is_file():
        try:
            return load_saved(entry)
        except Exception as e:  # a cut or stale entry: convert again rather than fail
            log.warning("tokenizer cache entry %s unreadable (%s); converting again", entry, e)
            shutil.rmtree(entry, ignore_errors=True)
    tok = convert()
    try:
        _save(tok, entry)
    except OSError as e:
        log.warning("cannot save the tokenizer to the cache %s (%s); set LOCALGEN_CACHE_DIR to a "
                    "writable folder to skip the conversion next time", entry.parent, e)
    return tok


def load_saved(folder: str | os.PathLike) -> Any:
    """A tokenizer written by ``save_pretrained`` into ``folder``, read without AutoConfig (no
    model config lookup, no torch import)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(os.fspath(folder))


def _save(tok: Any, entry: Path) -> None:
    """Write into a temporary sibling, then rename: readers never see half an entry."""
    entry.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=entry.parent))
    try:
        tok.save_pretrained(os.fspath(tmp))
        try:
            os.rename(tmp, entry)
        except OSError:
            if not (entry / TOKENIZER_FILE).is_file():  # not another process winning the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
