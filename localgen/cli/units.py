"""Human sizes on the command line: "512MiB", "2GiB", "1.5GB", "4096" (bytes)."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    # SI (powers of 1000)
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    # IEC (powers of 1024)
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    # bare letters follow the usual tool convention (docker, java -Xmx): binary
    "k": 1024,
    "m": 1024**2,
    "g": 1024**3,
    "t": 1024**4,
}

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Parse a size into bytes.

    ``"512MiB"`` -> 536870912, ``"2GiB"`` -> 2147483648, ``"1.5GB"`` -> 1500000000,
    ``"4096"`` -> 4096. KB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB and the bare letters
    K/M/G/T powers of 1024; case is ignored. Raises ValueError naming the accepted forms.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"size must be >= 0, got {text}")
        return text
    m = _SIZE_RE.match(str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(
            f"cannot read size {text!r}: use a number of bytes or a number with a unit "
            "(KB/MB/GB/TB = 1000^n, KiB/MiB/GiB/TiB = 1024^n), e.g. 512MiB, 2GiB, 1.5GB"
        )
    return int(round(float(m.group(1)) * _UNITS[m.group(2).lower()]))


def format_size(n: int | float) -> str:
    """Bytes as a short IEC string: 1536 -> '1.5 KiB', 2147483648 -> '2.0 GiB'."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
