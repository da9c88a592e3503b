"""`localgen pull REPO[:QUANT|:FILE]`: download a model from the Hugging Face hub into its cache."""

from __future__ import annotations

from typing import Optional

import typer


def pull(
    model: str = typer.Argument(
        ..., metavar="REPO[:QUANT|:FILE]",
        help="A hub repo, e.g. HuggingFaceTB/SmolLM2-135M-Instruct (safetensors: config, tokenizer "
             "and weights) or bartowski/SmolLM2-135M-Instruct-GGUF:Q8_0 (the GGUF of that quant, "
             "default Q4_K_M; :path/in/repo.gguf names a file)."),
    revision: Optional[str] = typer.Option(None, "--revision", help="Branch, tag or commit.", show_default="main"),
) -> None:
    """Download a model into the Hugging Face cache, where `--model REPO[:QUANT]` finds it.

    Files already cached are not fetched again; a download cut short (a dropped connection,
    Ctrl-C) resumes where it stopped when run again; every file is checked against the hub's
    SHA-256 (or git blob id) before it is used. HF_TOKEN (or `hf auth login`) reads gated
    and private repos; HF_ENDPOINT names another hub.

    Examples:

        localgen pull HuggingFaceTB/SmolLM2-360M-Instruct

        localgen pull org/name-GGUF:Q4_K_M
    """
    from localgen.hub.pull import PullError, pull as pull_ref  # heavy imports stay out of --help
    from localgen.hub.refs import parse_ref

    ref = parse_ref(model)
    if ref is None:
        raise typer.BadParameter(f"{model!r} is not REPO[:QUANT|:FILE] (like org/name:Q4_K_M)",
                                 param_hint="REPO")
    try:
        got = pull_ref(ref, revision=revision)
    except PullError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        typer.echo("interrupted: run the same pull again to finish it", err=True)
        raise typer.Exit(130) from None
    typer.echo(f"{ref} ({'GGUF' if got.format == 'gguf' else 'safetensors'}, commit "
               f"{got.commit[:12]}): {got.path}")
    problem = _why_not_runnable(str(ref), revision)
    if problem:
        typer.echo(f"note: localgen cannot run it: {problem}", err=True)
    else:
        typer.echo(f"run it: localgen chat --model {ref}")


def _why_not_runnable(model: str, revision: str | None) -> str | None:
    """Why localgen would refuse the pulled model (its config read from the cache), or None."""
    from localgen.models.config import CorruptModelError, UnsupportedModelError
    from localgen.models.sources import resolve_model

    try:
        resolve_model(model, revision=revision, offline=True)
    except (UnsupportedModelError, CorruptModelError, FileNotFoundError) as e:
        return str(e)
    return None
