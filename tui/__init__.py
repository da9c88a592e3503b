"""Textual terminal UI (installed as ``localgen.tui``); reaches the engine only through localgen.api."""
