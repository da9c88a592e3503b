"""localgen: a local LLM runner (see docs/ARCHITECTURE.md for the layers)."""

from localgen.version import package_version

__version__ = package_version()
