"""Build and load the C kernels under ``csrc/`` for the CPU this process runs on.

Each source is compiled once per machine with the system C compiler (``$CC``, else ``cc``) at
``-O3 -march=native -fopenmp`` (and reassociation) into a per-user cache folder
(``$LOCALGEN_KERNEL_CACHE``, else the user cache folder's ``localgen/kernels``, created with mode
0700), named by a hash of the source, its headers, the compiler's version, the flags and the CPU,
and loaded with ``ctypes``. Compiling plain C takes about a second and needs no torch headers. A
shared object linking ``libgomp.so.1`` resolves to the copy torch already loaded (same soname), so
the kernels run on torch's OpenMP threads.

Loading a shared object runs its code, so a cached one is trusted only after these checks:

- the cache folder is owned by this user and not writable by group or others; otherwise a
  warning names it and the kernels are built into a private temp folder (mode 0700, removed at
  exit) for this process: the user keeps the fast path and pays the compile each run until the
  folder is fixed (``chmod go-w``, or point ``$LOCALGEN_KERNEL_CACHE`` elsewhere);
- the library is a regular file owned by this user and not writable by group or others;
- its SHA-256 equals the one its sidecar ``<name>.sha256`` recorded at build time (the sidecar
  passes the same ownership checks), and its name carries the key recomputed from the inputs
  above (lookups are by that name).

A library that fails a check is reported by a warning naming it and the reason, removed, and
rebuilt; nothing is ``dlopen``'ed before its checks pass. The hash catches a truncated, damaged
or planted file; the ownership checks are what keep other users out.

Where there is no compiler, the build fails, or ``LOCALGEN_CPU_KERNELS=0``, ``load`` returns None
and callers keep their torch path; the reason is logged once.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import torch  # loaded before any kernel: its libgomp is the one the kernels link

from localgen.fileio import atomic_write_text

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
# Reassociation lets reductions vectorize (the decode kernel's dot products); not -ffast-math, whose
# startup code would flush denormals for the whole process.
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11", "-fno-math-errno",
         "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros")
# Per source: layer_ops_cpu reproduces torch's roundings op by op, which a fused multiply-add
# (one rounding where torch has two) would break.
EXTRA_FLAGS = {"layer_ops_cpu": ("-ffp-contract=off", "-fno-associative-math")}
HASH_SUFFIX = ".sha256"


class UntrustedFileError(RuntimeError):
    """A cache folder or cached file that fails the ownership, mode or hash checks."""


def cache_dir() -> Path:
    """``$LOCALGEN_KERNEL_CACHE``, else the user cache folder's ``localgen/kernels``."""
    env = os.environ.get("LOCALGEN_KERNEL_CACHE")
    if env:
        return Path(env)
    try:
        import platformdirs

        return Path(platformdirs.user_cache_dir("localgen", appauthor=False)) / "kernels"
    except ImportError:
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        return Path(base) / "localgen" / "kernels"


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


@functools.lru_cache(maxsize=None)  # one compiler run a process, not one a kernel
def _version(cc: str) -> str:
    out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    return out.stdout.splitlines()[0] if out.stdout else cc


def _cpu_id() -> str:
    """What ``-march=native`` compiles for: the machine and its CPU's feature flags (Linux), so
    a cache folder shared between machines (a network home) never hands one CPU another's
    instructions."""
    ident = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
        return ident + flags
    except OSError:
        return ident + platform.processor()


def _flags(src: Path) -> tuple[str, ...]:
    return FLAGS + EXTRA_FLAGS.get(src.stem, ())


def library_name(src: Path, cc: str) -> str:
    """``<stem>-<key>.so``: the key hashes the source, the headers beside it, the compiler's
    version, the flags and the CPU, so any change to them names another file."""
    headers = b"".join(h.read_bytes() for h in sorted(src.parent.glob("*.h")))
    key = hashlib.sha256(src.read_bytes() + headers + _version(cc).encode()
                         + " ".join(_flags(src)).encode() + _cpu_id().encode())
    return f"{src.stem}-{key.hexdigest()[:16]}.so"


def _check_owned(path: Path, st: os.stat_result, what: str) -> None:
    """Raise UntrustedFileError unless ``st`` is owned by this user and not group/other-writable
    (POSIX; Windows has no such owners and modes, and keeps the hash checks only)."""
    if not hasattr(os, "getuid"):
        return
    if st.st_uid != os.getuid():
        raise UntrustedFileError(f"{what} {path} is owned by uid {st.st_uid}, not this user "
                                 f"({os.getuid()})")
    if st.st_mode & 0o022:
        raise UntrustedFileError(f"{what} {path} is writable by group or others "
                                 f"(mode {stat.S_IMODE(st.st_mode):o})")


def check_cache_dir(path: Path) -> None:
    """Create ``path`` (mode 0700) if missing. Raises UntrustedFileError unless it is a folder
    owned by this user that group and others cannot write; OSError if it cannot be created or
    written."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UntrustedFileError(f"kernel cache {path} is not a folder")
    _check_owned(path, st, "kernel cache folder")
    if not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError(f"kernel cache folder {path} is not writable")


@functools.lru_cache(maxsize=None)
def _private_dir() -> Path:
    """A fresh temp folder (mode 0700) for this process's kernels, removed at exit."""
    d = Path(tempfile.mkdtemp(prefix="localgen-kernels-"))
    atexit.register(shutil.rmtree, d, ignore_errors=True)
    return d


