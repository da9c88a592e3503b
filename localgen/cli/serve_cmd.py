"""`localgen serve`: the OpenAI-compatible HTTP server (localgen.server) on uvicorn.

The bind is checked before the model loads: an address other than loopback needs an API key
(``--api-key`` or ``LOCALGEN_API_KEY``) or an explicit ``--no-auth``.
"""

from __future__ import annotations

import ipaddress
import sys
from typing import List, Optional

import typer

from localgen.cli.units import parse_size


def check_bind(host: str, api_key: str | None, no_auth: bool) -> None:
    """Raises ValueError when ``host`` is reachable from other machines and neither a key nor
    ``no_auth`` was given."""
    if api_key and no_auth:
        raise ValueError("--api-key and --no-auth contradict each other; give one")
    if is_loopback(host) or api_key or no_auth:
        return
    raise ValueError(f"--host {host} accepts connections from other machines: give --api-key KEY "
                     f"(or set LOCALGEN_API_KEY) so clients must send 'Authorization: Bearer KEY', "
                     f"or --no-auth to serve without one")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve anywhere


def serve(
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Model: local HF dir, hub id or GGUF path.", show_default="the embedded SmolLM2-135M-Instruct"),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind; other than loopback needs --api-key or --no-auth."),
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="TCP port (0: any free one)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="LOCALGEN_API_KEY", help="Clients must send 'Authorization: Bearer KEY' (env LOCALGEN_API_KEY)."),
    no_auth: bool = typer.Option(False, "--no-auth", help="Serve a non-loopback --host without an API key."),
    served_model_name: Optional[List[str]] = typer.Option(None, "--served-model-name", help="Name(s) clients use as 'model' (repeat for aliases).", show_default="the model's name"),
    max_num_seqs: int = typer.Option(64, "--max-num-seqs", min=1, help="Requests in the running batch at once."),
    max_pending: int = typer.Option(256, "--max-pending", min=1, help="Requests admitted (running or waiting) before new ones get 429."),
    max_body: str = typer.Option("4MiB", "--max-body", help="Largest request body, e.g. 4MiB (413 beyond)."),
    kv_cache_memory: Optional[str] = typer.Option(None, "--kv-cache-memory", help="KV cache size, e.g. 512MiB, 2GiB.", show_default="sized from free memory"),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len", min=2, help="Cap the context (tokens)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Compute dtype, e.g. float32, bfloat16."),
    device: Optional[str] = typer.Option(None, "--device", help="cpu, cuda, cuda:1 ...", show_default="best available"),
    log_level: str = typer.Option("info", "--log-level", help="uvicorn's log level."),
    prefill_graphs: bool = typer.Option(True, "--prefill-graphs/--no-prefill-graphs",
                                        help="On CUDA, replay a lone prompt's prefill as a CUDA graph."),
) -> None:
    """Serve the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models), /health and
    /metrics, all requests sharing one engine through the continuous batch.

    Examples:

        localgen serve

        localgen serve --model ~/models/qwen2.5-0.5b-instruct-q4_k_m.gguf --port 8000 --api-key "$KEY"
    """
    try:
        check_bind(host, api_key, no_auth)
        body_limit = parse_size(max_body)
        kv = parse_size(kv_cache_memory) if kv_cache_memory else None
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    import uvicorn

    from localgen.api import LLM
    from localgen.server.app import create_app
    from localgen.server.generation import ServerConfig
    from localgen.service import EngineService

    typer.echo(f"loading {model or 'the embedded model'} ...", err=True)
    def load() -> LLM:
        llm = LLM.load(model, kv_cache_memory=kv, max_num_seqs=max_num_seqs,
                       max_model_len=max_model_len, dtype=dtype, device=device,
                       prefill_copies=dtype is None, prefill_graphs=prefill_graphs)
        # every batch size's decode graph and every prompt length's prefill graph before the
        # first request, not inside the steps of the requests that first reach them
        llm.warm_graphs()
        return llm

    service = EngineService(load).start()
    try:
        service.wait_ready()
    except Exception as e:  # noqa: BLE001 - the load error, shown as such
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1)
    names = tuple(served_model_name or ()) or (service.llm.model_name,)
    config = ServerConfig(model_names=names, api_key=api_key, max_body_bytes=body_limit,
                          max_pending=max_pending)
    typer.echo(f"serving {names[0]} at http://{host}:{port}/v1"
               f"{' (API key required)' if api_key else ''}", err=True)
    try:
        uvicorn.run(create_app(service, config), host=host, port=port, log_level=log_level)
    finally:
        service.close()
    sys.stdout.flush()
