"""A draft head's draft vocabulary (:mod:`specinfer.models.draft_head`): ``train-head --draft-vocab K`` writes one
from its training corpus, and ``specinfer head-vocab`` adds one to a head already trained."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from specinfer.core import InvalidArgument
from specinfer.models.draft_head import frequent_tokens, is_head_dir, save_draft_vocab


def write_draft_vocab(out: Path, stream: torch.Tensor, vocab_size: int, size: int, log) -> torch.Tensor:
    """Save the ``size`` most frequent tokens of ``stream``  # [T] into the head folder ``out``, logging the share
    of the stream's tokens they cover; returns them  # [size] int64."""
    if not 0 < size <= vocab_size:
        raise InvalidArgument("draft-vocab", f"must be in [1, {vocab_size}] (the LLM's vocabulary), got {size}")
    ids = frequent_tokens(stream, vocab_size, size)
    kept = torch.zeros(vocab_size, dtype=torch.bool)
    kept[ids] = True
    covered = float(kept[stream.long()].float().mean()) if len(stream) else 0.0
    save_draft_vocab(out, ids)
    print(
        f"draft vocabulary: {size} of {vocab_size} tokens, {covered:.1%} of the corpus's {len(stream)} tokens",
        file=log,
        flush=True,
    )
    return ids


def run_head_vocab(head: Path, llm: Path, corpus: tuple[Path, ...], size: int, max_bytes: int = 0, log=None) -> None:
    """``specinfer head-vocab``: the draft vocabulary of the head folder ``head`` from ``corpus`` in the tokenizer of
    ``llm`` (the head's LLM)."""
    import json

    from specinfer.training.sources import corpus_tokens

    log = log or sys.stderr
    if not is_head_dir(head):
        raise InvalidArgument("head", f"{head} is not a draft-head folder (specinfer train-head writes one)")
    vocab_size = json.loads((head / "config.json").read_text())["vocab_size"]
    stream, _ = corpus_tokens(llm, corpus, max_bytes, 0.0, log)  # no held-out part: every token counts
    write_draft_vocab(head, stream, vocab_size, size, log)
