"""The version localgen reports (``localgen --version``; the server's ``/health`` and
``/v1/models``).

It is written in one place only: ``[project] version`` in ``pyproject.toml``. An installed localgen
(wheel, sdist or editable) reads it back from its distribution metadata through
``importlib.metadata``. In a source checkout, the checkout's own ``pyproject.toml`` is read first:
an editable install's metadata keeps the version it was installed with, and would go stale after a
bump until the next ``pip install -e``.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

DIST_NAME = "localgen"
# The checkout's root when this module runs from a source tree; in a wheel install it is
# site-packages, which holds no pyproject.toml naming localgen.
_SOURCE_ROOT = Path(__file__).resolve().parents[1]


def pyproject_version(pyproject: Path) -> str | None:
    """``[project] version`` of ``pyproject``, or None when the file is missing, unreadable,
    not TOML, names another project, or Python lacks ``tomllib`` (3.10)."""
    try:
        import tomllib
    except ImportError:
        return None
    try:
        project = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {})
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return None
    if project.get("name") != DIST_NAME or not isinstance(project.get("version"), str):
        return None
    return project["version"]


def package_version(source_root: Path = _SOURCE_ROOT) -> str:
    """The running localgen's version string, e.g. ``"0.1.0"`` (PEP 440).

    Order: ``source_root/pyproject.toml`` when it names localgen, then the installed
    distribution's metadata, then ``"0+unknown"`` (a source tree on Python 3.10 never installed).
    """
    return (pyproject_version(source_root / "pyproject.toml")
            or _installed_version()
            or "0+unknown")


def _installed_version() -> str | None:
    try:
        return metadata.version(DIST_NAME)
    except metadata.PackageNotFoundError:
        return None
