"""The routes of `localgen serve`: OpenAI's /v1/models, /v1/chat/completions and /v1/completions
(streamed as server-sent events through sse-starlette, or whole), /health and /metrics.

Every generation route reads its body under a size limit, validates it (400 with OpenAI's error
object on any fault), admits its choices to the bounded queue (429 when full) and then follows
the engine's streams. A client that goes away has its requests aborted, which frees their KV
blocks at once (``Engine.abort``); nothing one request does reaches the others in the batch.
"""

from __future__ import annotations

import hmac
import json
from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from sse_starlette.sse import EventSourceResponse

from localgen import __version__
from localgen.runtime.request import RequestOutput
from localgen.server.errors import APIError, from_validation_error, install_error_handlers
from localgen.server.generation import ClientGone, Generator, Prepared, ServerConfig
from localgen.server.metrics import CONTENT_TYPE
from localgen.server.protocol import ChatCompletionRequest, CompletionRequest
from localgen.server.responses import (ResponseShape, TokenText, chat_logprobs,
                                       completion_logprobs, finish_reason, usage)
from localgen.server.tools import may_become_call, parse_tool_calls
from localgen.service import EngineService, RequestStream

CLIENT_CLOSED = 499  # nginx's status for a request whose client went away: nobody reads it


def create_app(service: EngineService, config: ServerConfig) -> FastAPI:
    """The ASGI app serving ``service`` (started and ready) under ``config``."""
    app = FastAPI(title="localgen", docs_url=None, redoc_url=None, openapi_url=None)
    gen = Generator(service, config)
    app.state.generator = gen
    install_error_handlers(app)
    api = APIRouter(dependencies=[Depends(_auth(config))])
    text = TokenText(gen.tokenizer)

    @app.get("/health")
    async def health():
        ok = service.state == "ready"
        return JSONResponse({"status": "ok" if ok else service.state, "version": __version__},
                            status_code=200 if ok else 503)

    @api.get("/metrics")
    async def metrics():
        return Response(gen.metrics.render(), media_type=CONTENT_TYPE)

    @api.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [_model_card(n) for n in config.model_names]}

    @api.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        gen.check_model(model_id)
        return _model_card(model_id)

    async def generate(request: Request, schema: type, prepare) -> Response:
        body = await _read(request, schema, config.max_body_bytes)
        prep = await prepare(body)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await _respond(request, gen, prep, body.stream, include_usage, body.model, text)

    @api.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, ChatCompletionRequest, gen.prepare_chat)

    @api.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, CompletionRequest, gen.prepare_completion)

    app.include_router(api)
    return app


def _model_card(name: str) -> dict[str, Any]:
    # localgen_version: an extension field (OpenAI's model object has no version of the server)
    return {"id": name, "object": "model", "created": 0, "owned_by": "localgen",
            "localgen_version": __version__}