_refused_dirs: set[Path] = set()  # warned about once each


def _build_dir(path: Path) -> Path:
    """``path`` if it passes ``check_cache_dir``, else (with a warning) ``_private_dir()``."""
    try:
        check_cache_dir(path)
        return path
    except (OSError, UntrustedFileError) as e:
        if path not in _refused_dirs:
            _refused_dirs.add(path)
            log.warning("not using the kernel cache (%s): building the CPU kernels into a private "
                        "temp folder for this process; fix the folder or set "
                        "LOCALGEN_KERNEL_CACHE", e)
    return _private_dir()


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def verify_library(lib: Path) -> None:
    """Raise UntrustedFileError unless ``lib`` and its sidecar ``lib.sha256`` are regular files
    owned by this user, not group/other-writable, and the sidecar holds ``lib``'s SHA-256;
    FileNotFoundError if ``lib`` is missing."""
    side = lib.with_name(lib.name + HASH_SUFFIX)
    for path, what in ((lib, "cached kernel"), (side, "kernel hash file")):
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            if path is lib:
                raise
            raise UntrustedFileError(f"cached kernel {lib} has no hash file {side.name}") from None
        if not stat.S_ISREG(st.st_mode):
            raise UntrustedFileError(f"{what} {path} is not a regular file")
        _check_owned(path, st, what)
    if side.read_bytes().split()[:1] != [_sha256(lib).encode()]:
        raise UntrustedFileError(f"cached kernel {lib} does not match the SHA-256 in {side.name}")


def _discard(lib: Path, reason: Exception) -> None:
    log.warning("refusing %s (%s): rebuilding it", lib, reason)
    for p in (lib, lib.with_name(lib.name + HASH_SUFFIX)):
        with contextlib.suppress(OSError):  # the rebuild's rename replaces it anyway
            p.unlink()


def _compile(src: Path, cc: str, out: Path) -> None:
    """Compile ``src`` to ``out`` with its sidecar hash, each renamed whole into place (so
    concurrent builders never see half a file). Raises RuntimeError with the compiler's
    message."""
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *_flags(src), str(src), "-o", tmp, "-lm"], capture_output=True,
                              text=True, timeout=300)
        if proc.returncode:
            raise RuntimeError(f"{cc} failed on {src.name}: {proc.stderr.strip()[-2000:]}")
        os.chmod(tmp, 0o755)  # the linker's mode follows the umask, which may let others write
        atomic_write_text(out.with_name(out.name + HASH_SUFFIX), f"{_sha256(Path(tmp))}  {out.name}\n",
                          mode=0o644)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _build(src: Path, cc: str) -> Path:
    """The verified library for ``src``: the cached one if it passes ``verify_library``, else
    (a warning naming it when it was there but failed) built afresh.
    Raises ``RuntimeError`` with the compiler's message on failure, UntrustedFileError if the
    fresh build fails its own checks, OSError if the cache cannot be written."""
    out = _build_dir(cache_dir()) / library_name(src, cc)
    try:
        verify_library(out)
        return out
    except FileNotFoundError:
        pass
    except UntrustedFileError as e:
        _discard(out, e)
    _compile(src, cc, out)
    verify_library(out)
    return out


@functools.lru_cache(maxsize=None)
def load(name: str) -> ctypes.CDLL | None:
    """The compiled ``csrc/<name>.c`` as a ``ctypes.CDLL``, or None where it cannot be built
    (no compiler, a compile error, ``LOCALGEN_CPU_KERNELS=0``). Only a library that passed
    ``verify_library`` is opened (see the module docstring)."""
    if os.environ.get("LOCALGEN_CPU_KERNELS", "1") == "0":
        return None
    cc = _compiler()
    if cc is None:
        log.warning("no C compiler found: CPU kernel %s not built, using the torch path", name)
        return None
    try:
        return ctypes.CDLL(str(_build(CSRC / f"{name}.c", cc)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("CPU kernel %s not built (%s): using the torch path", name, e)
        return None


# The kernels' dtype argument (``enum`` in the C sources), by the tensors' dtype.
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


def library(name: str, signatures: dict[str, list]) -> ctypes.CDLL | None:
    """``load(name)`` with each listed function's ``argtypes`` set (``restype`` int: every
    kernel returns 0 or -1), once; None where it cannot be built."""
    lib = load(name)
    if lib is not None and not getattr(lib, "_lg_typed", False):
        for fn, args in signatures.items():
            getattr(lib, fn).argtypes = args
            getattr(lib, fn).restype = ctypes.c_int
        lib._lg_typed = True
    return lib


def build_all() -> dict[str, bool]:
    """Build (or load from the cache) every kernel in ``csrc/``: a CPU runner calls this at
    start-up so the first decode step does not pay the compile. Returns name -> loaded."""
    return {src.stem: load(src.stem) is not None for src in sorted(CSRC.glob("*.c"))}
