"""A GGUF's cached tokenizer read with the `tokenizers` library and jinja2, without transformers.

Importing transformers is most of what reading a cached GGUF tokenizer costs a cold start
(`localgen.models.tokenizer_cache`). Its cache entry is what transformers' ``save_pretrained``
wrote: ``tokenizer.json`` (the `tokenizers` library's own format), ``tokenizer_config.json``
(the named special tokens) and ``chat_template.jinja``. `read_light_tokenizer` reads such an
entry when transformers (``TokenizersBackend``) would read it into the same tokenizer: no
truncation, padding or extra special tokens to apply, a post-processor present, nothing in the
config that changes encoding or decoding. Otherwise it returns None and the caller reads the
entry with transformers.

`LightTokenizer` answers the calls a request makes: encoding one string, decoding one list of
ids, rendering a chat of plain text messages, the vocabulary and the named special tokens. Any
other call or argument goes to the transformers tokenizer of the same entry, read at its first
use (`LightTokenizer.transformers_tokenizer`), so both give the same answers.

Chat templates render as transformers renders them (its ``apply_chat_template``): a sandboxed
jinja2 environment (``ImmutableSandboxedEnvironment``, ``trim_blocks``, ``lstrip_blocks``, the
loop-controls extension), the helpers templates call (``raise_exception``, ``strftime_now``,
a ``tojson`` that keeps non-ASCII text), ``dict`` and ``namespace`` that refuse names starting
with an underscore, and the named special tokens as variables.
"""

from __future__ import annotations

import json
import threading
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

TOKENIZER_FILE, CONFIG_FILE, TEMPLATE_FILE = "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                        "cls_token", "mask_token")
# tokenizer_config.json keys that change nothing transformers does with a tokenizer.json
_INERT_KEYS = frozenset({"backend", "tokenizer_class", "is_local", "local_files_only",
                         "model_max_length", "clean_up_tokenization_spaces", *NAMED_SPECIAL_TOKENS})
# message fields transformers copies into one another before rendering (reasoning aliases)
_ALIASED_FIELDS = frozenset({"reasoning_content", "thinking", "reasoning"})


def read_light_tokenizer(folder: str | Path) -> LightTokenizer | None:
    """The tokenizer saved in ``folder`` as a `LightTokenizer`, or None when transformers might
    read it differently (see the module docstring) or it cannot be read: the caller then reads
    it with transformers, which reports or repairs a damaged entry. Raises nothing."""
    folder = Path(folder)
    try:
        files = {p.name for p in folder.iterdir()}
        config = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
        template = ((folder / TEMPLATE_FILE).read_text(encoding="utf-8")
                    if TEMPLATE_FILE in files else None)
    except (OSError, ValueError):
        return None
    if not files <= {TOKENIZER_FILE, CONFIG_FILE, TEMPLATE_FILE} or not _config_is_inert(config):
        return None
    from tokenizers import Tokenizer

    try:
        backend = Tokenizer.from_file(str(folder / TOKENIZER_FILE))
    except Exception:  # noqa: BLE001 - any unreadable file: transformers' path reports it
        return None
    if not _backend_kept_as_is(backend, config):
        return None
    return LightTokenizer(backend, config, template, folder)


def _config_is_inert(config: Any) -> bool:
    return (isinstance(config, dict) and set(config) <= _INERT_KEYS
            and config.get("tokenizer_class", "TokenizersBackend") == "TokenizersBackend"
            and config.get("backend", "tokenizers") == "tokenizers"
            and config.get("clean_up_tokenization_spaces", False) is False
            and all(config.get(k) is None or isinstance(config[k], str) for k in NAMED_SPECIAL_TOKENS))


def _backend_kept_as_is(backend: Any, config: dict) -> bool:
    """Whether transformers leaves ``backend`` unchanged: it sets truncation and padding from the
    file, rebuilds a missing post-processor and adds the named special tokens the file lacks."""
    added = {t.content for t in backend.get_added_tokens_decoder().values()}
    named = [config[k] for k in NAMED_SPECIAL_TOKENS if config.get(k) is not None]
    return (backend.truncation is None and backend.padding is None
            and backend.post_processor is not None and all(t in added for t in named))


