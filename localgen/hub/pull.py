"""Download a model reference from the Hugging Face hub into the standard cache.

The repo's file list comes from ``HfApi.model_info(files_metadata=True)`` (sizes and LFS
SHA-256s); `refs.select_files` picks what the reference names. Weight files (LFS) arrive through
`download.fetch_blob`: huggingface_hub's ``http_get`` with its progress bar (bytes, speed) into
a partial blob that a later run continues, checked against the SHA-256 before it enters the
cache. ``snapshot_download`` then fetches the small files, links everything into the snapshot
and writes the ``main`` ref, as for any huggingface_hub download. A connection that drops
mid-file resumes with a ``Range`` request within the run; a run that is killed resumes in the
next one. The small files are checked against their git blob ids; a damaged file is removed
from the cache, so it is never loaded.

Every failure is one `PullError` sentence: the repo does not exist, is gated or private (with
what to do about the token), lacks the quant (listing the ones it has), the hub cannot be
reached, or ``HF_HUB_OFFLINE`` forbids the download.
"""

from __future__ import annotations

import glob
import os
import sys
from pathlib import Path
from typing import Callable

from localgen.hub.cache import Resolved, hub_cache_dir, repo_folder
from localgen.hub.download import DamagedFileError, DiskFullError, fetch_blob, file_digest
from localgen.hub.refs import ModelRef, RefError, select_files

_TOKEN_HINT = "set HF_TOKEN to a token that may read it, or run `hf auth login` (huggingface-cli login)"


class PullError(FileNotFoundError):
    """The model could not be downloaded; the message is one sentence saying why and what to do."""


