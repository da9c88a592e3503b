"""localgen: a local LLM runner (see DESIGN.md for the layers)."""

__version__ = "0.1.0"
