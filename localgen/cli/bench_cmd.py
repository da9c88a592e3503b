"""`localgen bench …`: benchmarks that print localgen beside a peer measured in the same run."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from localgen.fileio import atomic_write_json

app = typer.Typer(help="Benchmarks: localgen beside its peers, measured in the same run.",
                  no_args_is_help=True)

PromptsOpt = typer.Option(..., "--prompts", exists=True, dir_okay=False,
                          help="JSONL with a 'prompt' per line (e.g. instructions.jsonl).")


@app.command("batch")
def batch(
    prompts: Path = PromptsOpt,
    limit: int = typer.Option(100, "--limit", min=1, help="Number of prompts."),
    max_tokens: int = typer.Option(128, "--max-tokens", min=1),
    model: Optional[str] = typer.Option(None, "--model", help="Model.", show_default="embedded"),
    peer: bool = typer.Option(True, "--peer/--no-peer", help="Also run transformers generate."),
    peer_batch_size: int = typer.Option(16, "--peer-batch-size", min=1),
    max_num_seqs: int = typer.Option(64, "--max-num-seqs", min=1),
    dtype: str = typer.Option("float32", "--dtype",
                              help="localgen's dtype: float32 (the peer's, identical outputs) or "
                                   "'default' (bf16 + int4 kernel for a Q4_1 GGUF)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write the result as JSON here."),
) -> None:
    """Throughput of batch generation vs transformers `generate` on the same prompts (CPU).

    Examples:

        localgen bench batch --prompts examples/prompts.jsonl --limit 100 --max-tokens 128
    """
    from localgen.bench import batch_bench

    res = batch_bench.run(model, prompts, limit, max_tokens, peer=peer,
                          peer_batch_size=peer_batch_size, max_num_seqs=max_num_seqs,
                          dtype=None if dtype == "default" else dtype,
                          log=lambda m: typer.echo(m, err=True))
    typer.echo(f"model {res.model}: {res.num_prompts} prompts, max_tokens {res.max_tokens}, "
               f"{res.threads} threads")
    typer.echo(f"localgen      {res.localgen.tokens_per_s:8.1f} tokens/s "
               f"({res.localgen.generated_tokens} tokens, {res.localgen.seconds:.1f} s)")
    if res.transformers:
        t = res.transformers
        typer.echo(f"transformers  {t.tokens_per_s:8.1f} tokens/s ({t.generated_tokens} tokens, "
                   f"{t.seconds:.1f} s)")
        typer.echo(f"ratio         {res.ratio:8.2f}x   identical greedy outputs: "
                   f"{res.identical_outputs}/{res.num_prompts}")
    if out:
        atomic_write_json(out, res.to_json())


@app.command("soak")
def soak(
    prompts: Path = PromptsOpt,
    requests: int = typer.Option(1000, "--requests", min=1, help="Number of requests."),
    max_tokens: int = typer.Option(16, "--max-tokens", min=1),
    fraction: float = typer.Option(0.1, "--fraction", min=0.001, max=1.0,
                                   help="KV budget as a share of what the running batch needs."),
    max_num_seqs: int = typer.Option(64, "--max-num-seqs", min=1),
    model: Optional[str] = typer.Option(None, "--model", help="Model.", show_default="embedded"),
    out: Optional[Path] = typer.Option(None, "--out", help="Write the result as JSON here."),
) -> None:
    """Preemption under memory pressure: the same greedy requests with an ample KV cache and with
    a fraction of it; every output must match. Exit status 1 when any differs.

    Examples:

        localgen bench soak --prompts examples/prompts.jsonl --requests 1000 --fraction 0.1
    """
    from localgen.bench import soak as soak_bench

    res = soak_bench.run(model, prompts, requests, max_tokens, max_num_seqs, fraction,
                         log=lambda m: typer.echo(m, err=True))
    for name, r in (("unconstrained", res.unconstrained), ("constrained", res.constrained)):
        typer.echo(f"{name:14s} KV {r.kv_cache_bytes / 2**20:7.1f} MiB ({r.kv_blocks} blocks): "
                   f"{r.seconds:7.1f} s, {r.steps} steps, {r.preemptions} preemptions, "
                   f"{r.generated_tokens} tokens")
    typer.echo(f"identical greedy outputs: {res.identical_outputs}/{res.num_requests}")
    if out:
        atomic_write_json(out, res.to_json())
    raise typer.Exit(0 if res.identical_outputs == res.num_requests else 1)


@app.command("kernels")
def kernels(
    out: Path = typer.Option(..., "--out", help="Write the JSON results here."),
    batches: str = typer.Option("1,8,32,128", help="Comma list of batch sizes."),
    contexts: str = typer.Option("512,4096,32768", help="Comma list of context lengths."),
    repeat: int = typer.Option(30, help="Timed repeats per cell (median)."),
    phi: float = typer.Option(0.0, help="Unified max of the async softmax variant."),
    no_ref: bool = typer.Option(False, "--no-ref", help="Skip the pure-torch paged reference."),
    no_int4: bool = typer.Option(False, "--no-int4", help="Skip the 4-bit KV kernel."),
    flush: str = typer.Option("read", help="L2 flush before each timed call: read (clean lines) "
                              "or write (dirty lines written back inside the timed call)."),
    block_size: int = typer.Option(16, help="Tokens per KV block (the runtime's is 16)."),
    dtype: str = typer.Option("bfloat16", help="bfloat16 or float16."),
) -> None:
    """Decode attention on CUDA: Triton kernels (sync, async, int4) vs SDPA (enable_gqa) on a
    contiguous cache vs the paged reference, with the HBM copy bandwidth, in one run. The same
    benchmark runs without typer as ``python -m localgen.bench.kernels_bench --out X.json``.

    Examples:

        localgen bench kernels --out kernels.json
    """
    from localgen.bench import kernels_bench

    argv = ["--out", str(out), "--batches", batches, "--contexts", contexts,
            "--repeat", str(repeat), "--phi", str(phi), "--flush", flush,
            "--block-size", str(block_size), "--dtype", dtype]
    argv += ["--no-ref"] if no_ref else []
    argv += ["--no-int4"] if no_int4 else []
    kernels_bench.main(argv)


@app.command("offload")
def offload(
    policy: list[str] = typer.Option(..., "--policy", help="gbs,ngb,wg,wc,cg,cc,hg,hc[,w4][,kv4][,cpuattn] (percent); repeat for several."),
    preset: str = typer.Option("llama-2-7b", "--preset", help="Model shape (dummy weights)."),
    prompt_len: int = typer.Option(512, "--prompt-len", min=1),
    gen_len: int = typer.Option(32, "--gen-len", min=2),
    gpu_memory: str = typer.Option("6GiB", "--gpu-memory"),
    peer_batches: str = typer.Option("1,8", "--peer-batches", help="accelerate batch sizes ('' = none)."),
    profile: Optional[str] = typer.Option(None, "--profile", help="HardwareProfile for the predictions."),
    device: str = typer.Option("cuda", "--device"),
    repeats: int = typer.Option(1, "--repeats", min=1, help="Generations per policy; the median is reported."),
    isolate: Optional[bool] = typer.Option(None, "--isolate/--no-isolate",
                                           help="Each policy and peer batch in its own process.", show_default="on CUDA"),
    prefill_graphs: bool = typer.Option(True, "--prefill-graphs/--no-prefill-graphs",
                                        help="Replay all-GPU 4-bit prefill zig-zag blocks as CUDA graphs."),
    out: Optional[Path] = typer.Option(None, "--out"),
) -> None:
    """Measured vs predicted prefill/decode (ctog/gtoc/dtoc/ctod/compute) under policies, beside accelerate.

    Examples:

        localgen bench offload --out offload.json
    """
    from localgen.bench import offload_bench

    args = sum((["--policy", p] for p in policy), []) + [
        "--preset", preset, "--prompt-len", str(prompt_len), "--gen-len", str(gen_len),
        "--gpu-memory", gpu_memory, "--peer-batches", peer_batches, "--device", device,
        "--repeats", str(repeats)]
    args += (["--profile", profile] if profile else []) + (["--out", str(out)] if out else [])
    args += [] if isolate is None else ["--isolate" if isolate else "--no-isolate"]
    args += [] if prefill_graphs else ["--no-prefill-graphs"]
    raise typer.Exit(offload_bench.main(args))


@app.command("accuracy")
def accuracy(
    model: Optional[str] = typer.Option(None, "--model", help="Model.", show_default="embedded"),
    max_tokens: int = typer.Option(8192, "--max-tokens", min=2, help="WikiText-2 tokens scored."),
    window: int = typer.Option(512, "--window", min=2),
    max_examples: int = typer.Option(500, "--max-examples", min=1, help="LAMBADA examples."),
    configs: str = typer.Option("fp32,w4,kv4,w4+kv4", "--configs",
                                help="Rows, the first the baseline: fp32, w4, kv4, w4+kv4, kv4-plain, "
                                     "kv4-norot, kv4-norecent, w4g64, w4g64+kv4."),
    device: str = typer.Option("cpu", "--device"),
    check: bool = typer.Option(False, "--check", help="Exit 1 when a compressed row misses a target."),
    out: Optional[Path] = typer.Option(None, "--out"),
) -> None:
    """WikiText-2 perplexity and LAMBADA accuracy: uncompressed vs 4-bit weights and/or 4-bit KV
    (targets: +3% perplexity, 1 point of LAMBADA).

    Examples:

        localgen bench accuracy --out accuracy.json
    """
    from localgen.bench import accuracy as acc

    args = ["--max-tokens", str(max_tokens), "--window", str(window), "--max-examples", str(max_examples),
            "--configs", configs, "--device", device] + (["--check"] if check else []) \
        + (["--model", model] if model else []) + (["--out", str(out)] if out else [])
    raise typer.Exit(acc.main(args))


@app.command("decode")
def decode(
    model: str = typer.Option("llama-2-7b", "--model",
                              help="A preset shape (dummy weights), 'embedded', or a model path."),
    batches: str = typer.Option("1,16,64", "--batches", help="Comma-separated batch sizes."),
    prompt_len: int = typer.Option(128, "--prompt-len", min=1),
    gen_len: int = typer.Option(128, "--gen-len", min=1),
    dtype: str = typer.Option("bf16", "--dtype", help="bf16, fp16 or fp32."),
    device: Optional[str] = typer.Option(None, "--device"),
    peer: bool = typer.Option(True, "--peer/--no-peer",
                              help="Also run transformers generate (llama.cpp runs whenever its tools are found)."),
    repeat: int = typer.Option(1, "--repeat", min=1,
                               help="Measured runs per engine and batch size (medians)."),
    threads: Optional[int] = typer.Option(None, "--threads", min=1,
                                          help="CPU threads for torch and llama.cpp."),
    llama_cpp_bin: Optional[str] = typer.Option(
        None, "--llama-cpp-bin", help="Folder of llama.cpp's llama-bench and llama-batched-bench.",
        show_default="$LLAMA_CPP_BIN, then PATH"),
    out: Optional[Path] = typer.Option(None, "--out", help="Write the results as JSON here."),
    prefill_graphs: bool = typer.Option(True, "--prefill-graphs/--no-prefill-graphs",
                                        help="On CUDA, replay one prompt's prefill as a CUDA graph."),
) -> None:
    """Decode throughput and latency vs transformers `generate`, llama.cpp's own tools on the same
    GGUF (CPU or GPU, when found) and the HBM roofline; resident weight bytes of each. The same benchmark runs without typer as
    ``python -m localgen.bench.decode_bench``.

    Examples:

        localgen bench decode --model embedded --device cpu --batches 1,16 --prompt-len 511 --gen-len 64 --repeat 3
    """
    import torch

    from localgen.bench import decode_bench

    if threads:
        torch.set_num_threads(threads)
    res = decode_bench.bench(model, [int(b) for b in batches.split(",")], prompt_len, gen_len,
                             device=device, dtype=dtype, with_hf=peer, repeat=repeat,
                             log=lambda m: typer.echo(m), llama_cpp_bin=llama_cpp_bin,
                             prefill_graphs=prefill_graphs)
    if out:
        atomic_write_json(out, res)


@app.command("perplexity")
def perplexity(
    model: Optional[str] = typer.Option(None, "--model", help="A GGUF file.", show_default="embedded"),
    ctx: int = typer.Option(512, "--ctx", min=16, help="Tokens per window (llama-perplexity's -c)."),
    chunks: int = typer.Option(40, "--chunks", min=1, help="Windows scored (llama-perplexity's --chunks)."),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="CPU threads for both."),
    llama_cpp_bin: Optional[str] = typer.Option(
        None, "--llama-cpp-bin", help="Folder of llama.cpp's llama-perplexity.",
        show_default="$LLAMA_CPP_BIN, then PATH"),
    out: Optional[Path] = typer.Option(None, "--out", help="Write the result as JSON here."),
) -> None:
    """WikiText-2 perplexity of a GGUF by localgen and by llama.cpp's llama-perplexity on the same
    file and windows (each window's second half scored, as llama-perplexity does).

    Examples:

        localgen bench perplexity --model model.Q4_K_M.gguf --chunks 40 --llama-cpp-bin ~/llama.cpp/build/bin
    """
    import torch

    from localgen.bench import perplexity_bench

    if threads:
        torch.set_num_threads(threads)
    res = perplexity_bench.run(model, ctx=ctx, chunks=chunks, threads=threads,
                               llama_cpp_bin=llama_cpp_bin, log=lambda m: typer.echo(m))
    if out:
        atomic_write_json(out, res)


@app.command("startup")
def startup(
    model: Optional[str] = typer.Option(None, "--model", help="Model; llama-simple runs only on a GGUF file.", show_default="embedded"),
    prompt: str = typer.Option("hi", "--prompt", help="The prompt both sides answer with one token."),
    repeat: int = typer.Option(3, "--repeat", min=1, help="Warm runs of each side (medians are reported)."),
    chat: bool = typer.Option(True, "--chat/--no-chat", help="Also time `localgen chat` until its model is ready (on a pseudo-terminal)."),
    llama_cpp_bin: Optional[str] = typer.Option(None, "--llama-cpp-bin", help="llama.cpp's llama-simple, or its folder.", show_default="$LLAMA_CPP_BIN, then PATH"),
    bytecode: bool = typer.Option(True, "--bytecode/--no-bytecode", help="Byte-compile localgen's modules first, as installing a wheel does (without it, PYTHONDONTWRITEBYTECODE makes every start compile them)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write the result as JSON here."),
) -> None:
    """Time from the command to the first token of `localgen generate --max-tokens 1`, and its peak RSS, beside llama.cpp's llama-simple on the same GGUF; `localgen chat` until ready.

    Examples:

        localgen bench startup --llama-cpp-bin ~/llama.cpp/build/bin

        LLAMA_CPP_BIN=~/llama.cpp/build/bin localgen bench startup --repeat 5 --out startup.json
    """
    from localgen.bench import startup_bench

    gguf = _peer_gguf(model)
    res = startup_bench.run(model, gguf, prompt, repeat, llama_cpp_bin, chat=chat, bytecode=bytecode,
                            log=lambda m: typer.echo(m, err=True))
    _print_and_save(startup_bench.report(res), res, out)


@app.command("serve")
def serve(
    model: Optional[str] = typer.Option(None, "--model", help="Model; llama-server runs only on a GGUF file.", show_default="embedded"),
    concurrency: str = typer.Option("1,4,16,64", "--concurrency", help="Concurrency levels, comma-separated."),
    prompt_words: int = typer.Option(128, "--prompt-words", min=1, help="Words in each prompt (the report gives its tokens)."),
    max_tokens: int = typer.Option(64, "--max-tokens", min=2, help="Output tokens of each request (ignore_eos)."),
    requests: Optional[int] = typer.Option(None, "--requests", min=1, help="Requests per level.", show_default="2 x C, at least 8"),
    llama_server: Optional[str] = typer.Option(None, "--llama-server", help="llama.cpp's llama-server, or its folder.", show_default="$LLAMA_CPP_BIN, then PATH"),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="localgen serve's --dtype (e.g. float32: the CPU block path).", show_default="serve's default"),
    peer_ctx: Optional[int] = typer.Option(None, "--peer-ctx", min=16, help="llama-server's context per slot, in tokens (a tokenizer that splits words finely needs more).", show_default="2 x words + max tokens + 64"),
    out: Optional[Path] = typer.Option(None, "--out", help="Write the result as JSON here."),
    prefill_graphs: bool = typer.Option(True, "--prefill-graphs/--no-prefill-graphs", help="localgen serve's --prefill-graphs."),
) -> None:
    """`localgen serve` under C concurrent streaming clients (TTFT and inter-token latency p50/p99, output tokens/s) beside llama.cpp's llama-server (--parallel C) on the same GGUF.

    Examples:

        localgen bench serve --llama-server /tmp/llama/llama.cpp/build/bin/llama-server

        LLAMA_CPP_BIN=~/llama.cpp/build/bin localgen bench serve --concurrency 1,16 --out serve.json
    """
    from localgen.bench import serve_bench

    try:
        levels = tuple(int(c) for c in concurrency.split(","))
        if not levels or min(levels) < 1:
            raise ValueError
    except ValueError:
        typer.echo(f"error: --concurrency {concurrency!r}: give positive integers, e.g. 1,4,16,64", err=True)
        raise typer.Exit(2)
    gguf = _peer_gguf(model)
    res = serve_bench.run(model, gguf, levels=levels, prompt_words=prompt_words,
                          max_tokens=max_tokens, requests_per_level=requests,
                          llama_server=llama_server, log=lambda m: typer.echo(m, err=True),
                          dtype=dtype, peer_ctx=peer_ctx, prefill_graphs=prefill_graphs)
    _print_and_save(serve_bench.report(res), res, out)


@app.command("structured")
def structured(
    model: Optional[str] = typer.Option(None, "--model", help="Model.", show_default="embedded"),
    concurrency: int = typer.Option(16, "--concurrency", min=1, help="Requests in one batch."),
    max_tokens: int = typer.Option(64, "--max-tokens", min=1),
    out: Optional[Path] = typer.Option(None, "--out", help="Write the result as JSON here."),
) -> None:
    """What a json_schema response_format costs: the same prompts free and constrained, each as
    one continuous batch, output tokens/s and their ratio; the grammar's compile time.

    Examples:

        localgen bench structured --concurrency 16 --max-tokens 64
    """
    from localgen.bench import structured_bench

    log = lambda m: typer.echo(m, err=True)  # noqa: E731
    res = structured_bench.run(structured_bench.load(model, concurrency, log), concurrency,
                               max_tokens, log=log)
    _print_and_save([structured_bench.report(res)], res, out)


def _peer_gguf(model: str | None) -> Path | None:
    """The GGUF file llama.cpp's tools run beside localgen: the embedded model's with no
    ``--model``, MODEL when it names an existing ``.gguf`` file, else None (no peer)."""
    from localgen.models.sources import embedded_gguf_path

    if model is None:
        return embedded_gguf_path()
    path = Path(model).expanduser()
    return path if model.endswith(".gguf") and path.is_file() else None


def _print_and_save(lines, res, out: Optional[Path]) -> None:
    """Print a bench's report lines to stdout and, with ``--out``, write ``res.to_json()`` there
    whole (``atomic_write_json``)."""
    for line in lines:
        typer.echo(line)
    if out:
        atomic_write_json(out, res.to_json())
