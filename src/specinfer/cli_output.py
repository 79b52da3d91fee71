"""What the generating commands print besides the text (``specinfer generate`` in process, ``specinfer remote``
through a server), in one form for both: the prompt's header and each output token's logprobs."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

from specinfer.core.requests import TokenLogprob


def print_logprobs(logprobs: Sequence[TokenLogprob], spell: Callable[[int], str], out=None) -> None:
    """One line per output token: its position, ``spell`` of it (its text, or its ID), log-probability, then its
    alternatives'."""
    print("--- logprobs (position, token, logprob, alternatives)", file=out, flush=True)
    for k, lp in enumerate(logprobs):
        alternatives = "  ".join(f"{spell(t)} {v:.4f}" for t, v in lp.top)
        print(f"{k:5d} {spell(lp.token):>16} {lp.logprob:9.4f}  {alternatives}".rstrip(), file=out, flush=True)


def print_prompt_header(prompt: str, out=None, tokens: int | None = None) -> None:
    """The ``--- prompt`` header and the prompt, before each generation's text: in-process and
    streamed output look alike (``tokens``: the prompt's length, where known before generating)."""
    out = out or sys.stdout
    print("--- prompt" + (f" ({tokens} tokens)" if tokens is not None else ""), file=out, flush=True)
    print(prompt, end="" if prompt.endswith("\n") else "\n", file=out, flush=True)
