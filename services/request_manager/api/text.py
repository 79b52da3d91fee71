"""Incremental detokenization and stop strings for streamed output.

Byte-level tokenizers split UTF-8 characters across tokens; a decoded text that ends in the
replacement character is held back until the next tokens complete it.

*Special tokens* are the tokenizer's added tokens marked special (EOS, BOS, a chat template's
markers). By default they are left out of the text, as OpenAI and vLLM do: a greedy completion
whose first token is EOS is the empty text, not ``"</s>"``. Stop strings are searched in that same
text, so a stop string never matches a special token's spelling when they are left out.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

REPLACEMENT = "\ufffd"


class TextStream:
    """Decodes a growing token list into text deltas and finds stop strings.

    ``text`` is everything released so far; stop strings are searched in released plus
    pending text, so a stop string straddling two steps is still found. Every call decodes the
    whole output, and each delta is what the decoded text adds to the released one, so the deltas
    concatenate to the decoded text (a tokenizer's decoding of a longer output extends that of a
    shorter one; special tokens left out change no text around them). ``skip_special_tokens``:
    leave special tokens out of the text (see the module docstring).
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str], skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._stop = [s for s in stop if s]
        self.skip_special_tokens = skip_special_tokens
        self.text = ""

    def fresh(self) -> TextStream:
        """A stream with the same tokenizer, stop strings and special-token rule that has released nothing."""
        return TextStream(self._tok, self._stop, self.skip_special_tokens)

    def decode(self, tokens: Sequence[int]) -> str:
        return self._tok.decode(list(tokens), skip_special_tokens=self.skip_special_tokens)

    def update(self, tokens: Sequence[int]) -> tuple[str, bool]:
        """Decode all ``tokens``; returns (new text to release, whether a stop string ended it)."""
        full = self.decode(tokens)
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
        full = self.decode(tokens)
        delta = full[len(self.text) :]
        self.text = full
        return delta

    def stop_cut(self, output: Sequence[int], tokens: Sequence[int]) -> int:
        """How many of a step's ``tokens`` (committed after ``output``) to keep: up to the one whose text
        completes a stop string, all of them when none does."""
        probe = self.fresh()
        for k in range(1, len(tokens) + 1):
            probe.text = ""
            if probe.update([*output, *tokens[:k]])[1]:
                return k
        return len(tokens)

    def _find_stop(self, full: str) -> int | None:
        hits = [i for s in self._stop if (i := full.find(s, len(self.text))) >= 0]
        return min(hits) if hits else None


def output_text(
    tokenizer: Tokenizer, tokens: Sequence[int], stop: Sequence[str], skip_special_tokens: bool, finished: bool
) -> str:
    """The text a request's stream releases for its output ``tokens`` in all (up to now, while it runs;
    ``finished``: incomplete characters at the end included): what its deltas concatenate to."""
    stream = TextStream(tokenizer, stop, skip_special_tokens)
    _, stopped = stream.update(tokens)
    if finished and not stopped:
        stream.flush(tokens)
    return stream.text
