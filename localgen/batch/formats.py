"""The two line formats `localgen batch` reads and writes.

Native input line::

    {"id": "q1", "prompt": "Why is the sky blue?", "max_tokens": 64, "temperature": 0}
    {"id": "q2", "messages": [{"role": "user", "content": "Hi"}], "stop": ["\\n\\n"], "seed": 7}

``id`` (string or integer, unique in the file), exactly one of ``prompt`` (non-empty string) or
``messages`` (chat messages), and optional sampling fields ``temperature, top_p, top_k, min_p,
repetition_penalty, seed, max_tokens, stop`` (string or list of strings), ``ignore_eos``,
``response_format`` (as OpenAI's, below) and ``priority`` ("batch" or "interactive"). Other fields are ignored (data sets carry metadata).
A native ``prompt`` is sent through the model's chat template as one user turn unless the run is
``raw`` (see :meth:`Job.to_request`).

OpenAI Batch API request line (https://platform.openai.com/docs/api-reference/batch)::

    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "x", "messages": [...], "max_completion_tokens": 64, "temperature": 0}}

``url`` is ``/v1/chat/completions`` (``body.messages``) or ``/v1/completions`` (``body.prompt``:
a string, a list of one string, or a list of token ids; always sent as is). Body fields read:
``max_tokens, max_completion_tokens, temperature, top_p, seed, stop, n`` (must be 1),
``response_format`` (``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema":
{"name", "schema"}}``: the answer is constrained to that JSON, see runtime/structured.py) and the
common extensions ``top_k, min_p, repetition_penalty``; all other body fields (``model``,
``stream``, ``logprobs`` ...) are ignored. ``model`` is ignored: the loaded model answers.

Output records (one JSON object per line):

- native success: ``{"id", "text", "finish_reason", "usage": {...}, "model"}``
- OpenAI success: ``{"id": "batch_req_…", "custom_id", "response": {"status_code": 200,
  "request_id", "body": <chat.completion | text_completion>}, "error": null}``
- native error: ``{"id": <id or null>, "line": N, "error": "<field>: <problem>"}``
- OpenAI error: ``{"id": "batch_req_…", "custom_id": <id or null>, "response": null,
  "error": {"code": "invalid_request", "message": "line N: <field>: <problem>"}}``
- the error of a line repeating an earlier line's id has ``"id": null`` (native) or
  ``"custom_id": null`` (OpenAI) and the repeated id in ``"duplicate_of"``, so it is never
  taken for the first line's result.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

from localgen.runtime.request import Priority, Request, RequestOutput, SamplingParams

NATIVE = "native"
OPENAI = "openai"

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"

# (field, kind) for sampling values accepted on a native line; kind is checked before
# SamplingParams.validate() checks the range.
_NATIVE_SAMPLING = {
    "temperature": "number",
    "top_p": "number",
    "top_k": "int",
    "min_p": "number",
    "repetition_penalty": "number",
    "seed": "int",
    "max_tokens": "int",
    "stop": "stop",
    "ignore_eos": "bool",
    "response_format": "object",
}
# OpenAI body field -> (SamplingParams field, kind)
_OPENAI_SAMPLING = {
    "temperature": ("temperature", "number"),
    "top_p": ("top_p", "number"),
    "seed": ("seed", "int"),
    "stop": ("stop", "stop"),
    "max_tokens": ("max_tokens", "int"),
    "max_completion_tokens": ("max_tokens", "int"),  # wins over max_tokens (newer name)
    # common non-OpenAI extensions (vLLM accepts them too)
    "top_k": ("top_k", "int"),
    "min_p": ("min_p", "number"),
    "repetition_penalty": ("repetition_penalty", "number"),
    "response_format": ("response_format", "object"),
}
_ROLES = {"system", "user", "assistant", "tool", "developer"}


class LineError(ValueError):
    """A bad input line: ``line_no`` (1-based, as in the file) and a message naming the field.

    ``key`` is the line's id/custom_id when it could be read (else None) and ``format`` the
    format the line looked like (decides the shape of its error record). ``duplicate_of``: the
    id an earlier line already used, for a repeated id (then ``key`` is None: the id is the
    earlier line's).
    """

    def __init__(self, line_no: int, message: str, *, key: Any = None, format: str = NATIVE,
                 duplicate_of: Any = None):
        super().__init__(f"line {line_no}: {message}")
        self.line_no = line_no
        self.message = message
        self.key = key
        self.format = format
        self.duplicate_of = duplicate_of

    def record(self) -> dict[str, Any]:
        """The error record written to OUT for this line."""
        if self.format == OPENAI:
            rec: dict[str, Any] = {
                "id": f"batch_req_{uuid.uuid4().hex}",
                "custom_id": self.key,
                "response": None,
                "error": {"code": "invalid_request", "message": f"line {self.line_no}: {self.message}"},
            }
        else:
            rec = {"id": self.key, "line": self.line_no, "error": self.message}
        if self.duplicate_of is not None:
            rec["duplicate_of"] = self.duplicate_of
        return rec


@dataclass
class Job:
    """One valid input line, not yet tokenized.

    ``sampling`` holds only the sampling fields the line set itself (already type- and
    range-checked); run-wide defaults fill the rest in :meth:`to_request`.
    """

    line_no: int
    format: str  # NATIVE or OPENAI
    key: Any  # native id (str or int) or OpenAI custom_id (str)
    url: str | None = None  # OpenAI only
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    prompt_token_ids: list[int] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    priority: Priority = Priority.BATCH

    @property
    def done_key(self) -> tuple[str, Any]:
        """Identity used for resume and duplicate checks: ('native', id) or ('openai', custom_id)."""
        return (self.format, self.key)

    def to_request(
        self,
        request_id: str,
        *,
        defaults: dict[str, Any] | None = None,
        max_tokens_cap: int | None = None,
        raw_prompts: bool = False,
    ) -> Request:
        """Build the engine request.

        Sampling: the line's own fields, else ``defaults`` (run-wide, e.g. from CLI flags), else
        SamplingParams' defaults; ``max_tokens_cap`` (``--max-tokens``) caps max_tokens for every
        line, and is the default for lines that do not set it. A native ``prompt`` is sent as one
        user chat turn (chat template) unless ``raw_prompts``; OpenAI ``/v1/completions`` prompts
        are always sent as is.
        """
        values = dict(defaults or {})
        values.update(self.sampling)
        if max_tokens_cap is not None:
            values["max_tokens"] = min(values.get("max_tokens", max_tokens_cap), max_tokens_cap)
        sp = SamplingParams(**values).validate()
        prompt, messages = self.prompt, self.messages
        if self.format == NATIVE and prompt is not None and not raw_prompts:
            prompt, messages = None, [{"role": "user", "content": prompt}]
        return Request(
            prompt=prompt,
            messages=messages,
            prompt_token_ids=self.prompt_token_ids,
            sampling=sp,
            priority=self.priority,
            request_id=request_id,
        )

    def result_record(self, out: RequestOutput, model: str, created: int | None = None) -> dict[str, Any]:
        """The success record for this job's finished output."""
        usage = {
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": out.completion_tokens,
            "total_tokens": out.prompt_tokens + out.completion_tokens,
        }
        if self.format == NATIVE:
            return {
                "id": self.key,
                "text": out.text,
                "finish_reason": out.finish_reason,
                "usage": usage,
                "model": model,
            }
        created = int(time.time()) if created is None else created
        if self.url == CHAT_URL:
            body = {
                "id": f"chatcmpl-{uuid.uuid4().hex}",
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": out.text},
                        "logprobs": None,
                        "finish_reason": out.finish_reason,
                    }
                ],
                "usage": usage,
            }
        else:
            body = {
                "id": f"cmpl-{uuid.uuid4().hex}",
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [
                    {"index": 0, "text": out.text, "logprobs": None, "finish_reason": out.finish_reason}
                ],
                "usage": usage,
            }
        return {
            "id": f"batch_req_{uuid.uuid4().hex}",
            "custom_id": self.key,
            "response": {"status_code": 200, "request_id": uuid.uuid4().hex, "body": body},
            "error": None,
        }


