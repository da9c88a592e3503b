"""`localgen chat`: the interactive Textual chat app (conversation, memory and throughput panels).

Heavy imports (torch, textual, the engine) happen inside the function so `localgen --help` stays
fast. The model loads on the engine thread while the app is already on screen; a model that
cannot load is explained in the conversation view.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from localgen.cli import batch_cmd
from localgen.cli.offload_flags import OffloadFlags, size_option, with_offload_flags
from localgen.fileio import check_writable_dir

CHAT_PROMPT_TOKENS = 512  # the conversation length the printed memory prediction assumes


@with_offload_flags
def chat(
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Model: local HF dir, hub id or GGUF path.", show_default="the embedded SmolLM2-135M-Instruct"),
    system: Optional[str] = typer.Option(None, "--system", "-s", help="System prompt for the conversation (F2 edits it in the app)."),
    kv_cache_memory: Optional[str] = typer.Option(None, "--kv-cache-memory", help="KV cache size, e.g. 512MiB, 2GiB."),
    temperature: Optional[float] = typer.Option(None, "--temperature", "-t", help="Sampling temperature (0 = greedy; F3 edits).", show_default="0.7"),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", "-n", help="Most tokens per answer.", show_default="512"),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed for reproducible sampling."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Compute dtype, e.g. float32, bfloat16."),
    device: Optional[str] = typer.Option(None, "--device", help="cpu, cuda, cuda:1 ...", show_default="best available"),
    profile: Optional[str] = typer.Option(None, "--profile", help="Hardware profile whose memory bandwidth the throughput panel shows as the limit.", show_default="the saved one, if any"),
    offload: OffloadFlags = OffloadFlags(),
    resume: bool = typer.Option(False, "--resume", "-r", help="Reopen the most recent saved chat (--chat ID picks another)."),
    chat_id: Optional[str] = typer.Option(None, "--chat", help="Reopen the saved chat ID (`localgen chat --list` shows the ids)."),
    list_chats: bool = typer.Option(False, "--list", help="List the saved chats (id, last change, messages, title) and exit."),
) -> None:
    """Chat with a model in the terminal: streamed Markdown answers, live memory and throughput.

    Conversations are saved after every answer in localgen's data folder ($LOCALGEN_CHATS_DIR
    overrides it); F7 lists them (open, rename, delete) and --resume reopens the latest.

    Keys: F1 help (every key) · Enter send · Ctrl+J new line · Esc stop the answer · Ctrl+N new
    chat · F2 system prompt · F3 sampling · F4 export (.md + .json) · F5 batch jobs · F6 copy ·
    F7 saved chats · PageUp/PageDown scroll · Ctrl+Q quit.

    Examples:

        localgen chat

        localgen chat --model ~/models/qwen2.5-0.5b-instruct-q4_k_m.gguf --system "Answer in French."

        localgen chat --resume
    """
    from localgen.tui.history import ChatNotFoundError, ChatStore

    store = ChatStore()
    if list_chats:
        _print_chats(store)
        return
    resumed = None
    if resume or chat_id:
        try:
            cid = chat_id or store.latest()
            resumed = (cid, *store.load(cid))
        except (ChatNotFoundError, ValueError) as e:
            raise typer.BadParameter(str(e), param_hint="--chat" if chat_id else "--resume") from None
    kv_bytes = size_option(kv_cache_memory, "--kv-cache-memory")

    # F4 offers the current folder for transcripts: say now that it cannot be used there, but
    # chat anyway (the save dialog takes any other path)
    try:
        check_writable_dir(Path.cwd())
    except OSError as e:
        typer.echo(f"warning: {e.strerror or e}; F4 needs another folder to save transcripts",
                   err=True)

    from dataclasses import replace

    from localgen.conversation import Conversation
    from localgen.runtime.request import SamplingParams

    conv = resumed[1] if resumed else Conversation()
    if system is not None or not resumed:
        conv.system = system or ""
    given = {"temperature": temperature, "max_tokens": max_tokens, "seed": seed}
    try:
        conv.sampling = replace(conv.sampling, **{k: v for k, v in given.items() if v is not None}).validate()
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    assert isinstance(conv.sampling, SamplingParams)

    # the saved policy (`localgen tune`) or the flags over it: printed with its predicted peak
    # per tier before the app opens; the memory panel shows that peak beside what is measured
    load_kw, pred = batch_cmd.offload_options(model, offload, CHAT_PROMPT_TOKENS,
                                              conv.sampling.max_tokens, typer.echo)
    from localgen.models.sources import fetch_model

    # a hub model is downloaded here, where its progress shows, not behind the app; a missing
    # one is reported by the CLI's error handler (localgen/cli/errors.py), Ollama hint included
    fetch_model(model)
    service = make_service(model, kv_cache_memory=kv_bytes, dtype=dtype, device=device, profile=profile,
                           offload=load_kw, predicted_peak=pred.peak_mem if pred is not None else None)
    from localgen.tui.chat import ChatApp

    label = model or "SmolLM2-135M-Instruct (embedded)"
    ChatApp(service, conv, model_label=label, store=store, chat_id=resumed[0] if resumed else None).run()
    if service.state == "failed" and service.error is not None:
        typer.echo(f"error: could not load the model: {service.error}", err=True)
        raise typer.Exit(1)


def make_service(model: str | None, *, kv_cache_memory: int | None = None, dtype: str | None = None,
                 device: str | None = None, profile: str | None = None, offload: dict | None = None,
                 predicted_peak: dict | None = None):
    """An unstarted EngineService whose thread loads ``model`` (tests replace this); ``offload``:
    ``LLM.load``'s policy keywords (``offload_flags.offload_options``)."""
    from localgen.service import EngineService

    hw = None
    try:
        from localgen.profiler import load_profile

        hw = load_profile(profile)
    except Exception:  # noqa: BLE001 - no saved profile: the panel says so
        if profile is not None:
            raise typer.BadParameter(f"no hardware profile {profile!r}", param_hint="--profile") from None

    def load():
        from localgen.cli.startup_gc import collector_paused

        with collector_paused():  # the imports and the load leave almost no garbage to look for
            from localgen.api import LLM

            # a conversation's turns prefill only their new tokens (prefix reuse): the CPU int4
            # path's bf16 prefill copies would cost memory and load time for little (LLM.load)
            return LLM.load(model, kv_cache_memory=kv_cache_memory, dtype=dtype, device=device,
                            cpu_int4=False, **(offload or {}))

    return EngineService(load, hardware=hw, predicted_peak=predicted_peak)


def _print_chats(store) -> None:
    """The saved chats on stdout, newest first (where they are on stderr)."""
    import time

    entries = store.list()
    typer.echo(f"{len(entries)} saved chat{'s' if len(entries) != 1 else ''} in {store.root}", err=True)
    for e in entries:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(e.updated))
        typer.echo(f"{e.id}  {when}  {e.turns:3d} msgs  {e.title}")
