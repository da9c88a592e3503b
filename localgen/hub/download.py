"""Weight files fetched into the hub cache's blobs so that a killed download resumes.

huggingface_hub downloads each file to a temporary name unique to the process and deletes it
when the download fails, so a pull stopped by Ctrl-C (or a lost network) would start a
multi-GB file over. Here an LFS file is fetched with huggingface_hub's own ``http_get`` into
``blobs/<etag>.partial``, kept across runs, continued with a ``Range`` request, checked against
the hub's SHA-256 and only then renamed to ``blobs/<etag>``: the name huggingface_hub gives the
blob, so its ``snapshot_download`` then finds the file in the cache and only links it into the
snapshot (and writes the ref and tree listing) itself.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

PARTIAL_SUFFIX = ".partial"


class DamagedFileError(OSError):
    """The bytes that arrived do not hash to what the hub records; they were deleted."""


class DiskFullError(OSError):
    """The cache's disk cannot hold the rest of the file; nothing was downloaded."""


def file_digest(path: Path, algo: str) -> str:
    """``sha256`` of the file, or ``git-sha1``: git's blob id (sha1 of ``blob <size>\\0`` + bytes)."""
    h = hashlib.sha256() if algo == "sha256" else hashlib.sha1()
    if algo == "git-sha1":
        h.update(f"blob {path.stat().st_size}\0".encode())
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def fetch_blob(
    repo_id: str,
    filename: str,
    *,
    commit: str,
    sha256: str,
    size: int,
    blobs: Path,
    endpoint: str,
    log: Callable[[str], None],
) -> Path:
    """Download `filename` of `repo_id` at `commit` into ``blobs/<etag>`` unless it is there.

    A ``.partial`` file left by an earlier run is continued from its length. Returns the blob's
    path. Raises huggingface_hub's HTTP errors, DiskFullError before a download the disk cannot
    hold, OSError when the transfer stops short (the partial file stays for the next run),
    DamagedFileError when the complete file's SHA-256 is
    not `sha256` (the partial file is deleted).
    """
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import WeakFileLock, build_hf_headers

    url = hf_hub_url(repo_id, filename, revision=commit, endpoint=endpoint)
    meta = get_hf_file_metadata(url, endpoint=endpoint)
    blobs.mkdir(parents=True, exist_ok=True)
    blob = blobs / meta.etag
    partial = blobs / (meta.etag + PARTIAL_SUFFIX)
    with WeakFileLock(str(partial) + ".lock"):  # two pulls of one file take turns
        if blob.is_file():
            return blob
        have = partial.stat().st_size if partial.is_file() else 0
        if have > size:  # not a prefix of this file: start over
            partial.unlink()
            have = 0
        free = shutil.disk_usage(blobs).free
        if free < size - have:
            raise DiskFullError(f"{filename} needs {size - have} more bytes in {blobs}, where "
                                f"{free} are free; free some space (or point HF_HUB_CACHE elsewhere)")
        if have:
            log(f"resuming {filename} at {have} of {size} bytes")
        headers = build_hf_headers()
        target = meta.location or url
        if urlsplit(target).netloc != urlsplit(url).netloc:
            headers.pop("authorization", None)  # a CDN's signed URL must not get the hub token
        with open(partial, "ab") as f:
            http_get(target, f, resume_size=have, headers=headers, expected_size=size,
                     displayed_filename=filename.rsplit("/", 1)[-1])
        got = file_digest(partial, "sha256")
        if got != sha256:
            partial.unlink()
            raise DamagedFileError(f"{filename} arrived damaged (sha256 {got[:16]}… where the hub "
                                   f"records {sha256[:16]}…) and was deleted")
        os.replace(partial, blob)
    return blob
