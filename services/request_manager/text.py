"""Incremental detokenization and stop strings for streamed output.

Byte-level tokenizers split UTF-8 characters across tokens; a decoded text that ends in the
replacement character is held back until the next tokens complete it.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

REPLACEMENT = "\ufffd"


class TextStream:
    """Decodes a growing token list into text deltas and finds stop strings.

    ``text`` is everything released so far; stop strings are searched in released plus
    pending text, so a stop string straddling two steps is still found.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str]) -> None:
        self._tok = tokenizer
        self._stop = [s for s in stop if s]
        self.text = ""

    def update(self, tokens: Sequence[int]) -> tuple[str, bool]:
        """Decode all ``tokens``; returns (new text to release, whether a stop string ended it)."""
        full = self._tok.decode(list(tokens), skip_special_tokens=False)
        hit = self._find_stop(full)
        if hit is not None:
            delta = full[len(self.text) : hit] if hit > len(self.text) else ""
            self.text = full[:hit]
            return delta, True
        stable = full.rstrip(REPLACEMENT)
        # hold back a tail that may be the start of a stop string, so a stop string is never
        # partly released before it is recognised
        stable = stable[: len(stable) - self._stop_prefix_len(stable)]
        if len(stable) <= len(self.text):
            return "", False
        delta = stable[len(self.text) :]
        self.text = stable
        return delta, False

    def _stop_prefix_len(self, text: str) -> int:
        best = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best

    def flush(self, tokens: Sequence[int]) -> str:
        """Release everything at the end of the request (incomplete characters included)."""
        full = self._tok.decode(list(tokens), skip_special_tokens=False)
        delta = full[len(self.text) :]
        self.text = full
        return delta

    def _find_stop(self, full: str) -> int | None:
        hits = [i for s in self._stop if (i := full.find(s, len(self.text))) >= 0]
        return min(hits) if hits else None