# --------------------------------------------------------------------------------------------
# parsing


def _type_ok(value: Any, kind: str) -> bool:
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "object":
        return isinstance(value, dict)
    if kind == "stop":
        return isinstance(value, str) or (
            isinstance(value, list) and all(isinstance(s, str) for s in value)
        )
    raise AssertionError(kind)


_KIND_WORDS = {
    "number": "a number",
    "int": "an integer",
    "bool": "true or false",
    "stop": "a string or a list of strings",
    "object": "an object",
}


def _check_sampling(values: dict[str, Any], where: str) -> None:
    """Range-check with SamplingParams.validate(); raise ValueError naming the field."""
    try:
        SamplingParams(**values).validate()
    except ValueError as e:
        raise ValueError(f"{where}{e}") from None


def _read_messages(value: Any, fname: str) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise ValueError(f"{fname}: must be a list of {{role, content}} objects, got {_tname(value)}")
    if not value:
        raise ValueError(f"{fname}: must not be empty")
    out = []
    for i, m in enumerate(value):
        where = f"{fname}[{i}]"
        if not isinstance(m, dict):
            raise ValueError(f"{where}: must be an object with role and content, got {_tname(m)}")
        role = m.get("role")
        if not isinstance(role, str):
            raise ValueError(f"{where}.role: missing or not a string")
        if role not in _ROLES:
            raise ValueError(f"{where}.role: {role!r} is not one of {sorted(_ROLES)}")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: only text is supported
            texts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise ValueError(f"{where}.content[{j}]: only {{\"type\": \"text\", \"text\": ...}} parts are supported")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise ValueError(f"{where}.content: missing or not a string")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def _typed_field(obj: dict, name: str, kind: str, where: str) -> Any:
    """``obj[name]``, or None when absent; ValueError naming ``where + name`` when its JSON type
    is not ``kind`` (a key of ``_KIND_WORDS``)."""
    v = obj.get(name)
    if v is not None and not _type_ok(v, kind):
        raise ValueError(f"{where}{name}: must be {_KIND_WORDS[kind]}, got {_tname(v)} {json.dumps(v)}")
    return v


