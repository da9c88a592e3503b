"""`localgen tune`: profile -> model and workload -> policy search -> saved as the model's default."""

from __future__ import annotations

from pathlib import Path

import typer


def tune(
    model: str = typer.Option("smollm2-135m", help="Preset name, hub id, local dir or GGUF path."),
    workload: str = typer.Option("chat", help="chat (batch 1, lowest latency) or batch (throughput)."),
    prompt_len: int = typer.Option(512, help="Prompt tokens."),
    gen_len: int = typer.Option(32, help="Generated tokens."),
    compression: str = typer.Option("auto", help="4-bit weights/KV: off, on or auto."),
    latency_bound: float = typer.Option(None, help="Max seconds for one zig-zag block (prefill + all tokens)."),
    tiers: str = typer.Option("any", help="any: the fastest placement over GPU, RAM and disk; fewest: the "
                                          "fewest tiers that hold the model (RAM and disk only if needed)."),
    profile: str = typer.Option(None, help="Profile name (flexgen_t4, h200, cpu_2core) or JSON path.",
                                show_default="the saved one, else measure now"),
    offload_dir: Path = typer.Option(None, help="Folder for the disk probes if measuring."),
    yes: bool = typer.Option(False, "--yes", "-y", help="No wizard: take the options and save."),
    reset: bool = typer.Option(False, "--reset", help="Remove the policy saved for --model (chat, batch and generate go back to their defaults) and exit."),
) -> None:
    """Find the fastest placement policy for a model on this machine and save it as its default.

    Ends with one sentence on why the policy wins, where it was saved, and how to undo it
    (`localgen tune --reset --model M`).

    Examples:

        localgen tune --model ~/models/llama-3.1-8b-instruct-q4_k_m.gguf --workload chat --yes

        localgen tune --reset --model ~/models/llama-3.1-8b-instruct-q4_k_m.gguf
    """
    from localgen.policy.tuning import TuneRequest

    if reset:
        _reset(model)
        return

    for name, value, allowed in (("--workload", workload, ("chat", "batch")),
                                 ("--compression", compression, ("off", "on", "auto")),
                                 ("--tiers", tiers, ("any", "fewest"))):
        if value not in allowed:
            raise typer.BadParameter(f"{value!r} is not one of {'|'.join(allowed)}", param_hint=name)
    req = TuneRequest(model, workload, prompt_len, gen_len, compression, latency_bound, tiers)
    _check_output_dirs(model, profile, offload_dir)
    if yes:
        _run_plain(req, profile, offload_dir)
        return
    try:
        from localgen.tui.tune import TuneApp
    except ImportError:  # source checkout without the package installed
        from tui.tune import TuneApp
    wizard = TuneApp(req, profile_name=profile, offload_dir=offload_dir)
    wizard.run()
    if wizard.saved_path is not None:  # the wizard's last words stay in the terminal
        from localgen.policy.explain import undo_hint

        typer.echo(wizard.why or "")
        typer.echo(f"saved to {wizard.saved_path}")
        typer.echo(undo_hint(wizard.req.model))


def _check_output_dirs(model: str, profile: str | None, offload_dir: Path | None) -> None:
    """Exit with an error line unless the folders tune writes into take files: the policy folder,
    and when it will measure (no profile given or saved) the config and offload folders."""
    from localgen.cli.profile_cmd import require_writable_dir
    from localgen.profiler.hardware import default_offload_dir
    from localgen.policy.store import policy_path
    from localgen.profiler.hardware import PROFILE_FILE, user_config_dir

    fix = "set LOCALGEN_CONFIG_DIR to a writable folder"
    require_writable_dir(policy_path(model).parent, fix)
    if profile is None and not (user_config_dir() / PROFILE_FILE).is_file():
        require_writable_dir(user_config_dir(), fix + " or pass --profile NAME|FILE")
        require_writable_dir(offload_dir or default_offload_dir(), "pass --offload-dir DIR")


def _run_plain(req, profile_name, offload_dir) -> None:
    from rich.console import Console

    from localgen.cli.profile_cmd import print_profile
    from localgen.profiler.hardware import default_offload_dir
    from localgen.policy.explain import cost_model_for, undo_hint, why_sentence
    from localgen.policy.search import NoFeasiblePolicyError
    from localgen.policy.tuning import get_profile, result_lines, run_search, save_result
    from localgen.profiler.probes import run_profile

    console = Console()
    odir = offload_dir or default_offload_dir()
    hw = get_profile(profile_name, str(odir), lambda: run_profile(odir))
    print_profile(hw, console)
    try:
        res = run_search(req, hw)
    except NoFeasiblePolicyError as e:
        console.print(f"[red]{e}[/red]")
        raise typer.Exit(1)
    for line in result_lines(res):
        console.print(line, highlight=False)
    console.print(why_sentence(cost_model_for(req.model, hw, req.prompt_len, req.gen_len), res),
                  highlight=False)
    path = save_result(req, hw, res)
    console.print(f"saved to {path}", highlight=False)
    console.print(undo_hint(req.model), highlight=False)


def _reset(model: str) -> None:
    from localgen.policy.store import policy_path

    p = policy_path(model)
    try:
        p.unlink()
    except FileNotFoundError:
        typer.echo(f"no saved policy for {model} (looked for {p})", err=True)
        return
    except OSError as e:
        typer.echo(f"error: cannot remove {p}: {e.strerror or e}", err=True)
        raise typer.Exit(1)
    typer.echo(f"removed {p}; chat, batch and generate use their default placement for {model} again",
               err=True)
