"""Build and load the C kernels under ``csrc/`` for the CPU this process runs on.

Each source is compiled once per machine with the system C compiler (``$CC``, else ``cc``) at
``-O3 -march=native -fopenmp`` (and reassociation) into a per-user cache folder keyed by a hash
of the source, its headers, the compiler's version, the flags and the CPU, and loaded with
``ctypes``. Compiling plain C takes about a second and needs no torch headers. A shared object
linking ``libgomp.so.1`` resolves to the copy torch already loaded (same soname), so the kernels
run on torch's OpenMP threads.

Where there is no compiler, the build fails, or ``LOCALGEN_CPU_KERNELS=0``, ``load`` returns None
and callers keep their torch path; the reason is logged once.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch  # loaded before any kernel: its libgomp is the one the kernels link

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
# Reassociation lets reductions vectorize (1.6x on the decode kernel); not -ffast-math, whose
# startup code would flush denormals for the whole process.
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11", "-fno-math-errno",
         "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros")
# Per source: layer_ops_cpu reproduces torch's roundings op by op, which a fused multiply-add
# (one rounding where torch has two) would break.
EXTRA_FLAGS = {"layer_ops_cpu": ("-ffp-contract=off", "-fno-associative-math")}


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


def _build(src: Path, cc: str) -> Path:
    """Compile ``src`` into the cache (atomically: concurrent builders each rename a whole file
    into place), keyed by the source, the headers beside it, the compiler, the flags and the
    CPU.
    Raises ``RuntimeError`` with the compiler's message on failure."""
    flags = FLAGS + EXTRA_FLAGS.get(src.stem, ())
    headers = b"".join(h.read_bytes() for h in sorted(src.parent.glob("*.h")))
    key = hashlib.sha256(src.read_bytes() + headers + _version(cc).encode()
                         + " ".join(flags).encode() + _cpu_id().encode())
    out = cache_dir() / f"{src.stem}-{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    proc = subprocess.run([cc, *flags, str(src), "-o", tmp, "-lm"], capture_output=True,
                          text=True, timeout=300)
    if proc.returncode:
        os.unlink(tmp)
        raise RuntimeError(f"{cc} failed on {src.name}: {proc.stderr.strip()[-2000:]}")
    os.replace(tmp, out)
    return out


@functools.lru_cache(maxsize=None)
def load(name: str) -> ctypes.CDLL | None:
    """The compiled ``csrc/<name>.c`` as a ``ctypes.CDLL``, or None where it cannot be built
    (no compiler, a compile error, ``LOCALGEN_CPU_KERNELS=0``)."""
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
