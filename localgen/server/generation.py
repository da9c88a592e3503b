"""From a validated OpenAI request to engine requests and back: tokenizing, limits, admission.

:class:`Generator` owns what every route shares: the :class:`~localgen.service.EngineService`
(one engine thread, continuous batching), a lock around the tokenizer (fast tokenizers are not
safe to call from several threads at once), the bounded count of requests in flight, and the
metrics. A request's ``n`` choices are ``n`` engine requests at ``Priority.INTERACTIVE``.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from localgen.runtime.request import (KVBudgetError, Priority, PromptTooLongError, Request,
                                      RequestOutput, SamplingParams)
from localgen.server.errors import APIError
from localgen.server.metrics import ServerMetrics, TokenTimer
from localgen.server.protocol import (MAX_STOP, ChatCompletionRequest, CompletionRequest,
                                      sampling_params)
from localgen.server.tools import render_messages, tool_call_schema
from localgen.service import EngineService, RequestStream, ServedLLM, ServiceClosed


@dataclass
class ServerConfig:
    """``model_names``: names ``model`` may take (the first is listed by /v1/models);
    ``api_key``: the Bearer token every route but /health needs (None: none);
    ``max_body_bytes``: largest request body; ``max_pending``: engine requests in flight at once
    (running or waiting) before new ones get 429; ``retry_after_s``: the 429's Retry-After."""

    model_names: tuple[str, ...]
    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    max_pending: int = 256
    retry_after_s: int = 1


@dataclass
class Prepared:
    """One request ready to submit: ``prompts[i]`` and ``sampling[i]`` for choice ``i``."""

    kind: str  # "chat" | "completion"
    response_id: str
    prompts: list[list[int]]
    sampling: list[SamplingParams]
    prompt_tokens: int  # distinct prompts' tokens (a prompt shared by n choices counts once)
    warnings: list[str] = field(default_factory=list)
    n: int = 1  # choices per prompt
    tool_mode: str = "none"  # "none" | "auto" | "forced"
    # perf_counter when the HTTP request arrived: TTFT counts tokenizing and queueing too
    arrived: float = field(default_factory=time.perf_counter)
    tools: list = field(default_factory=list)


class ClientGone(Exception):
    """The client closed the connection before its answer was complete."""


