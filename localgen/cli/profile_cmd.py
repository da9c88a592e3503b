"""`localgen profile`: measure this machine and save its HardwareProfile (FlexGen App. A.3 constants).

The folders it writes into are checked before the measurements start, and measurements that
cannot be saved where asked are printed and saved elsewhere, never dropped.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import NoReturn

import typer

from localgen.fileio import atomic_write_text, check_writable_dir


def require_writable_dir(path: Path, fix: str) -> None:
    """``check_writable_dir(path)``, or an ``error:`` line on stderr (the folder, the reason and
    ``fix``: how to choose another) and exit status 1. For commands to call before slow work."""
    try:
        check_writable_dir(path)
    except OSError as e:
        typer.echo(f"error: {e.strerror or e} ({fix})", err=True)
        raise typer.Exit(1) from None


def profile(
    offload_dir: Path = typer.Option(None, help="Folder for the disk probes.", show_default="config dir/offload"),
    quick: bool = typer.Option(False, help="Small sizes, 3 repeats: seconds, noisier."),
    output: Path = typer.Option(None, help="Write the JSON here instead of the user config dir."),
    cpu_only: bool = typer.Option(False, "--cpu-only", help="Ignore any GPU."),
) -> None:
    """Measure bandwidths (CPU<->GPU, disk), FLOP/s and capacities; save as the default profile.

    Examples:

        localgen profile

        localgen profile --quick --cpu-only --output cpu.json
    """
    from rich.console import Console
    from rich.progress import Progress

    from localgen.profiler.hardware import PROFILE_FILE, default_offload_dir, user_config_dir
    from localgen.profiler.probes import QUICK, run_profile

    console = Console()
    target = output if output is not None else user_config_dir() / PROFILE_FILE
    require_writable_dir(target.parent, "pass --output FILE" if output is not None else
                         "set LOCALGEN_CONFIG_DIR to a writable folder or pass --output FILE")
    offload_dir = offload_dir or default_offload_dir()
    require_writable_dir(offload_dir, "pass --offload-dir DIR")
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("profiling", total=1)

        def step(name: str, i: int, n: int) -> None:
            bar.update(task, total=n, completed=i, description=name)

        hw = run_profile(offload_dir, sizes=QUICK if quick else None, progress=step,
                         use_gpu=False if cpu_only else None)
    print_profile(hw, console)
    try:
        path = hw.save(target)
    except OSError as e:
        save_elsewhere(hw, target, e)
    typer.echo(f"saved to {path}", err=True)  # the table above is the data; this, a summary


def save_elsewhere(hw, target: Path, err: OSError) -> NoReturn:
    """Print ``hw`` as JSON on stdout and save it in the current folder (else the temp folder),
    then exit with status 1 and a line on stderr saying where it is and how to use it:
    measurements that could not be saved at ``target`` are never lost."""
    text = hw.to_json()
    sys.stdout.write(text)
    sys.stdout.flush()
    name = time.strftime("localgen-hardware-%Y%m%d-%H%M%S.json")
    spare = None
    for folder in (Path("."), Path(tempfile.gettempdir())):
        try:
            spare = atomic_write_text(folder / name, text).resolve()
            break
        except OSError:
            continue
    msg = f"error: could not save the profile to {target} ({err.strerror or err})."
    if spare is None:
        msg += " The measurements are printed above (JSON): save them in a file to use them."
    else:
        msg += (f" The measurements are saved in {spare}: use them with `localgen tune --profile {spare}`"
                f" (or chat --profile) or copy the file to {target}.")
    typer.echo(msg, err=True)
    raise typer.Exit(1)


def print_profile(hw, console) -> None:
    """A table of the profile in user units (GB/s, TFLOP/s, GiB)."""
    from rich.table import Table

    from localgen.profiler.hardware import GiB

    t = Table(title=f"{hw.name}: {hw.gpu_name or 'no GPU'} / {hw.cpu_name}")
    t.add_column("quantity")
    t.add_column("value", justify="right")
    for f in ("ctog_bdw", "gtoc_bdw", "ctog_bdw_pageable", "gtoc_bdw_pageable", "dtoc_bdw", "ctod_bdw",
              "gpu_mem_bdw", "cpu_mem_bdw"):
        v = getattr(hw, f)
        t.add_row(f, "-" if v is None else f"{v / 1e9:.2f} GB/s")
    for f in ("mm_flops", "mm_flops_gen", "bmm_flops", "bmm_flops_gen", "cpu_flops"):
        t.add_row(f, f"{getattr(hw, f) / 1e12:.4g} TFLOP/s")
    for f in ("gpu_mem", "cpu_mem", "disk_mem"):
        t.add_row(f, f"{getattr(hw, f) / GiB:.1f} GiB")
    console.print(t)