def hub_endpoint() -> str:
    """``HF_ENDPOINT`` read now (huggingface_hub reads it once, at import), else its default."""
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` read now, else huggingface_hub's own setting."""
    env = os.environ.get("HF_HUB_OFFLINE")
    if env is not None:
        return env.strip().upper() in {"1", "ON", "YES", "TRUE"}
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def pull(
    ref: ModelRef,
    *,
    revision: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    log: Callable[[str], None] = _stderr,
) -> Resolved:
    """Download the files `ref` names at `revision` (default ``main``) into the hub cache.

    Returns where they are (`Resolved`). Files already in the cache are not fetched again; with
    ``HF_HUB_OFFLINE`` set, a model in the cache is returned as it is. Raises
    PullError (a FileNotFoundError): offline, hub unreachable, repo missing, gated or private
    (401/403), revision or quant missing, a download cut short or damaged.
    """
    endpoint = hub_endpoint()
    if hub_offline():
        from localgen.hub.cache import find_cached

        found = find_cached(ref, revision, cache_dir)
        if found is not None:  # nothing to fetch: offline is no obstacle
            log(f"{ref} is in the cache (HF_HUB_OFFLINE is set, so the hub was not asked for updates)")
            return found
        raise PullError(f"cannot download {ref}: HF_HUB_OFFLINE is set; unset it to download, "
                        "or use a model already in the cache (`localgen models`)")
    try:
        commit, meta = _list_repo(ref, revision, endpoint)
        fmt, files = select_files(ref, meta)
    except RefError as e:
        raise PullError(str(e)) from None
    except Exception as e:
        raise _explain(e, ref, revision, endpoint) from e
    total = sum(meta[f].size or 0 for f in files)
    log(f"pulling {ref}: {', '.join(files)} ({_human(total)}) from {endpoint}")
    blobs = repo_folder(ref.repo_id, cache_dir) / "blobs"
    for f in files:
        if meta[f].lfs is not None:
            _fetch(ref, f, meta[f], commit, blobs, endpoint, log)
    snapshot = _download(ref, revision, files, endpoint, cache_dir)
    if snapshot.name != commit:
        raise PullError(f"{ref.repo_id} changed on the hub during the download (commit {commit[:12]} "
                        f"became {snapshot.name[:12]}); run the pull again")
    for f in files:
        if meta[f].lfs is None:  # weights were hashed as they entered the cache
            _verify(snapshot, f, meta[f], ref)
    return Resolved(ref, fmt, snapshot if fmt == "hf" else snapshot / files[0], tuple(files), commit)


def _list_repo(ref: ModelRef, revision: str | None, endpoint: str):
    """``(commit, {path: RepoSibling})`` of the repo at `revision`."""
    from huggingface_hub import HfApi

    info = HfApi(endpoint=endpoint).model_info(ref.repo_id, revision=revision, files_metadata=True)
    if not info.sha:
        raise PullError(f"{endpoint} answered for {ref.repo_id} without a commit hash: is "
                        "HF_ENDPOINT a Hugging Face hub?")
    return info.sha, {s.rfilename: s for s in info.siblings or ()}


def _fetch(ref: ModelRef, path: str, sibling, commit: str, blobs: Path, endpoint: str, log) -> None:
    try:
        fetch_blob(ref.repo_id, path, commit=commit, sha256=sibling.lfs.sha256,
                   size=sibling.lfs.size, blobs=blobs, endpoint=endpoint, log=log)
    except KeyboardInterrupt:
        raise
    except DamagedFileError as e:
        raise PullError(f"{ref.repo_id}: {e}; run the pull again") from e
    except DiskFullError as e:
        raise PullError(f"cannot download {ref}: {e}") from e
    except Exception as e:
        raise _explain(e, ref, None, endpoint) from e


def _download(ref, revision, files, endpoint, cache_dir) -> Path:
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(
            ref.repo_id, revision=revision, allow_patterns=[glob.escape(f) for f in files], endpoint=endpoint,
            cache_dir=os.fspath(hub_cache_dir(cache_dir)), tqdm_class=_quiet_tqdm(),
        )
    except KeyboardInterrupt:
        raise
    except Exception as e:
        raise _explain(e, ref, revision, endpoint) from e
    return Path(folder)


def _quiet_tqdm():
    """A progress bar class that stays hidden: the weights showed their own bars (bytes, speed),
    and what snapshot_download still moves is a few small files and links."""
    from huggingface_hub.utils import tqdm

    class Quiet(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return Quiet


def _explain(e: Exception, ref: ModelRef, revision: str | None, endpoint: str) -> PullError:
    """One sentence for what huggingface_hub (or the network) raised."""
    from huggingface_hub.errors import (
        GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled,
        RemoteEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError,
    )

    where = f"{ref.repo_id}" + (f"@{revision}" if revision else "")
    status = getattr(getattr(e, "response", None), "status_code", None)
    if isinstance(e, PullError):
        return e
    if isinstance(e, GatedRepoError):
        return PullError(f"{where} is gated: accept its terms at {endpoint}/{ref.repo_id}, then "
                         + _TOKEN_HINT)
    if isinstance(e, RepositoryNotFoundError):
        private = " (or it is private: " + _TOKEN_HINT + ")" if status == 401 else ""
        return PullError(f"{where} was not found on {endpoint}{private}")
    if isinstance(e, RevisionNotFoundError):
        return PullError(f"{ref.repo_id} has no revision {revision!r}")
    if isinstance(e, RemoteEntryNotFoundError):
        return PullError(f"a file of {where} vanished from the hub during the pull; run it again")
    if isinstance(e, HfHubHTTPError) and status in (401, 403):
        return PullError(f"{where}: the hub refused access ({status}); " + _TOKEN_HINT)
    if isinstance(e, (OfflineModeIsEnabled,)):
        return PullError(f"cannot download {ref}: huggingface_hub is in offline mode (HF_HUB_OFFLINE)")
    if isinstance(e, _transport_errors() + (LocalEntryNotFoundError,)):
        return PullError(f"cannot reach the Hugging Face hub at {endpoint} to get {ref} "
                         f"({_first_line(e)}); check the network, or set HF_HUB_OFFLINE=1 "
                         "to use only models already in the cache")
    if isinstance(e, HfHubHTTPError) and status is not None and status >= 500:
        return PullError(f"the hub failed ({status}) while sending {ref}; run the pull again to "
                         "resume it")
    if isinstance(e, HfHubHTTPError):
        return PullError(f"the hub answered {status} for {where}: {_first_line(e)}")
    if isinstance(e, OSError):  # a download cut short: huggingface_hub's size check, a full disk
        return PullError(f"downloading {ref} failed: {_first_line(e)}; run the pull again "
                         "to resume it")
    return PullError(f"downloading {ref} failed: {type(e).__name__}: {_first_line(e)}")


def _transport_errors() -> tuple[type[BaseException], ...]:
    """What the HTTP client of this huggingface_hub raises when no answer comes back."""
    try:
        import httpx2  # huggingface_hub 2.x

        return (httpx2.TransportError,)
    except ImportError:
        try:
            import httpx

            return (httpx.TransportError,)
        except ImportError:
            return (ConnectionError,)


def _first_line(e: BaseException) -> str:
    text = " ".join(str(e).split("\n\n")[0].split())
    return text or type(e).__name__


def _verify(snapshot: Path, path: str, sibling, ref: ModelRef) -> None:
    """Hash a small downloaded file against its git blob id; remove it when they differ."""
    local = snapshot / path
    if not sibling.blob_id:
        return  # the hub gave no digest: nothing to check against
    got = file_digest(local, "git-sha1")
    if got == sibling.blob_id:
        return
    blob = local.resolve()
    for p in {local, blob}:  # the snapshot link and its blob, so no later run reuses the bytes
        p.unlink(missing_ok=True)
    raise PullError(f"{ref.repo_id}/{path} arrived damaged (git blob id {got[:16]}… where the hub "
                    f"records {sibling.blob_id[:16]}…); it was removed from the cache, run the pull again")


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def ensure(
    ref: ModelRef,
    *,
    revision: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    offline: bool | None = None,
    log: Callable[[str], None] = _stderr,
) -> Resolved:
    """The cached files of `ref`, pulled first (saying so through `log`) when missing.

    `offline` (default: ``HF_HUB_OFFLINE`` read now) makes a missing model raise PullError at
    once, with no network attempt.
    """
    from localgen.hub.cache import find_cached

    found = find_cached(ref, revision, cache_dir)
    if found is not None:
        return found
    if hub_offline() if offline is None else offline:
        at = f" --revision {revision}" if revision else ""
        raise PullError(f"model {ref}{'@' + revision if revision else ''} is not in the local hub "
                        f"cache ({repo_folder(ref.repo_id, cache_dir)}) and HF_HUB_OFFLINE is set; "
                        f"unset it to let localgen download it, or run `localgen pull {ref}{at}` "
                        f"(`hf download {ref.repo_id}{at}`) where the network is")
    log(f"{ref} is not in the Hugging Face cache; downloading it")
    return pull(ref, revision=revision, cache_dir=cache_dir, log=log)