class LightTokenizer:
    """A `tokenizers.Tokenizer` with the named special tokens and chat template of its
    transformers entry; see the module docstring for what it answers itself."""

    def __init__(self, backend: Any, config: dict, chat_template: str | None, folder: Path):
        self.backend, self.chat_template, self.folder = backend, chat_template, folder
        self.special_tokens_map = {k: config[k] for k in NAMED_SPECIAL_TOKENS if config.get(k) is not None}
        self._template = None
        self._full = None
        self._lock = threading.Lock()

    # -- what a request needs ------------------------------------------------------------
    def __call__(self, text: Any, add_special_tokens: bool = True, **kwargs: Any) -> Any:
        """``{"input_ids": [...], "attention_mask": [...]}`` of one string."""
        if kwargs or not isinstance(text, str):
            return self.transformers_tokenizer(text, add_special_tokens=add_special_tokens, **kwargs)
        enc = self.backend.encode(text, add_special_tokens=add_special_tokens)
        return Encoding(input_ids=enc.ids, attention_mask=enc.attention_mask)

    def encode(self, text: Any, add_special_tokens: bool = True, **kwargs: Any) -> Any:
        """The token ids of one string."""
        if kwargs or not isinstance(text, str):
            return self.transformers_tokenizer.encode(text, add_special_tokens=add_special_tokens, **kwargs)
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Any, skip_special_tokens: bool = False, **kwargs: Any) -> Any:
        """The text of one list of ids (python ints)."""
        if kwargs or not isinstance(token_ids, (list, tuple)) or any(type(i) is not int for i in token_ids):
            return self.transformers_tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens,
                                                      **kwargs)
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, conversation: Any, *args: Any, **kwargs: Any) -> Any:
        """The rendered text of a chat of plain text messages (``tokenize=False``, optionally
        ``add_generation_prompt``); every other use goes to transformers."""
        options = dict(kwargs)
        tokenize = options.pop("tokenize", True)
        add_generation_prompt = options.pop("add_generation_prompt", False)
        messages = _plain_messages(conversation)
        template = None if args or options or tokenize or messages is None else self._compiled()
        if template is None:
            return self.transformers_tokenizer.apply_chat_template(conversation, *args, **kwargs)
        return template.render(messages=messages, tools=None, documents=None,
                               add_generation_prompt=add_generation_prompt, **self.special_tokens_map)

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        """The base vocabulary, without the added tokens (transformers' meaning)."""
        return self.backend.get_vocab_size(with_added_tokens=False)

    def _token_id(self, name: str) -> int | None:
        token = self.special_tokens_map.get(name)
        return None if token is None else self.backend.token_to_id(token)

    bos_token = property(lambda self: self.special_tokens_map.get("bos_token"))
    eos_token = property(lambda self: self.special_tokens_map.get("eos_token"))
    unk_token = property(lambda self: self.special_tokens_map.get("unk_token"))
    pad_token = property(lambda self: self.special_tokens_map.get("pad_token"))
    bos_token_id = property(lambda self: self._token_id("bos_token"))
    eos_token_id = property(lambda self: self._token_id("eos_token"))
    unk_token_id = property(lambda self: self._token_id("unk_token"))
    pad_token_id = property(lambda self: self._token_id("pad_token"))

    # -- everything else -----------------------------------------------------------------
    @property
    def transformers_tokenizer(self) -> Any:
        """The transformers tokenizer of the same entry, read at the first call that needs it."""
        with self._lock:
            if self._full is None:
                from localgen.models.tokenizer_cache import load_saved

                self._full = load_saved(self.folder)
        return self._full

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # never reached for the attributes __init__ sets
            raise AttributeError(name)
        return getattr(self.transformers_tokenizer, name)

    def _compiled(self) -> Any:
        """The compiled chat template, or None where transformers must render (no template, a
        jinja2 older than transformers accepts, syntax this environment lacks such as
        ``{% generation %}``)."""
        if self._template is None and self.chat_template is not None:
            self._template = _compile_template(self.chat_template) or False
        return self._template or None

    def __repr__(self) -> str:
        return f"LightTokenizer({str(self.folder)!r}, vocab={len(self)})"


class Encoding(dict):
    """One string's encoding: a dict whose keys read as attributes too (``enc.input_ids``)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _plain_messages(conversation: Any) -> list[dict[str, str]] | None:
    """The messages with None values dropped when every message is a dict of strings without
    reasoning fields (what transformers renders unchanged), else None."""
    if not isinstance(conversation, (list, tuple)) or not conversation:
        return None
    out = []
    for m in conversation:
        if type(m) is not dict or _ALIASED_FIELDS & m.keys():
            return None
        if not all(type(k) is str and (v is None or type(v) is str) for k, v in m.items()):
            return None
        out.append({k: v for k, v in m.items() if v is not None})
    return out


def _compile_template(source: str) -> Any:
    """``source`` compiled in the environment described in the module docstring, or None where
    transformers must render it (a jinja2 older than 3.1.6, which it refuses for known sandbox
    escapes; syntax this environment lacks)."""
    if tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit()) < (3, 1, 6):
        return None
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       dict=_TemplateDict(), namespace=_Namespace)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError:
        return None


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """``dict(...)`` and ``dict.fromkeys(...)`` for templates, without the type object itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """jinja2's ``namespace``, refusing attribute names that start with an underscore."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja2's signature: "self" may be a key
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"a chat template may not set {name!r} on a namespace (a leading underscore)")
