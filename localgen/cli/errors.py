"""How every `localgen` command reports the errors users cause: one or two lines on stderr —
what went wrong and where, then the fix — and exit status 1 (2 for a mistyped command, flag or
flag value, as click reports usage errors). The traceback only with ``--debug`` (before the
command: ``localgen --debug generate …``) or ``LOCALGEN_DEBUG=1``.

`GuardedGroup` is the click group class of the `localgen` app (``typer.Typer(cls=GuardedGroup)``):
its ``invoke`` runs every subcommand, nested groups included, so commands need no handler of
their own. `describe` maps an exception to its lines and can be used on its own.
"""

from __future__ import annotations

import errno
import os
import re
import sys
from typing import Any, Sequence

import typer
from typer.core import TyperGroup

DEBUG_ENV = "LOCALGEN_DEBUG"
_DEBUG_KEY = "localgen.debug"
# An Ollama-style model name: no slash, no .gguf suffix, an optional :tag (llama3, qwen2.5:7b).
_OLLAMA_TAG = re.compile(r"^[a-z0-9][a-z0-9._-]*(:[A-Za-z0-9._-]+)?$")
_OOM_FIX = ("give the KV cache less memory (--kv-cache-memory 512MiB), run fewer sequences "
            "(--max-num-seqs), pick a smaller model, or offload (localgen tune, --percent)")


def debug_enabled(ctx: Any = None) -> bool:
    """``--debug`` was given (in ``ctx``'s meta) or ``$LOCALGEN_DEBUG`` is 1/true/yes/on."""
    if ctx is not None and ctx.meta.get(_DEBUG_KEY):
        return True
    return os.environ.get(DEBUG_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def looks_like_ollama_tag(name: str) -> bool:
    """``llama3``, ``qwen2.5:7b``: a bare name that is neither a path nor a hub ``org/name``."""
    return bool(_OLLAMA_TAG.match(name)) and not name.endswith(".gguf") and not os.path.exists(name)


def ollama_hint(name: str) -> str:
    return (f"'{name}' looks like an Ollama model name; localgen runs a GGUF file "
            "(--model path/to/model.gguf) or a Hugging Face repo id (--model "
            "HuggingFaceTB/SmolLM2-135M-Instruct, or a GGUF repo as org/name-GGUF:Q4_K_M; "
            "`localgen pull REPO` downloads one ahead)")


def model_arg(args: Sequence[str]) -> str | None:
    """The value given to ``--model``/``-m`` in a command line, if any."""
    for i, a in enumerate(args):
        if a in ("--model", "-m") and i + 1 < len(args):
            return args[i + 1]
        if a.startswith("--model="):
            return a.split("=", 1)[1]
    return None


def describe(e: BaseException, model: str | None = None) -> list[str]:
    """One or two lines for ``e``: ``error: what, where`` and, when one is known, ``fix: …``.
    ``model`` is the model the user named, for the Ollama hint."""
    name, mod = type(e).__name__, type(e).__module__ or ""
    msg = _first_line(e)
    if name == "ModelNotFoundError":
        if model and looks_like_ollama_tag(model):
            return [f"error: model '{model}' not found", "fix: " + ollama_hint(model)]
        return [f"error: {msg}"]
    if name in ("UnsupportedModelError", "CorruptModelError", "KVBudgetError", "PromptTooLongError"):
        return [f"error: {msg}"]
    if isinstance(e, MemoryError) or name == "OutOfMemoryError":
        return [f"error: out of memory ({msg or name})", "fix: " + _OOM_FIX]
    if mod.split(".")[0] in ("huggingface_hub", "requests", "httpx", "urllib3") or name in (
            "ConnectionError", "ConnectTimeout", "ReadTimeout"):
        return [f"error: the Hugging Face hub could not be reached ({name}: {msg})",
                "fix: check the network or proxy settings, or set HF_HUB_OFFLINE=1 to use only "
                "models already in the local cache"]
    if isinstance(e, OSError):
        return _os_error(e, msg)
    if isinstance(e, ValueError):
        return [f"error: {msg}"]
    return [f"error: {name}: {msg}" if msg else f"error: {name}",
            f"fix: this looks like a bug in localgen; run again with --debug (or {DEBUG_ENV}=1) "
            "and report the traceback"]


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    if isinstance(e, KeyError) and len(e.args) == 1 and isinstance(e.args[0], str):
        text = e.args[0]
    return text.splitlines()[0] if text else ""


def _os_error(e: OSError, msg: str) -> list[str]:
    where = f": {e.filename}" if e.filename else ""
    what = e.strerror or msg or type(e).__name__
    if isinstance(e, FileNotFoundError):
        return [f"error: {msg if not e.filename else what + where}",
                "fix: check the path (localgen models lists the models found on this machine)"]
    if isinstance(e, PermissionError):
        return [f"error: permission denied{where}", "fix: pick a file or folder you can write, or "
                "change its permissions"]
    if e.errno == errno.ENOSPC:
        return [f"error: no space left on the device{where}", "fix: free some disk space or write "
                "to another folder"]
    return [f"error: {what}{where}"]


def remember_debug(ctx: typer.Context, value: bool) -> None:
    """Callback of the app's ``--debug`` option: kept in the context for `GuardedGroup`."""
    if value:
        ctx.meta[_DEBUG_KEY] = True


class GuardedGroup(TyperGroup):
    """The `localgen` group: every subcommand run under `describe`."""

    def invoke(self, ctx: Any) -> Any:
        from typer._click import exceptions as cx

        args = [*ctx._protected_args, *ctx.args]
        try:
            return super().invoke(ctx)
        except (typer.Exit, typer.Abort, cx.NoArgsIsHelpError):
            raise
        except cx.UsageError as e:
            if debug_enabled(ctx):
                raise
            hint = e.ctx.command_path if e.ctx is not None else ctx.command_path
            _print([f"error: {e.format_message()}", f"fix: see '{hint} --help'"])
            raise typer.Exit(e.exit_code) from None
        except cx.ClickException:
            raise
        except Exception as e:
            if debug_enabled(ctx):
                raise
            _print(describe(e, model_arg(args)))
            raise typer.Exit(1) from None


def _print(lines: list[str]) -> None:
    from localgen.cli.status import clear

    clear()  # a load status line still on the terminal
    for line in lines:
        typer.echo(line, err=True)
    sys.stderr.flush()
