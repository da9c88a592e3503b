"""`localgen generate "PROMPT"`: stream one answer to stdout, stats to stderr.

Heavy imports (torch, the engine) happen inside functions so `localgen --help` stays fast.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, List, Optional

import typer

from localgen.cli import batch_cmd
from localgen.cli.offload_flags import OffloadFlags, size_option, with_offload_flags


def load_llm(
    model: str | None,
    *,
    kv_cache_memory: int | None = None,
    dtype: str | None = None,
    device: str | None = None,
    **offload: Any,
) -> Any:
    """Load the engine (tests replace this function with a fake); ``offload`` as in batch_cmd."""
    from localgen.cli.startup_gc import collector_paused
    from localgen.cli.status import announce, stderr_status

    from localgen.models.sources import resolve_model

    with collector_paused():  # the imports and the load leave almost no garbage to look for
        # a missing or mistyped model fails here, before the runtime (torch) is imported
        source = resolve_model(model) if model is not None else None
        announce()
        from localgen.api import LLM

        n = offload["policy"].bls if offload.get("policy") is not None else 1
        # one prompt does not repay the CPU int4 path's bf16 prefill copies (LLM.load's cpu_int4)
        return LLM.load(source, kv_cache_memory=kv_cache_memory, max_num_seqs=n, dtype=dtype,
                        device=device, cpu_int4=False, progress=stderr_status(), **offload)


@with_offload_flags
def generate(
    prompt: Optional[str] = typer.Argument(None, help="The prompt; omit it or give - to read it from stdin."),
    system: Optional[str] = typer.Option(None, "--system", "-s", help="System message (chat template only)."),
    raw: bool = typer.Option(False, "--raw", help="Send the prompt as is, without the model's chat template."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Model: local HF dir, hub id or GGUF path.", show_default="the embedded SmolLM2-135M-Instruct"),
    temperature: Optional[float] = typer.Option(None, "--temperature", "-t", help="0 = greedy.", show_default="0.7, as the chat app"),
    top_p: Optional[float] = typer.Option(None, "--top-p", help="Nucleus sampling, in (0, 1] (1 = off)."),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="Keep the k most likely tokens (0 = off)."),
    min_p: Optional[float] = typer.Option(None, "--min-p", help="Drop tokens below min_p × the top probability (0 = off)."),
    repetition_penalty: Optional[float] = typer.Option(None, "--repetition-penalty", help="> 1 discourages repeats (1 = off)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed for reproducible sampling."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", "-n", help="Most tokens to generate.", show_default="256"),
    stop: Optional[List[str]] = typer.Option(None, "--stop", help="Stop string (repeat for several); not printed."),
    json_schema: Optional[str] = typer.Option(None, "--json-schema", help="A JSON Schema file: the answer is JSON that follows it (constrained decoding).", metavar="FILE"),
    json_object: bool = typer.Option(False, "--json", help="The answer is a JSON object (any keys)."),
    kv_cache_memory: Optional[str] = typer.Option(None, "--kv-cache-memory", help="KV cache size, e.g. 512MiB, 2GiB.", show_default="sized from free memory"),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Compute dtype, e.g. float32, bfloat16."),
    device: Optional[str] = typer.Option(None, "--device", help="cpu, cuda, cuda:1 ...", show_default="best available"),
    offload: OffloadFlags = OffloadFlags(),
) -> None:
    """Generate an answer to PROMPT (or stdin), streaming it to stdout.

    The prompt goes through the model's chat template as a user turn (after --system, if given) unless --raw. A one-line summary (tokens, tokens/s, time to first token) goes to stderr.

    Examples:

        localgen generate "Name three uses of a paperclip." --temperature 0 --max-tokens 64

        cat notes.txt | localgen generate --system "Summarize in one line." --model ~/models/qwen2.5-0.5b-instruct-q4_k_m.gguf

        localgen generate "Two colors as JSON." --json-schema colors.schema.json
    """
    from localgen.runtime.request import Priority, Request, SamplingParams

    if prompt is None or prompt == "-":
        if prompt is None and sys.stdin.isatty():
            raise typer.BadParameter("give a PROMPT, or pipe one on stdin", param_hint="PROMPT")
        prompt = sys.stdin.read()
        if not raw:  # the newline `echo` or a file ends with is not part of a chat question
            prompt = prompt.rstrip("\r\n")
    if not prompt.strip():
        raise typer.BadParameter("the prompt is empty", param_hint="PROMPT")
    if raw and system is not None:
        raise typer.BadParameter("--system needs the chat template; drop --raw", param_hint="--system")
    kv_bytes = size_option(kv_cache_memory, "--kv-cache-memory")

    given = {
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "min_p": min_p,
        "repetition_penalty": repetition_penalty,
        "seed": seed,
        "max_tokens": max_tokens,
        "stop": tuple(stop) if stop else None,
    }
    if json_schema is not None or json_object:
        given["response_format"] = _response_format(json_schema, json_object)
    # the chat app's defaults: temperature 1.0 (the API's, OpenAI's) makes small models ramble
    given = {"temperature": 0.7, "top_p": 0.95} | {k: v for k, v in given.items() if v is not None}
    try:
        sampling = SamplingParams(**given).validate()
    except ValueError as e:
        name = str(e).split("=", 1)[0]
        raise typer.BadParameter(str(e), param_hint="--" + name.replace("_", "-")) from None

    if raw:
        req = Request(prompt=prompt, sampling=sampling, priority=Priority.INTERACTIVE)
    else:
        messages = ([{"role": "system", "content": system}] if system is not None else []) + [
            {"role": "user", "content": prompt}
        ]
        req = Request(messages=messages, sampling=sampling, priority=Priority.INTERACTIVE)
    req.request_id = f"generate-{req.request_id}"

    load_kw, _ = batch_cmd.offload_options(model, offload, 512, max_tokens or 256,
                                           lambda m: typer.echo(m, err=True))
    with batch_cmd.SigtermAsInterrupt() as term:  # `kill` stops it like Ctrl-C (exit 143, not 130)
        try:
            llm = load_llm(model, kv_cache_memory=kv_bytes, dtype=dtype, device=device, **load_kw)
        except KeyboardInterrupt:
            typer.echo("interrupted", err=True)
            raise typer.Exit(term.exit_status) from None
        _stream(llm, req, term)


def _response_format(schema_path: str | None, json_object: bool) -> dict:
    """OpenAI's response_format for --json-schema FILE or --json; a file that cannot be read,
    is not JSON or is not a schema the grammar engine compiles exits with one line naming it."""
    from pathlib import Path

    from localgen.runtime.structured import check_response_format

    if schema_path is None:
        return {"type": "json_object"}
    if json_object:
        raise typer.BadParameter("give --json-schema FILE or --json, not both", param_hint="--json")

    def fail(why: str) -> typer.Exit:
        typer.echo(f"error: --json-schema {schema_path}: {why}", err=True)
        return typer.Exit(2)

    path = Path(schema_path)
    try:
        schema = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise fail(f"cannot read it ({e.strerror or e})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        where = f" (line {e.lineno}, column {e.colno})" if isinstance(e, json.JSONDecodeError) else ""
        raise fail(f"not valid JSON{where}: {getattr(e, 'msg', e)}") from None
    name = "".join(c if c.isalnum() or c in "_-" else "_" for c in path.stem)[:64] or "schema"
    rf = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
    try:
        check_response_format(rf)
    except ValueError as e:
        raise fail(f"not a usable JSON Schema: {str(e).split(': ', 1)[-1]}") from None
    return rf


def _stream(llm: Any, req: Any, term: "batch_cmd.SigtermAsInterrupt") -> None:
    """Generate ``req`` on ``llm``, streaming the text to stdout and the stats line to stderr;
    exits with status 1 for a prompt the engine refuses, ``term.exit_status`` when interrupted."""
    from localgen.runtime.request import PromptTooLongError

    t0 = time.perf_counter()
    try:
        llm.add_request(req)
    except PromptTooLongError as e:
        typer.echo(f"error: prompt too long for the model's context ({llm.max_model_len} tokens): {e}",
                   err=True)
        raise typer.Exit(1)
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1)

    out_stream = sys.stdout
    t_first: float | None = None
    last = None
    wrote_any = False
    try:
        while True:
            outputs = llm.step()
            for out in outputs:
                if out.request_id != req.request_id:
                    continue
                last = out
                if t_first is None and out.completion_tokens > 0:
                    t_first = time.perf_counter()
                if out.text_delta:
                    out_stream.write(out.text_delta)
                    out_stream.flush()
                    wrote_any = True
            if last is not None and last.finished:
                break
            if not outputs and not llm.has_unfinished():
                raise RuntimeError("the engine finished without a final output for the request")
    except KeyboardInterrupt:
        try:
            llm.abort(req.request_id)
        except Exception:
            pass
        out_stream.write("\n")
        out_stream.flush()
        typer.echo("interrupted", err=True)
        raise typer.Exit(term.exit_status)
    t_end = time.perf_counter()
    if wrote_any:
        out_stream.write("\n")
        out_stream.flush()
    typer.echo(_stats_line(last, t0, t_first, t_end), err=True)


def _stats_line(out: Any, t0: float, t_first: float | None, t_end: float) -> str:
    n = out.completion_tokens if out is not None else 0
    total = t_end - t0
    parts = [f"{n} tokens in {total:.2f} s"]
    if n > 1 and t_first is not None and t_end > t_first:
        parts.append(f"{(n - 1) / (t_end - t_first):.1f} tokens/s")  # decode rate after the first token
    elif n and total > 0:
        parts.append(f"{n / total:.1f} tokens/s")
    if t_first is not None:
        parts.append(f"time to first token {t_first - t0:.2f} s")
    if out is not None:
        parts.append(f"prompt {out.prompt_tokens} tokens")
        if out.cached_prompt_tokens:
            parts.append(f"{out.cached_prompt_tokens} cached")
        parts.append(f"finish {out.finish_reason}")
    return " · ".join(parts)
