"""localgen: a local LLM runner (see docs/ARCHITECTURE.md for the layers)."""

import localgen.omp_env  # noqa: F401 - before anything loads torch (and its OpenMP runtime)
from localgen.version import package_version

__version__ = package_version()