def _tname(v: Any) -> str:
    return {
        dict: "an object",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        type(None): "null",
    }.get(type(v), type(v).__name__)


def _looks_openai(obj: dict[str, Any]) -> bool:
    return any(k in obj for k in ("custom_id", "body", "url", "method"))


def parse_line(text: str, line_no: int) -> Job:
    """Parse and validate one non-blank input line; raise :class:`LineError` if it is bad."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise LineError(line_no, f"broken JSON: {e.msg} at column {e.colno}") from None
    if not isinstance(obj, dict):
        raise LineError(line_no, f"a line must be a JSON object, got {_tname(obj)}")
    if _looks_openai(obj):
        return _parse_openai(obj, line_no)
    return _parse_native(obj, line_no)


def _parse_native(obj: dict[str, Any], line_no: int) -> Job:
    key = obj.get("id")
    key_ok = (isinstance(key, str) and key != "") or (isinstance(key, int) and not isinstance(key, bool))

    def err(msg: str) -> LineError:
        return LineError(line_no, msg, key=key if key_ok else None, format=NATIVE)

    if "id" not in obj or key is None:
        raise err("id: missing (every line needs a unique \"id\", or use the OpenAI batch format)")
    if not key_ok:
        raise err(f"id: must be a non-empty string or an integer, got {_tname(key)}")
    has_prompt, has_messages = obj.get("prompt") is not None, obj.get("messages") is not None
    if has_prompt and has_messages:
        raise err("prompt and messages: give one of them, not both")
    if not has_prompt and not has_messages:
        raise err("prompt or messages: missing (give one of them)")
    job = Job(line_no=line_no, format=NATIVE, key=key)
    try:
        if has_prompt:
            p = obj["prompt"]
            if not isinstance(p, str):
                raise ValueError(f"prompt: must be a string, got {_tname(p)}")
            if not p.strip():
                raise ValueError("prompt: is empty")
            job.prompt = p
        else:
            job.messages = _read_messages(obj["messages"], "messages")
        for name, kind in _NATIVE_SAMPLING.items():
            v = _typed_field(obj, name, kind, "")
            if v is not None:
                job.sampling[name] = v
        _check_sampling(job.sampling, "")
        pr = obj.get("priority")
        if pr is not None:
            job.priority = _read_priority(pr)
    except ValueError as e:
        raise err(str(e)) from None
    return job


def _read_priority(pr: Any) -> Priority:
    if isinstance(pr, str) and pr.upper() in Priority.__members__:
        return Priority[pr.upper()]
    if isinstance(pr, int) and not isinstance(pr, bool) and pr in {p.value for p in Priority}:
        return Priority(pr)
    names = ", ".join(repr(p.name.lower()) for p in Priority)
    raise ValueError(f"priority: must be one of {names}, got {json.dumps(pr)}")


def _parse_openai(obj: dict[str, Any], line_no: int) -> Job:
    key = obj.get("custom_id")
    key_ok = isinstance(key, str) and key != ""

    def err(msg: str) -> LineError:
        return LineError(line_no, msg, key=key if key_ok else None, format=OPENAI)

    if key is None:
        raise err("custom_id: missing")
    if not key_ok:
        raise err(f"custom_id: must be a non-empty string, got {_tname(key)}")
    method = obj.get("method")
    if method is None:
        raise err("method: missing (must be \"POST\")")
    if method != "POST":
        raise err(f"method: must be \"POST\", got {json.dumps(method)}")
    url = obj.get("url")
    if url is None:
        raise err(f"url: missing (use {CHAT_URL!r} or {COMPLETIONS_URL!r})")
    if url not in (CHAT_URL, COMPLETIONS_URL):
        raise err(f"url: {json.dumps(url)} is not supported (use {CHAT_URL!r} or {COMPLETIONS_URL!r})")
    body = obj.get("body")
    if body is None:
        raise err("body: missing")
    if not isinstance(body, dict):
        raise err(f"body: must be an object, got {_tname(body)}")
    job = Job(line_no=line_no, format=OPENAI, key=key, url=url)
    try:
        if url == CHAT_URL:
            if body.get("messages") is None:
                raise ValueError("body.messages: missing (required for /v1/chat/completions)")
            job.messages = _read_messages(body["messages"], "body.messages")
        else:
            p = body.get("prompt")
            if p is None:
                raise ValueError("body.prompt: missing (required for /v1/completions)")
            if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                job.prompt_token_ids = list(p)
            else:
                if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
                    p = p[0]
                elif isinstance(p, list) and len(p) > 1 and all(isinstance(t, str) for t in p):
                    raise ValueError(f"body.prompt: holds {len(p)} prompts; give one prompt per line")
                if not isinstance(p, str):
                    raise ValueError(f"body.prompt: must be a string or a list of token ids, got {_tname(p)}")
                if not p.strip():
                    raise ValueError("body.prompt: is empty")
                job.prompt = p
        n = body.get("n")
        if n is not None and n != 1:
            raise ValueError(f"body.n: only n=1 is supported, got {json.dumps(n)}")
        names: dict[str, str] = {}
        for bname, (sname, kind) in _OPENAI_SAMPLING.items():
            v = _typed_field(body, bname, kind, "body.")
            if v is not None:
                job.sampling[sname] = v
                names[sname] = bname
        try:
            SamplingParams(**job.sampling).validate()
        except ValueError as e:  # name the body field, not ours: "max_tokens=0 ..." -> "body.max_completion_tokens=0 ..."
            msg = str(e)
            for sname, bname in names.items():
                if msg.startswith((sname + "=", sname + ".", sname + ":")):
                    msg = f"body.{bname}" + msg[len(sname):]
                    break
            raise ValueError(msg) from None
    except ValueError as e:
        raise err(str(e)) from None
    return job


def parse_lines(lines: Iterable[tuple[int, str]]) -> Iterator[Job | LineError]:
    """Parse numbered non-blank lines, yielding a Job or a LineError for each.

    A repeated id (native) or custom_id (OpenAI) is an error on its second and later lines,
    whose record carries no id (see :meth:`LineError.record`); the first line runs. A bad line
    whose id could be read still claims it: were a later line with that id to run, its result
    would mark the first line done once that line is fixed.
    """
    first_line: dict[tuple[str, Any], int] = {}
    for line_no, text in lines:
        try:
            item: Job | LineError = parse_line(text, line_no)
        except LineError as e:
            item = e
        if item.key is None:
            yield item
            continue
        key = (item.format, item.key)
        seen = first_line.setdefault(key, line_no)
        if seen != line_no:
            item = _duplicate(line_no, item.format, item.key, seen)
        yield item


def _duplicate(line_no: int, fmt: str, key: Any, first: int) -> LineError:
    fname = "id" if fmt == NATIVE else "custom_id"
    return LineError(line_no, f"{fname}: duplicate {json.dumps(key)} (first used on line {first})",
                     format=fmt, duplicate_of=key)
