"""Structured output: OpenAI's ``response_format`` turned into a grammar that constrains decoding.

The grammar engine is xgrammar (Dong et al. 2024, "XGrammar: Flexible and Efficient Structured
Generation Engine for Large Language Models", https://github.com/mlc-ai/xgrammar). A request with a
``response_format`` of type ``json_object`` or ``json_schema`` gets its own grammar matcher; before
each sampling step the matcher's token bitmask sets the logits of tokens that would break the
grammar to -inf, and the sampled token then advances the matcher. End-of-sequence tokens are
allowed only once the grammar is complete.

Accepted shapes (https://platform.openai.com/docs/api-reference/chat/create#response_format)::

    {"type": "text"}
    {"type": "json_object"}
    {"type": "json_schema", "json_schema": {"name": "...", "schema": {...}, "strict": true}}

xgrammar is imported on first use, so requests without a grammar never load it.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from dataclasses import dataclass
from typing import Any

import torch

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "; users need only the rest.
_CPP_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s*\S+:\d+:\s*")
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(frozen=True)
class GrammarSpec:
    """What a ``response_format`` asks for: ``kind`` "json_object" or "json_schema", and for the
    latter the schema as canonical JSON text (sorted keys), the key of the compiled grammar cache."""

    kind: str
    schema: str | None = None


def _error(part: str, why: str) -> ValueError:
    return ValueError(f"response_format{part}: {why}")


def parse_response_format(rf: Any) -> GrammarSpec | None:
    """Check the shape of an OpenAI ``response_format``; None for ``{"type": "text"}`` (no
    constraint). Raises ValueError naming ``response_format`` and the bad part. Whether the
    grammar engine can compile the schema is checked by :func:`check_response_format`."""
    if not isinstance(rf, dict):
        raise _error("", f"must be an object, got {type(rf).__name__}")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind != "json_schema":
        raise _error(".type", f"must be 'text', 'json_object' or 'json_schema', got {kind!r}")
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise _error(".json_schema", "must be an object with 'name' and 'schema'")
    name = js.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise _error(".json_schema.name", "must be 1-64 characters of a-z, A-Z, 0-9, '_' or '-'")
    if "strict" in js and js["strict"] is not None and not isinstance(js["strict"], bool):
        raise _error(".json_schema.strict", "must be true or false")
    schema = js.get("schema", {})  # OpenAI: a missing schema means any JSON object
    if not isinstance(schema, (dict, bool)):
        raise _error(".json_schema.schema", f"must be a JSON Schema object, got {type(schema).__name__}")
    try:
        text = json.dumps(schema, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise _error(".json_schema.schema", f"is not JSON: {e}") from None
    return GrammarSpec("json_schema", text)


def _engine_message(exc: Exception) -> str:
    return _CPP_PREFIX.sub("", str(exc)).strip().splitlines()[0] if str(exc).strip() else repr(exc)


@functools.lru_cache(maxsize=256)
def _check_spec(spec: GrammarSpec) -> None:
    import xgrammar as xgr

    if spec.kind == "json_schema":
        try:
            xgr.Grammar.from_json_schema(spec.schema, any_whitespace=False, strict_mode=True)
        except Exception as e:  # xgrammar raises RuntimeError/ValueError with the reason
            raise _error(".json_schema.schema", f"cannot be compiled: {_engine_message(e)}") from None


def check_response_format(rf: Any) -> GrammarSpec | None:
    """:func:`parse_response_format`, then build the schema's grammar (tokenizer independent,
    cached per schema) so a schema the grammar engine does not support fails here, naming it."""
    spec = parse_response_format(rf)
    if spec is not None:
        _check_spec(spec)
    return spec
