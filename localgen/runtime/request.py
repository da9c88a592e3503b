"""Requests in and streamed outputs out: the types the API, CLI and TUI exchange with the engine."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

from localgen.runtime.structured import check_response_format

_ids = itertools.count()


class Priority(enum.IntEnum):
    """Lower runs first: chat answers are scheduled before background batch work (FineInfer §3.3)."""

    INTERACTIVE = 0
    BATCH = 1


class PromptTooLongError(ValueError):
    """The prompt (plus room for one generated token) does not fit the model's context."""


class KVBudgetError(ValueError):
    """The prompt fits the model's context but not the KV cache budget, even with the whole cache
    to itself. ``needed_bytes``: the KV cache size that would hold it (whole blocks);
    ``budget_bytes``: the cache's size now."""

    def __init__(self, message: str, needed_bytes: int, budget_bytes: int):
        super().__init__(message)
        self.needed_bytes, self.budget_bytes = needed_bytes, budget_bytes


@dataclass
class SamplingParams:
    """Per-request decoding settings (OpenAI / vLLM semantics).

    temperature 0 means greedy. top_k 0 and top_p 1 and min_p 0 mean off. ``seed`` makes the
    request's samples reproducible whatever else shares its batch. ``stop`` strings end the text
    (the stop string itself is not returned) even when they span token boundaries.
    ``response_format`` (OpenAI's shape) constrains the output to JSON or a JSON schema.
    Raises ValueError from ``validate`` naming the field that is out of range (for
    ``response_format``: the bad part, or the reason the grammar engine cannot compile a schema).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # OpenAI's penalties (in [-2, 2]): subtracted from the logit of each token already in the
    # output, frequency_penalty once per occurrence, presence_penalty once per distinct token
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # log-probabilities of each sampled token and of this many most likely alternatives (0..20),
    # from the model's distribution before any penalty or filter; None: not computed
    logprobs: int | None = None
    # OpenAI's response_format: {"type": "text" | "json_object" | "json_schema", ...}; see
    # localgen.runtime.structured for the shapes and how decoding is constrained.
    response_format: dict | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        else:
            self.stop = tuple(self.stop or ())

    def validate(self) -> "SamplingParams":
        checks = [
            ("temperature", 0.0 <= self.temperature <= 100.0, "must be in [0, 100]"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k >= 0, "must be >= 0 (0 = off)"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("repetition_penalty", self.repetition_penalty > 0.0, "must be > 0"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20,
             "must be None or in [0, 20]"),
            ("max_tokens", self.max_tokens >= 1, "must be >= 1"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r} {why}")
        if self.response_format is not None:
            check_response_format(self.response_format)
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Request:
    """One generation request: exactly one of ``prompt``, ``messages`` or ``prompt_token_ids``.

    ``messages`` are chat messages (``[{"role", "content"}]``) rendered with the model's own
    chat template; ``prompt`` is raw text tokenized as is.
    """

    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    prompt_token_ids: list[int] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: Priority = Priority.BATCH
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")


@dataclass
class RequestOutput:
    """An update for one request, produced by each engine step that advanced it.

    ``text_delta`` is the newly settled text (text that might still turn into a stop string is
    held back); ``text`` is everything settled so far. ``finish_reason``: "stop" (EOS or a stop
    string), "length" (max_tokens or context full), "abort", or None while running.
    """

    request_id: str
    text_delta: str
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0
    # one TokenLogprob per output token so far (aligned with token_ids) when the request's
    # sampling asked for logprobs; None otherwise
    logprobs: list["TokenLogprob"] | None = None


@dataclass(frozen=True)
class TokenLogprob:
    """The natural-log probability of one sampled token under the model's distribution (before
    penalties, temperature and filters), and the ``top`` most likely tokens as
    ``(token_id, logprob)`` pairs, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
