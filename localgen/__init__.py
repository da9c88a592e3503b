"""localgen: a local LLM runner (see docs/ARCHITECTURE.md for the layers)."""

__version__ = "0.1.0"
