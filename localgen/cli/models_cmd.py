"""`localgen models [PATHS...]` lists the models on this machine and whether localgen runs each;
`localgen rm REPO[:QUANT]` removes one from the Hugging Face cache."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import List, Optional

import typer

_COLUMNS = ("name", "format", "quant", "family", "size", "runs", "file")


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


@dataclass
class Row:
    """One model as `localgen models` shows it. ``runnable`` is decided by the checks the loader
    makes on the config (architecture, settings, tensor names and types; no weights read), and
    ``error`` is the loader's sentence when it is False."""

    name: str
    kind: str  # "embedded" | "hub" | "local"
    repo: str | None
    file: str
    format: str  # "gguf" | "safetensors"
    quant: str | None
    family: str | None
    architecture: str | None
    size_bytes: int
    path: str
    runnable: bool = False
    error: str | None = None


def _probe(row: Row) -> Row:
    """``row`` with family, architecture, runnable and error filled in from the loader's own
    resolution of its path (config and tensor index only)."""
    from localgen.models.config import CorruptModelError, UnsupportedModelError
    from localgen.models.sources import ModelNotFoundError, resolve_model

    try:
        cfg = resolve_model(row.path).config
    except (UnsupportedModelError, CorruptModelError, ModelNotFoundError, OSError, KeyError,
            ValueError) as e:
        row.error = str(e).strip("'\"") if isinstance(e, KeyError) else str(e)
        return row
    row.runnable, row.architecture = True, cfg.architecture
    row.family = cfg.architecture.removesuffix("ForCausalLM")
    row.quant = row.quant or cfg.extra.get("gguf_file_type") or None
    return row


def _path_row(path: Path, name: str, kind: str) -> Row:
    """The row of a GGUF file or model directory given by path (a missing one says so)."""
    from localgen.hub.refs import quant_of

    gguf = path.suffix == ".gguf"
    row = Row(name, kind, None, path.name if gguf else "", "gguf" if gguf else "safetensors",
              quant_of(path.name) if gguf else None, None, None, 0, str(path))
    if not path.exists():
        row.error = "no such file or directory"
        return row
    if gguf:
        from localgen.models.gguf_split import split_parts

        row.size_bytes = sum(p.stat().st_size for p in split_parts(path) or [path])
    else:
        from localgen.hub.cache import checkpoint_dtype

        weights = sorted(path.glob("*.safetensors"))
        row.file, row.size_bytes = ", ".join(p.name for p in weights), sum(p.stat().st_size for p in weights)
        row.quant = checkpoint_dtype(path)
    return _probe(row)


def model_rows(paths=()) -> list[Row]:
    """The embedded default model, every model in the Hugging Face cache, then ``paths``."""
    from localgen.hub.cache import cached_models
    from localgen.models.sources import EMBEDDED_NAME, ModelNotFoundError, embedded_gguf_path

    rows = []
    try:
        rows.append(_path_row(embedded_gguf_path(), EMBEDDED_NAME, "embedded"))
    except ModelNotFoundError:
        pass
    for m in cached_models():
        rows.append(_probe(Row(m.name, "hub", m.repo_id, m.file, m.format, m.quant, None, None,
                               m.size_bytes, str(m.path))))
    rows += [_path_row(Path(p).expanduser(), Path(p).name, "local") for p in paths]
    return rows


def models(
    paths: Optional[List[Path]] = typer.Argument(
        None, help="Extra model paths to describe (.gguf files or Hugging Face model directories)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON array (name, kind, repo, file, format, quant, family, architecture, size_bytes, path, runnable, error) instead of the table."),
) -> None:
    """List the embedded default model, every model in the Hugging Face cache (what `localgen
    pull` fetched), and PATHS: format, quant, family, size, and whether localgen runs it (the
    loader's checks on its config; no weights are read).

    Examples:

        localgen models

        localgen models ~/models/qwen2.5-0.5b-instruct-q4_k_m.gguf

        localgen models --json | jq -r '.[] | select(.runnable) | .name'
    """
    rows = model_rows(paths or ())
    if as_json:
        typer.echo(json.dumps([asdict(r) for r in rows], indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Local models")
    for col in _COLUMNS:
        table.add_column(col, overflow="fold")
    for r in rows:
        runs = "yes" if r.runnable else f"[red]no: {r.error}[/red]"
        table.add_row(r.name, r.format, r.quant or "", r.family or "?", _human_bytes(r.size_bytes),
                      runs, r.file)
    Console().print(table)


def rm(
    model: str = typer.Argument(..., metavar="REPO[:QUANT|:FILE]",
                                help="A cached hub repo (all its files) or one GGUF of it by quant or path."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Remove without asking."),
) -> None:
    """Remove a model from the Hugging Face cache (through huggingface_hub's cache API; files
    another cached model shares stay) and say how much space it freed.

    Examples:

        localgen rm bartowski/SmolLM2-135M-Instruct-GGUF:Q8_0

        localgen rm HuggingFaceTB/SmolLM2-360M-Instruct --yes
    """
    from localgen.hub.cache import plan_removal
    from localgen.hub.refs import parse_ref

    ref = parse_ref(model)
    if ref is None:
        raise typer.BadParameter(f"{model!r} is not REPO[:QUANT|:FILE] (like org/name:Q4_K_M)",
                                 param_hint="REPO")
    plan = plan_removal(ref)
    listed = ", ".join(m.name for m in plan.models) or plan.what
    size = _human_bytes(plan.strategy.expected_freed_size)
    if not yes and not typer.confirm(f"remove {listed} ({size}) from the Hugging Face cache?"):
        typer.echo("nothing removed")
        raise typer.Exit(1)
    plan.strategy.execute()
    typer.echo(f"removed {listed}: freed {size}")
