"""`localgen models [PATHS...]`: list the models this machine can run."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def models(
    paths: Optional[List[Path]] = typer.Argument(
        None, help="Extra model paths to describe (.gguf files or Hugging Face model directories)."
    ),
) -> None:
    """List the embedded default model, models in the Hugging Face cache, and PATHS."""
    from rich.console import Console
    from rich.table import Table

    from localgen.models.sources import list_local_models  # heavy imports stay out of --help

    table = Table(title="Local models")
    for col in ("name", "kind", "architecture", "size", "path"):
        table.add_column(col, overflow="fold")
    for info in list_local_models(paths or ()):
        arch = info.architecture if info.error is None else f"[red]{info.error}[/red]"
        table.add_row(info.name, info.kind, arch, _human_bytes(info.size_bytes), str(info.path))
    Console().print(table)
