"""The `localgen` command: thin Typer commands that parse, call the API and print.

Each command lives in its own module and imports heavy libraries (torch, transformers) inside the
function, so `localgen --help` stays fast.
"""

from __future__ import annotations

import atexit
import gc
import sys

import typer

from localgen.cli.errors import DEBUG_ENV, GuardedGroup, remember_debug


def _freeze_at_exit() -> None:
    """Freeze the objects alive at exit out of the garbage collections the interpreter runs as it
    exits, which walk every object torch and transformers created; the memory goes back whole
    anyway. Not where a nanobind extension is loaded (triton, xgrammar): it reports the objects
    that were never freed, a page of warnings."""
    if not any(m in sys.modules for m in ("triton", "xgrammar")):
        gc.freeze()


atexit.register(_freeze_at_exit)  # atexit runs last what registers first: after every other handler

# GuardedGroup turns the errors users cause into one or two lines (localgen/cli/errors.py)
app = typer.Typer(
    name="localgen",
    help="Run LLMs locally: paged KV cache, continuous batching, offloading policy search.",
    no_args_is_help=True,
    add_completion=True,
    cls=GuardedGroup,
    pretty_exceptions_show_locals=False,
)


def _print_version(value: bool) -> None:
    if value:
        from localgen import __version__

        typer.echo(f"localgen {__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    version: bool = typer.Option(False, "--version", "-V", callback=_print_version, is_eager=True,
                                 help="Print localgen's version and exit."),
    debug: bool = typer.Option(False, "--debug", callback=remember_debug, is_eager=True,
                               help=f"Show the full traceback of an error (also {DEBUG_ENV}=1)."),
) -> None:
    pass


# Registration: one line per command module (keep this list sorted by command name).
from localgen.cli import batch_cmd; app.command("batch")(batch_cmd.batch)  # noqa: E402,E702
from localgen.cli import generate_cmd; app.command("generate")(generate_cmd.generate)  # noqa: E402,E702

from localgen.cli import models_cmd; app.command("models")(models_cmd.models)  # noqa: E402,E702
from localgen.cli import pull_cmd; app.command("pull")(pull_cmd.pull)  # noqa: E402,E702
from localgen.cli import profile_cmd  # noqa: E402
app.command("profile")(profile_cmd.profile)
app.command("rm")(models_cmd.rm)
from localgen.cli import serve_cmd; app.command("serve")(serve_cmd.serve)  # noqa: E402,E702
from localgen.cli import tune_cmd  # noqa: E402
app.command("tune")(tune_cmd.tune)
from localgen.cli import bench_cmd; app.add_typer(bench_cmd.app, name="bench")  # noqa: E402,E702
from localgen.cli import chat_cmd; app.command("chat")(chat_cmd.chat)  # noqa: E402,E702
