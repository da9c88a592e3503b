"""OpenAI response objects built from engine outputs: completions, chunks, usage, logprobs.

Shapes: https://platform.openai.com/docs/api-reference/chat/object (``chat.completion``),
``chat.completion.chunk`` for streams, and the legacy ``text_completion`` with its logprobs
object (tokens, token_logprobs, top_logprobs, text_offset).
"""

from __future__ import annotations

import time
from typing import Any

from localgen.runtime.request import RequestOutput, TokenLogprob


class TokenText:
    """Token ids as the text each one decodes to, cached (for logprobs)."""

    def __init__(self, tokenizer):
        self._tok, self._cache = tokenizer, {}

    def __call__(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            s = self._cache[token_id] = self._tok.decode([token_id])
        return s


def _entry(text: TokenText, token_id: int, logprob: float) -> dict[str, Any]:
    s = text(token_id)
    return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}


def chat_logprobs(lps: list[TokenLogprob], text: TokenText) -> dict[str, Any]:
    """The chat ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    return {"content": [{**_entry(text, lp.token_id, lp.logprob),
                         "top_logprobs": [_entry(text, t, v) for t, v in lp.top]} for lp in lps]}


def completion_logprobs(lps: list[TokenLogprob], text: TokenText, offset: int = 0) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object; ``offset``: characters of text before these."""
    tokens = [text(lp.token_id) for lp in lps]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{text(t): v for t, v in lp.top} for lp in lps],
            "text_offset": offsets}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def finish_reason(out: RequestOutput) -> str | None:
    # an engine abort (client gone, server closing) has no OpenAI name; "stop" is the nearest
    return "stop" if out.finish_reason == "abort" else out.finish_reason


class ResponseShape:
    """Common fields of one response: its id, creation time, model and kind."""

    def __init__(self, kind: str, response_id: str, model: str, warnings: list[str]):
        self.kind, self.id, self.model, self.warnings = kind, response_id, model, warnings
        self.created = int(time.time())

    @property
    def obj(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"

    def _head(self, obj: str) -> dict[str, Any]:
        head = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None}
        if self.warnings:
            head["warnings"] = list(self.warnings)
        return head

    def full(self, choices: list[dict[str, Any]], usage_obj: dict[str, Any]) -> dict[str, Any]:
        return {**self._head(self.obj), "choices": choices, "usage": usage_obj}

    def chunk(self, choices: list[dict[str, Any]], usage_obj: dict[str, Any] | None = None,
              include_usage: bool = False) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        out = {**self._head(obj), "choices": choices}
        if include_usage:
            out["usage"] = usage_obj
        return out

    def chat_choice(self, index: int, content: str | None, reason: str | None,
                    logprobs: dict | None, tool_calls: list[dict] | None = None) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if tool_calls:
            msg["tool_calls"] = tool_calls
        return {"index": index, "message": msg, "logprobs": logprobs, "finish_reason": reason}

    @staticmethod
    def completion_choice(index: int, text: str, reason: str | None,
                          logprobs: dict | None) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}

    @staticmethod
    def chat_delta(index: int, delta: dict[str, Any], reason: str | None = None,
                   logprobs: dict | None = None) -> dict[str, Any]:
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
