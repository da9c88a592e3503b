"""Incremental detokenization with stop strings that may span token boundaries.

Text that could still grow into a stop string, or that ends in an incomplete UTF-8 character, is
held back until it settles, so a streamed stop string never reaches the user.

A fast (Rust) tokenizer decodes each new token once, through ``tokenizers``' ``DecodeStream``,
which keeps a few tokens of left context so that a token's leading space and byte-fallback
pieces come out as the whole sequence's decode gives them; a step then costs the same at the
first token and the thousandth. Other tokenizers re-decode the whole output each step.
"""

from __future__ import annotations


def _decode_stream(tokenizer):
    """``(backend, DecodeStream)`` for a transformers fast tokenizer whose ``decode`` adds
    nothing after the backend's own decoder (no ``clean_up_tokenization_spaces``): the
    ``tokenizers.Tokenizer`` and a fresh stream over it that skips special tokens. None when
    the output must come from ``tokenizer.decode`` itself."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    try:
        from tokenizers.decoders import DecodeStream  # tokenizers >= 0.21
    except ImportError:
        return None
    return backend, DecodeStream(skip_special_tokens=True)


class IncrementalDetokenizer:
    """The settled text of one request's output tokens, step by step.

    ``update`` takes the whole output so far (``list[int]``, grown by one or more tokens since
    the last call) and returns the newly settled text; ``emitted`` is all text settled so far.
    Special tokens are skipped, as ``tokenizer.decode(ids, skip_special_tokens=True)`` does."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = stop
        self.emitted = ""
        self._backend, self._stream = _decode_stream(tokenizer) or (None, None)
        self._decoded = ""  # the stream path: text of the tokens fed so far, whole characters
        self._fed = 0  # tokens fed to the stream
        self._open = 0  # fed tokens whose text is not whole yet (a split UTF-8 character)

    def _holdback(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best

    def _text(self, output_ids: list[int], final: bool) -> str:
        """The decode of ``output_ids``; unless ``final``, without a trailing incomplete
        character (it waits for the tokens that complete it)."""
        if self._stream is None:
            text = self.tokenizer.decode(output_ids, skip_special_tokens=True)
            # a split character decodes to one or more U+FFFD (one per byte under byte fallback)
            return text if final else text.rstrip("\ufffd")
        for tok in output_ids[self._fed:]:
            piece = self._stream.step(self._backend, tok)
            self._open = 0 if piece is not None else self._open + 1
            if piece:
                self._decoded += piece
        self._fed = len(output_ids)
        if final and self._open:  # an incomplete character at the end: its replacement text
            return self._decoded + self.tokenizer.decode(output_ids[-self._open:],
                                                         skip_special_tokens=True)
        return self._decoded

    def update(self, output_ids: list[int], final: bool = False) -> tuple[str, bool]:
        """Returns ``(new settled text, hit a stop string)`` after the output grew.

        ``final`` releases any held-back text (the sequence ends for another reason).
        """
        if self.tokenizer is None:  # token-id-only use (tests, benchmarks): no text
            return "", False
        text = self._text(output_ids, final)
        start = max(0, len(self.emitted) - max((len(s) for s in self.stop), default=0))
        hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            return self._advance(text[:min(hits)]), True
        if not final:
            text = text[:len(text) - self._holdback(text)]
        return self._advance(text), False

    def _advance(self, settled: str) -> str:
        if not settled.startswith(self.emitted):
            return ""  # a re-decode changed earlier text (rare); keep what the user already has
        delta, self.emitted = settled[len(self.emitted):], settled
        return delta
