"""FlexGen's offloading flags (FlexGen §4, its `--percent` placement and §5 compression), declared
once for every command that loads a model: `batch`, `generate` and `chat`.

A command takes one ``offload: OffloadFlags`` parameter and is decorated with
:func:`with_offload_flags`, which shows Typer the nine options in that parameter's place and hands
the command their values as one :class:`OffloadFlags`. :func:`offload_options` turns them into
``LLM.load`` keywords.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable, Optional

import typer

from localgen.cli.units import parse_size

PERCENT = tuple[float, float, float, float, float, float]


@dataclasses.dataclass(frozen=True)
class OffloadFlags:
    """The offloading flags as given on the command line; None: not given (the saved policy, if
    any, decides). Percentages are FlexGen's ``wg wc cg cc hg hc``; sizes are strings such as
    ``6GiB``, parsed by :func:`offload_options`."""

    percent: Optional[PERCENT] = None
    gpu_batch_size: Optional[int] = None
    num_gpu_batches: Optional[int] = None
    compress_weight: Optional[bool] = None
    compress_cache: Optional[bool] = None
    cpu_cache_compute: Optional[bool] = None
    offload_dir: Optional[str] = None
    gpu_memory: Optional[str] = None
    cpu_memory: Optional[str] = None


# the Typer option of each OffloadFlags field, in the order --help lists them
_OPTIONS: dict[str, tuple[Any, Any]] = {
    "percent": (Optional[PERCENT], typer.Option(None, "--percent", help="FlexGen placement in percent: wg wc cg cc hg hc (weights, KV cache, activations on GPU / CPU; disk takes the rest). Overrides the saved policy.")),
    "gpu_batch_size": (Optional[int], typer.Option(None, "--gpu-batch-size", min=1, help="Sequences per GPU batch (policy gbs).")),
    "num_gpu_batches": (Optional[int], typer.Option(None, "--num-gpu-batches", min=1, help="GPU batches per zig-zag block sharing each loaded layer.")),
    "compress_weight": (Optional[bool], typer.Option(None, "--compress-weight/--no-compress-weight", help="4-bit group-wise weights (g=64).")),
    "compress_cache": (Optional[bool], typer.Option(None, "--compress-cache/--no-compress-cache", help="4-bit group-wise KV cache (g=64).")),
    "cpu_cache_compute": (Optional[bool], typer.Option(None, "--cpu-cache-compute/--no-cpu-cache-compute", help="Decode attention over a CPU/disk KV cache runs on the CPU.")),
    "offload_dir": (Optional[str], typer.Option(None, "--offload-dir", help="Folder for disk-tier weights and KV files.")),
    "gpu_memory": (Optional[str], typer.Option(None, "--gpu-memory", help="Cap on GPU memory, e.g. 6GiB (emulates a smaller GPU).")),
    "cpu_memory": (Optional[str], typer.Option(None, "--cpu-memory", help="Cap on host memory for weights and KV, e.g. 16GiB.")),
}
assert list(_OPTIONS) == [f.name for f in dataclasses.fields(OffloadFlags)]


def with_offload_flags(command: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a Typer command whose ``offload`` parameter is an :class:`OffloadFlags`: Typer sees
    the nine offloading options where ``offload`` stands, and the command receives them as one
    ``OffloadFlags``. Raises TypeError when the command has no ``offload`` parameter."""
    sig = inspect.signature(command, eval_str=True)
    if "offload" not in sig.parameters:
        raise TypeError(f"{command.__qualname__}: with_offload_flags needs an `offload` parameter")
    params: list[inspect.Parameter] = []
    for p in sig.parameters.values():
        if p.name != "offload":
            params.append(p)
            continue
        params += [inspect.Parameter(name, p.kind, default=opt, annotation=ann)
                   for name, (ann, opt) in _OPTIONS.items()]

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        flags = OffloadFlags(**{name: kwargs.pop(name) for name in _OPTIONS if name in kwargs})
        return command(*args, offload=flags, **kwargs)

    wrapper.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    return wrapper


def size_option(value: Optional[str], param_hint: Optional[str] = None) -> Optional[int]:
    """Bytes of a size flag such as ``6GiB`` (None stays None); raises typer.BadParameter, naming
    ``param_hint`` (the flag) when given."""
    if value is None:
        return None
    try:
        return parse_size(value)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint=param_hint) from None


def offload_options(model: str | None, flags: OffloadFlags, prompt_len: int, gen_len: int,
                    echo: Callable[[str], Any]) -> tuple[dict[str, Any], Any]:
    """``(keywords, prediction)``: the policy (flags over the saved one) and caps as ``LLM.load``
    keywords, empty when nothing asks for offloading; and the cost model's Prediction for it
    (None without a policy, or when it cannot be made), whose peak per tier is printed through
    ``echo`` with the policy before loading. A bad placement raises typer.BadParameter."""
    from localgen.cli.offload_plan import peak_lines, policy_from_options, predicted_for

    try:
        policy = policy_from_options(model, flags.percent, flags.gpu_batch_size, flags.num_gpu_batches,
                                     flags.compress_weight, flags.compress_cache, flags.cpu_cache_compute)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--percent") from None
    gpu_b, cpu_b = size_option(flags.gpu_memory), size_option(flags.cpu_memory)
    if policy is None:
        return {}, None
    pred = None
    try:
        pred = predicted_for(model, policy, prompt_len, gen_len, gpu_memory=gpu_b, cpu_memory=cpu_b,
                             offload_dir=flags.offload_dir)
        for line in peak_lines(policy, pred, prompt_len, gen_len):
            echo(line)
    except Exception as e:  # the prediction is advice; loading reports real problems
        echo(f"predicted peak memory unavailable: {e}")
    out: dict[str, Any] = {"policy": policy}
    for k, v in (("offload_dir", flags.offload_dir), ("gpu_memory", gpu_b), ("cpu_memory", cpu_b)):
        if v is not None:
            out[k] = v
    return out, pred