def _auth(config: ServerConfig):
    key = config.api_key.encode() if config.api_key else None

    async def check(request: Request) -> None:
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key):
            raise APIError(401, "a valid API key is required (header 'Authorization: Bearer KEY')",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    return check


async def _read(request: Request, model: type[BaseModel], limit: int) -> Any:
    """The body, at most ``limit`` bytes (413 beyond), validated as ``model`` (400 on a fault)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body of {declared} bytes is over the limit of {limit}",
                       code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body is over the limit of {limit} bytes",
                           code="request_too_large")
        chunks.append(chunk)
    try:
        return model.model_validate_json(b"".join(chunks))
    except ValidationError as e:
        raise from_validation_error(e) from None


async def _respond(request: Request, gen: Generator, prep: Prepared, stream: bool,
                   include_usage: bool, model: str, text: TokenText):
    streams = gen.submit(prep)
    shape = ResponseShape(prep.kind, prep.response_id, model, prep.warnings)
    endpoint = prep.kind
    if stream:
        async def events() -> AsyncIterator[str]:
            outcome = "client_gone"
            try:
                async for ev in _events(gen, prep, streams, shape, include_usage, text):
                    yield ev
                outcome = "ok"
            finally:
                gen.release(streams)  # aborts what is unfinished when the client went away
                gen.metrics.requests.labels(endpoint, outcome).inc()

        return EventSourceResponse(events(), sep="\n")
    try:
        finals = await gen.final_outputs(streams, request.is_disconnected, prep.arrived)
    except ClientGone:
        gen.metrics.requests.labels(endpoint, "client_gone").inc()
        return Response(status_code=CLIENT_CLOSED)
    finally:
        gen.release(streams)
    gen.metrics.requests.labels(endpoint, "ok").inc()
    choices = [_choice(shape, prep, i, out, text) for i, out in enumerate(finals)]
    return shape.full(choices, _usage(prep, finals))


def _usage(prep: Prepared, finals: list[RequestOutput]) -> dict[str, Any]:
    # a prompt's n choices share it: its tokens count once (OpenAI's usage)
    cached = sum(o.cached_prompt_tokens for i, o in enumerate(finals) if i % prep.n == 0)
    return usage(prep.prompt_tokens, sum(o.completion_tokens for o in finals), cached)


def _tool_result(prep: Prepared, text: str) -> tuple[str | None, list[dict] | None]:
    """``(content, tool_calls)`` of a finished chat answer."""
    if prep.tool_mode == "none":
        return text, None
    # "forced" decoding followed the call's schema, so the text is one {"name", "arguments"}
    # object, which the parser reads as a Llama-style JSON call
    content, calls = parse_tool_calls(text, prep.tools)
    return content, [c.to_openai() for c in calls] or None


def _choice(shape: ResponseShape, prep: Prepared, i: int, out: RequestOutput,
            text: TokenText) -> dict[str, Any]:
    reason = finish_reason(out)
    if prep.kind == "completion":
        lp = completion_logprobs(out.logprobs, text) if out.logprobs is not None else None
        return shape.completion_choice(i, out.text, reason, lp)
    content, calls = _tool_result(prep, out.text)
    lp = chat_logprobs(out.logprobs, text) if out.logprobs is not None else None
    return shape.chat_choice(i, content, "tool_calls" if calls else reason, lp, calls)


class _ChoiceState:
    """What a streamed choice has sent: logprobs, text characters, and whether its text is
    held back as a possible tool call."""

    def __init__(self, hold: bool):
        self.sent_logprobs = 0
        self.sent_chars = 0
        self.hold = hold


async def _events(gen: Generator, prep: Prepared, streams: list[RequestStream],
                  shape: ResponseShape, include_usage: bool, text: TokenText) -> AsyncIterator[str]:
    chat = prep.kind == "chat"
    states = [_ChoiceState(prep.tool_mode != "none") for _ in streams]
    finals: list[Any] = [None] * len(streams)

    def chunk(choice: dict[str, Any]) -> str:
        return json.dumps(shape.chunk([choice], None, include_usage))

    if chat:
        for i in range(len(streams)):
            yield chunk(shape.chat_delta(i, {"role": "assistant", "content": ""}))
    try:
        async for i, out in gen.outputs(streams, prep.arrived):
            st = states[i]
            if st.hold and prep.tool_mode == "auto" and not may_become_call(out.text):
                st.hold = False  # plain text after all: send what was held, then stream on
            if out.finished:
                finals[i] = out
            if not st.hold:
                piece = out.text[st.sent_chars:]
                if piece or out.logprobs and len(out.logprobs) > st.sent_logprobs:
                    yield chunk(_delta(shape, chat, i, piece, out, st, text))
            elif out.finished:
                content, calls = _tool_result(prep, out.text)
                if calls:
                    delta = {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]}
                    yield chunk(shape.chat_delta(i, delta))
                    yield chunk(shape.chat_delta(i, {}, "tool_calls"))
                    continue
                yield chunk(_delta(shape, chat, i, out.text, out, st, text))
            if out.finished:
                reason = finish_reason(out)
                yield chunk(shape.chat_delta(i, {}, reason) if chat
                            else shape.completion_choice(i, "", reason, None))
    except APIError as e:
        yield json.dumps(e.body())
        yield "[DONE]"
        return
    if include_usage:
        yield json.dumps(shape.chunk([], _usage(prep, finals), True))
    yield "[DONE]"


def _delta(shape: ResponseShape, chat: bool, i: int, piece: str, out: RequestOutput,
           st: _ChoiceState, text: TokenText) -> dict[str, Any]:
    lps = out.logprobs[st.sent_logprobs:] if out.logprobs is not None else None
    offset = st.sent_chars
    st.sent_chars = len(out.text)
    st.sent_logprobs += len(lps or ())
    if chat:
        return shape.chat_delta(i, {"content": piece}, None,
                                chat_logprobs(lps, text) if lps is not None else None)
    return shape.completion_choice(i, piece, None,
                                   completion_logprobs(lps, text, offset) if lps is not None else None)
