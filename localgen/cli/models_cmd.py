"""`localgen models [PATHS...]`: list the models this machine can run."""

from __future__ import annotations

import json
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
    as_json: bool = typer.Option(False, "--json", help="Print a JSON array (name, kind, architecture, size_bytes, path, error) instead of the table."),
) -> None:
    """List the embedded default model, models in the Hugging Face cache, and PATHS.

    Examples:

        localgen models

        localgen models ~/models/qwen2.5-0.5b-instruct-q4_k_m.gguf

        localgen models --json | jq -r '.[].name'
    """
    from localgen.models.sources import list_local_models  # heavy imports stay out of --help

    infos = list_local_models(paths or ())
    if as_json:
        rows = [{"name": i.name, "kind": i.kind, "architecture": i.architecture,
                 "size_bytes": i.size_bytes, "path": str(i.path), "error": i.error} for i in infos]
        typer.echo(json.dumps(rows, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Local models")
    for col in ("name", "kind", "architecture", "size", "path"):
        table.add_column(col, overflow="fold")
    for info in infos:
        arch = info.architecture if info.error is None else f"[red]{info.error}[/red]"
        table.add_row(info.name, info.kind, arch, _human_bytes(info.size_bytes), str(info.path))
    Console().print(table)
