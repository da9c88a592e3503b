"""Tool calling: tools into the prompt, tool calls out of the generated text.

Prompt side: a chat template that knows tools (Qwen 2.5, Llama 3.1+, Hermes, ...) renders them
itself through transformers' ``apply_chat_template(..., tools=...)``. A template without tools
gets a system message listing the tools' JSON schemas and asking for calls in the
``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` form, the convention of Hermes and Qwen.

Output side: :func:`parse_tool_calls` reads ``<tool_call>`` blocks (Qwen, Hermes) or a bare JSON
object ``{"name": ..., "parameters"|"arguments": ...}`` (Llama 3.x's JSON tool calling, optionally
after ``<|python_tag|>``), keeping only calls to the request's tools.

``tool_choice`` "required" or a named function constrains decoding with a ``response_format``
JSON schema (:func:`tool_call_schema`), so even a small model answers with a valid call.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from localgen.server.protocol import ChatMessage, NamedToolChoice, Tool

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
_PYTHON_TAG = "<|python_tag|>"


@dataclass
class ParsedCall:
    name: str
    arguments: dict[str, Any]

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's ``tool_calls`` entry: ``arguments`` as JSON text."""
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments)}}


def template_has_tools(tokenizer) -> bool:
    """Whether the model's chat template reads a ``tools`` variable."""
    tpl = getattr(tokenizer, "chat_template", None)
    if isinstance(tpl, dict):
        tpl = tpl.get("tool_use") or tpl.get("default") or ""
    return bool(tpl) and re.search(r"\btools\b", tpl) is not None


def _tool_json(tool: Tool) -> dict[str, Any]:
    return tool.model_dump(exclude_none=True)


def _fallback_system_prompt(tools: list[Tool]) -> str:
    listing = "\n".join(json.dumps(_tool_json(t)) for t in tools)
    return ("You can call functions. Their JSON schemas, one per line:\n" + listing + "\n"
            "To call one, answer only with <tool_call>{\"name\": NAME, \"arguments\": {...}}"
            "</tool_call>, the arguments following the function's schema.")


def _message_dict(m: ChatMessage, native_tools: bool) -> dict[str, Any]:
    d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    if m.name:
        d["name"] = m.name
    if m.tool_call_id:
        d["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        calls = [{"name": c.function.name, "arguments": _arguments(c.function.arguments)}
                 for c in m.tool_calls]
        if native_tools:
            # templates read arguments as a mapping (they serialize it themselves)
            d["tool_calls"] = [{"id": c.id, "type": "function", "function": call}
                               for c, call in zip(m.tool_calls, calls)]
        else:
            d["content"] += "".join(f"<tool_call>{json.dumps(c)}</tool_call>" for c in calls)
    return d


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def render_messages(tokenizer, messages: list[ChatMessage], tools: list[Tool] | None) -> str:
    """The prompt text: ``messages`` (and ``tools``) through the model's chat template.
    Raises ValueError (jinja's TemplateError is one) when the template refuses them."""
    native = template_has_tools(tokenizer)
    msgs = [_message_dict(m, native) for m in messages]
    kwargs: dict[str, Any] = {}
    if tools and native:
        kwargs["tools"] = [_tool_json(t) for t in tools]
    elif tools:
        note = _fallback_system_prompt(tools)
        if msgs and msgs[0]["role"] == "system":
            msgs[0] = {**msgs[0], "content": msgs[0]["content"] + "\n\n" + note}
        else:
            msgs.insert(0, {"role": "system", "content": note})
    return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kwargs)


def tool_call_schema(tools: list[Tool], choice: NamedToolChoice | str) -> dict[str, Any]:
    """A ``response_format`` whose JSON schema admits exactly one call
    ``{"name": ..., "arguments": {...}}`` to the named tool (``choice`` a NamedToolChoice) or to
    any of ``tools`` ("required")."""
    if isinstance(choice, NamedToolChoice):
        tools = [t for t in tools if t.function.name == choice.function.name]
    options = [{"type": "object",
                "properties": {"name": {"const": t.function.name},
                               "arguments": t.function.parameters or {"type": "object"}},
                "required": ["name", "arguments"], "additionalProperties": False}
               for t in tools]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {"type": "json_schema", "json_schema": {"name": "tool_call", "schema": schema}}


def _as_call(obj: Any, names: set[str]) -> ParsedCall | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = _arguments(args)
    return ParsedCall(obj["name"], args if isinstance(args, dict) else {"value": args})


def parse_tool_calls(text: str, tools: list[Tool]) -> tuple[str | None, list[ParsedCall]]:
    """``(content left over or None, calls)`` from generated text. Text that is not a call to
    one of ``tools`` stays content."""
    names = {t.function.name for t in tools}
    blocks = list(_TOOL_CALL.finditer(text))
    calls: list[ParsedCall] = []
    if blocks:
        for m in blocks:
            try:
                call = _as_call(json.loads(m.group(1)), names)
            except json.JSONDecodeError:
                call = None
            if call is not None:
                calls.append(call)
        if calls:
            rest = _TOOL_CALL.sub("", text).strip()
            return rest or None, calls
        return text, []
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG):].strip()
    if body.startswith("{"):
        try:
            decoded, end = json.JSONDecoder().raw_decode(body)
        except json.JSONDecodeError:
            return text, []
        objs = decoded if isinstance(decoded, list) else [decoded]
        parsed = [_as_call(o, names) for o in objs]
        # Llama 3.x separates several calls with ';'
        for part in body[end:].split(";"):
            part = part.strip()
            if part.startswith("{"):
                try:
                    parsed.append(_as_call(json.loads(part), names))
                except json.JSONDecodeError:
                    parsed.append(None)
        if parsed and all(p is not None for p in parsed):
            return None, parsed  # type: ignore[return-value]
    return text, []


def may_become_call(text: str) -> bool:
    """Whether streamed text so far could still be the start of a tool call (held back from
    the client until it settles)."""
    body = text.lstrip()
    return (body == "" or body.startswith(("{", "[", _PYTHON_TAG, "<tool_call>"))
            or "<tool_call>".startswith(body) or _PYTHON_TAG.startswith(body))