class Generator:
    def __init__(self, service: EngineService, config: ServerConfig):
        self.service, self.config = service, config
        self.metrics = ServerMetrics(service, lambda: self.in_flight)
        self.in_flight = 0
        self._tok_lock = threading.Lock()

    @property
    def llm(self) -> ServedLLM:
        """The service's model, for its constant properties (tokenizer, limits)."""
        llm = self.service.llm
        if llm is None:
            raise RuntimeError(f"the engine service is {self.service.state}: no model to serve")
        return llm

    @property
    def tokenizer(self):
        return self.llm.tokenizer

    @property
    def token_limit(self) -> int:
        return self.llm.token_limit

    # -- preparing ------------------------------------------------------------------------
    def check_model(self, name: str) -> None:
        if name not in self.config.model_names:
            raise APIError(404, f"the model '{name}' does not exist; this server serves "
                                f"{', '.join(repr(n) for n in self.config.model_names)}",
                           param="model", code="model_not_found")

    async def prepare_chat(self, body: ChatCompletionRequest) -> Prepared:
        arrived = time.perf_counter()
        self.check_model(body.model)
        self._check_room(body.n)  # before tokenizing: a full server refuses cheaply
        mode, tools, rf = _tool_mode(body)
        try:
            ids = await asyncio.to_thread(self._encode_chat, body, tools if mode != "none" else None)
        except PromptTooLongError as e:
            raise APIError(400, str(e), param="messages", code="context_length_exceeded") from None
        except Exception as e:  # jinja's TemplateError and others: the template refused them
            raise APIError(400, f"the chat template cannot render these messages: {e}",
                           param="messages", code="invalid_messages") from None
        prep = Prepared("chat", f"chatcmpl-{uuid.uuid4().hex}", [], [], len(ids), tool_mode=mode,
                        tools=tools or [], arrived=arrived)
        await self._fill(prep, body, [ids], "messages", rf)
        return prep

    async def prepare_completion(self, body: CompletionRequest) -> Prepared:
        arrived = time.perf_counter()
        self.check_model(body.model)
        self._check_room(body.n)
        if body.echo or body.suffix:
            raise APIError(400, "'echo' and 'suffix' are not supported",
                           param="echo" if body.echo else "suffix", code="unsupported_parameter")
        try:
            prompts = await asyncio.to_thread(self._encode_prompts, body.prompts())
        except PromptTooLongError as e:
            raise APIError(400, str(e), param="prompt", code="context_length_exceeded") from None
        if any(not p for p in prompts):
            raise APIError(400, "the prompt is empty", param="prompt", code="invalid_value")
        vocab = len(self.tokenizer)
        if any(not 0 <= t < vocab for p in prompts for t in p):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt",
                           code="invalid_value")
        prep = Prepared("completion", f"cmpl-{uuid.uuid4().hex}", [], [], sum(map(len, prompts)),
                        arrived=arrived)
        await self._fill(prep, body, prompts, "prompt", None)
        return prep

    def _encode_chat(self, body: ChatCompletionRequest, tools) -> list[int]:
        with self._tok_lock:
            text = render_messages(self.tokenizer, body.messages, tools)
            self._check_bytes(text)
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _encode_prompts(self, prompts: list[str | list[int]]) -> list[list[int]]:
        out = []
        with self._tok_lock:
            for p in prompts:
                if isinstance(p, str):
                    self._check_bytes(p)
                    p = list(self.tokenizer(p)["input_ids"])
                out.append(p)
        return out

    def _check_bytes(self, text: str) -> None:
        """A prompt longer than any tokenization could fit is refused before tokenizing."""
        cap = self.llm.max_prompt_bytes
        if len(text.encode("utf-8", "surrogatepass")) > cap:
            raise PromptTooLongError(f"the prompt's text cannot fit the context of "
                                     f"{self.token_limit} tokens")

    async def _fill(self, prep: Prepared, body, prompts: list[list[int]], where: str,
                    rf: dict | None) -> None:
        """Limits and sampling settings of each choice (``n`` per prompt)."""
        limit, requested = self.token_limit, body.requested_max_tokens()
        stop = body.stop_list()
        if len(stop) > MAX_STOP:
            raise APIError(400, f"'stop' takes at most {MAX_STOP} sequences, got {len(stop)}",
                           param="stop", code="invalid_value")
        prep.n = body.n
        default = 16 if prep.kind == "completion" else None  # OpenAI's legacy default
        for ids in prompts:
            room = limit - len(ids)
            if room < 1:
                raise APIError(400, f"this model's context holds {limit} tokens; the prompt has "
                                    f"{len(ids)}, leaving no room for an answer",
                               param=where, code="context_length_exceeded")
            want = requested if requested is not None else default
            if want is not None and want > room:
                prep.warnings.append(f"max_tokens {want} capped to {room}: the prompt's {len(ids)} "
                                     f"tokens leave {room} of the {limit}-token context")
            for j in range(body.n):
                prep.prompts.append(ids)
                prep.sampling.append(sampling_params(body, min(want or room, room), seed_offset=j,
                                                     response_format=rf))
        try:
            await asyncio.to_thread(prep.sampling[0].validate)  # compiles a schema: off the loop
        except ValueError as e:
            param = re.match(r"[a-z_]+", str(e))
            raise APIError(400, str(e), param=param.group(0) if param else None,
                           code="invalid_value") from None

    # -- admission and submission ------------------------------------------------------------
    def submit(self, prep: Prepared) -> list[RequestStream]:
        """Queue the choices (all or none); 429 when the bounded queue has no room for them."""
        n = len(prep.prompts)
        self._check_room(n)
        self.in_flight += n
        return [self.service.submit(Request(prompt_token_ids=ids, sampling=sp,
                                            priority=Priority.INTERACTIVE,
                                            request_id=f"{prep.response_id}-{i}"))
                for i, (ids, sp) in enumerate(zip(prep.prompts, prep.sampling))]

    def _check_room(self, n: int) -> None:
        if self.service.state != "ready":
            raise APIError(503, f"the engine is {self.service.state}", code="engine_unavailable")
        if self.in_flight + n > self.config.max_pending:
            raise APIError(429, f"the server has {self.in_flight} requests in flight (at most "
                                f"{self.config.max_pending}); retry after "
                                f"{self.config.retry_after_s} s", code="rate_limit_exceeded",
                           headers={"Retry-After": str(self.config.retry_after_s)})

    def release(self, streams: list[RequestStream]) -> None:
        """Abort what has not finished (a client gone, an error) and free the queue slots."""
        for s in streams:
            if not s.done:
                s.abort()
        self.in_flight -= len(streams)

    async def outputs(self, streams: list[RequestStream], arrived: float | None = None
                      ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """``(choice index, output)`` as each choice advances; raises an engine error as a
        400/503 APIError."""
        q: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, s: RequestStream) -> None:
            timer = TokenTimer(self.metrics, arrived if arrived is not None else s.submitted_at)
            try:
                async for out in s:
                    timer.update(out.completion_tokens)
                    q.put_nowait((i, out))
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                q.put_nowait((i, e))
            q.put_nowait((i, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        left = len(tasks)
        try:
            while left:
                i, item = await q.get()
                if item is None:
                    left -= 1
                elif isinstance(item, BaseException):
                    raise engine_error(item)
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()

    async def final_outputs(self, streams: list[RequestStream], is_disconnected,
                            arrived: float | None = None) -> list[RequestOutput]:
        """Every choice's final output; ClientGone as soon as ``is_disconnected()`` says so
        (polled while waiting, since nothing else tells a non-streaming handler)."""
        finals: list[Any] = [None] * len(streams)

        async def collect() -> None:
            async for i, out in self.outputs(streams, arrived):
                if out.finished:
                    finals[i] = out

        task = asyncio.create_task(collect())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.2)
                if done:
                    task.result()
                    return finals
                if await is_disconnected():
                    raise ClientGone()
        finally:
            if not task.done():
                task.cancel()


def engine_error(e: BaseException) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, (PromptTooLongError, KVBudgetError)):
        return APIError(400, str(e), code="context_length_exceeded")
    if isinstance(e, ServiceClosed):
        return APIError(503, str(e), code="engine_unavailable")
    if isinstance(e, ValueError):
        return APIError(400, str(e), code="invalid_value")
    return APIError(500, f"the engine failed: {type(e).__name__}: {e}", type="server_error")


def _tool_mode(body: ChatCompletionRequest) -> tuple[str, list | None, dict | None]:
    """``(mode, tools, response_format)`` from ``tools`` / ``tool_choice``: "none" (tools not
    shown), "auto" (the model may call; its text is parsed), "forced" ("required" or a named
    function: decoding is constrained to one call's JSON)."""
    tools, choice = body.tools or None, body.tool_choice
    if choice not in (None, "none") and not tools:
        raise APIError(400, "'tool_choice' needs 'tools' to choose from", param="tool_choice",
                       code="invalid_value")
    if not tools or choice == "none":
        return "none", None, None
    if choice is None or choice == "auto":
        return "auto", tools, None
    if not isinstance(choice, str) and choice.function.name not in {t.function.name for t in tools}:
        raise APIError(400, f"'tool_choice' names '{choice.function.name}', which is not in 'tools'",
                       param="tool_choice.function.name", code="invalid_value")
    if body.response_format is not None:
        raise APIError(400, "'response_format' cannot be combined with a forced 'tool_choice'",
                       param="response_format", code="invalid_value")
    return "forced", tools, tool_call_schema(tools, choice)
