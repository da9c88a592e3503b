"""`localgen profile`: measure this machine and save its HardwareProfile (FlexGen App. A.3 constants)."""

from __future__ import annotations

from pathlib import Path

import typer


def default_offload_dir() -> Path:
    from localgen.profiler.hardware import user_config_dir

    return user_config_dir() / "offload"


def profile(
    offload_dir: Path = typer.Option(None, help="Folder for the disk probes (default: config dir/offload)."),
    quick: bool = typer.Option(False, help="Small sizes, 3 repeats: seconds, noisier."),
    output: Path = typer.Option(None, help="Write the JSON here instead of the user config dir."),
    cpu_only: bool = typer.Option(False, "--cpu-only", help="Ignore any GPU."),
) -> None:
    """Measure bandwidths (CPU<->GPU, disk), FLOP/s and capacities; save as the default profile."""
    from rich.console import Console
    from rich.progress import Progress

    from localgen.profiler.probes import QUICK, run_profile

    console = Console()
    offload_dir = offload_dir or default_offload_dir()
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("profiling", total=1)

        def step(name: str, i: int, n: int) -> None:
            bar.update(task, total=n, completed=i, description=name)

        hw = run_profile(offload_dir, sizes=QUICK if quick else None, progress=step,
                         use_gpu=False if cpu_only else None)
    path = hw.save(output)
    print_profile(hw, console)
    console.print(f"saved to {path}")


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
