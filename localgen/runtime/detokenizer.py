"""Incremental detokenization with stop strings that may span token boundaries.

Text that could still grow into a stop string, or that ends in an incomplete UTF-8 character, is
held back until it settles, so a streamed stop string never reaches the user.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = stop
        self.emitted = ""

    def _holdback(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best

    def update(self, output_ids: list[int], final: bool = False) -> tuple[str, bool]:
        """Returns ``(new settled text, hit a stop string)`` after the output grew.

        ``final`` releases any held-back text (the sequence ends for another reason).
        """
        if self.tokenizer is None:  # token-id-only use (tests, benchmarks): no text
            return "", False
        text = self.tokenizer.decode(output_ids, skip_special_tokens=True)
        start = max(0, len(self.emitted) - max((len(s) for s in self.stop), default=0))
        hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            return self._advance(text[:min(hits)]), True
        if not final:
            if text.endswith("\ufffd"):
                text = text[:-1]  # an incomplete multi-byte character: wait for its other tokens
            text = text[:len(text) - self._holdback(text)]
        return self._advance(text), False

    def _advance(self, settled: str) -> str:
        if not settled.startswith(self.emitted):
            return ""  # a re-decode changed earlier text (rare); keep what the user already has
        delta, self.emitted = settled[len(self.emitted):], settled
        return delta
