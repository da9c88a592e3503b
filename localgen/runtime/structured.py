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

xgrammar (and torch) are imported on first use: ``SamplingParams.validate`` calls into this
module, and the request types stay light to import.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "; users need only the rest.
_CPP_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s*\S+:\d+:\s*")
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# Compiled grammars kept for reuse: a few hundred schemas of typical size.
_CACHE_BYTES = 256 << 20


@dataclass(frozen=True)
class GrammarSpec:
    """What a ``response_format`` asks for: ``kind`` "json_object" or "json_schema", and for the
    latter the schema as JSON text (keys in the given order: the grammar emits properties in
    schema order), the key of the compiled grammar cache."""

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
        text = json.dumps(schema, allow_nan=False)
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


def _options(spec: GrammarSpec) -> tuple[str, bool]:
    """(schema text, strict_mode) handed to the compiler. json_object is any JSON object, with
    any keys; a json_schema's objects get only the properties it names (strict mode), which
    still validates against the schema and keeps small models from inventing keys."""
    if spec.kind == "json_object":
        return '{"type": "object"}', False
    return spec.schema, True


class SequenceGrammar:
    """One sequence's grammar matcher and the bitmask of the tokens it allows next.

    The matcher's state is that of the sequence's output tokens, which preemption by
    recomputation keeps, so it needs no rebuilding when the sequence is prefilled again.
    """

    def __init__(self, compiled, vocab_size: int, stop_token_ids: frozenset[int]):
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self._mask_fresh = False

    def next_token_bitmask(self) -> torch.Tensor:
        """int32 ``[ceil(vocab / 32)]``: bit ``t % 32`` of word ``t // 32`` set when token ``t``
        keeps the output inside the grammar (end-of-sequence only once it is complete)."""
        if not self._mask_fresh:
            self._matcher.fill_next_token_bitmask(self._bitmask)
            self._mask_fresh = True
        return self._bitmask[0]

    def accept(self, token: int) -> None:
        """Advance past a sampled token. Raises RuntimeError for a token the mask forbade,
        which means the mask was not applied before sampling."""
        if not self._matcher.accept_token(token):
            raise RuntimeError(f"token {token} breaks the request's response_format grammar")
        self._mask_fresh = False

    @property
    def complete(self) -> bool:
        """True once the output is a whole sentence of the grammar that admits nothing more
        than end-of-sequence (or has taken it): the request can finish without another step."""
        if self._matcher.is_terminated():
            return True
        if not self._matcher.is_completed():
            return False
        allowed = unpack_bitmask(self.next_token_bitmask()[None], self._vocab_size)[0]
        return set(allowed.nonzero().flatten().tolist()) <= self._stop_token_ids


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool ``[rows, vocab_size]`` from xgrammar's int32 bitmask ``[rows, ceil(vocab / 32)]``."""
    import torch

    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.flatten(1)[:, :vocab_size].bool()


def mask_logits(logits: torch.Tensor, grammars: list[SequenceGrammar | None]) -> torch.Tensor:
    """``logits`` ``[num_seqs, vocab]`` with each constrained row's forbidden tokens at -inf;
    rows without a grammar are untouched. Returns a new tensor (the input is left as it is,
    so log-probabilities can still be read from the model's own distribution), or the input
    itself when no row is constrained."""
    import torch

    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return logits
    bits = torch.stack([grammars[i].next_token_bitmask() for i in rows]).to(logits.device)
    allowed = unpack_bitmask(bits, logits.shape[-1])
    out = logits.clone()
    out[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return out


class GrammarCache:
    """Compiles response formats against one tokenizer, once per distinct schema, and hands
    out a fresh :class:`SequenceGrammar` per request. Thread safe: a server may compile a
    request's grammar on its own thread before queuing it, off the engine's step loop.

    ``vocab_size``: the width of the model's logits (may exceed the tokenizer's vocabulary;
    None: the tokenizer's);
    ``stop_token_ids``: the engine's end-of-sequence tokens, the only way the grammar ends.
    """

    def __init__(self, tokenizer, vocab_size: int | None, stop_token_ids: tuple[int, ...]):
        self._tokenizer, self._vocab_size = tokenizer, vocab_size
        self._stop_token_ids = tuple(stop_token_ids)
        self._compiler = None
        self._lock = threading.Lock()

    def _get_compiler(self):
        import xgrammar as xgr

        with self._lock:
            if self._compiler is None:
                self._compiler = self._new_compiler(xgr)
        return self._compiler

    def _new_compiler(self, xgr):
        try:
            info = xgr.TokenizerInfo.from_huggingface(
                self._tokenizer, vocab_size=self._vocab_size,
                stop_token_ids=list(self._stop_token_ids) or None)
        except Exception as e:
            raise ValueError(f"response_format: the grammar engine cannot read this model's "
                             f"tokenizer ({_engine_message(e)})") from None
        self._vocab_size = info.vocab_size
        return xgr.GrammarCompiler(info, cache_limit_bytes=_CACHE_BYTES)

    def compile(self, response_format: Any):
        """The compiled grammar of a response format (None for type text). Raises ValueError
        as :func:`check_response_format` does."""
        spec = check_response_format(response_format)
        if spec is None:
            return None
        schema, strict = _options(spec)
        compiler = self._get_compiler()
        try:  # the compiler caches by schema text and options (bounded, least recently used out)
            return compiler.compile_json_schema(schema, any_whitespace=False, strict_mode=strict)
        except Exception as e:
            raise _error(".json_schema.schema", f"cannot be compiled: {_engine_message(e)}") from None

    def sequence_grammar(self, response_format: Any) -> SequenceGrammar | None:
        """A new matcher for one request (None when it asks for no constraint)."""
        compiled = self.compile(response_format) if response_format is not None else None
        if compiled is None:
            return None
        return SequenceGrammar(compiled, self._vocab_size, frozenset(self._stop_token_ids))
