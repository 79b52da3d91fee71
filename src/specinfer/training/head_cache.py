"""``train-head --cache-features``: the LLM's features of the whole training stream computed once, instead of
for every step's windows.

Without the cache each step runs the LLM over its windows, which on a CPU is most of a step; a corpus read for
several epochs (a chat model's own answers, :mod:`specinfer.training.chat_corpus`, are a few ten thousand tokens)
pays it again every epoch. The stream is cut into consecutive *chunks* of ``seq_len`` tokens, each run through the
LLM once (the features of a token see the chunk's tokens before it, as a window's see the window's before it;
the tokens after the last whole chunk are left out);
a step's windows are then random spans of the stream, their features looked up. With ``--kd-weight 0`` a step
then runs no product of the LLM at all (:func:`specinfer.training.head.step_loss`).
"""

from __future__ import annotations

import torch


class FeatureCache:
    """The training stream's tokens and the LLM's feature of every one of them."""

    def __init__(self, stream: torch.Tensor, features: torch.Tensor) -> None:
        self.stream = stream  # [N]
        self.features = features  # [N, feature_dim] float32

    @staticmethod
    def build(teacher, stream: torch.Tensor, seq_len: int, batch: int, bar=None) -> FeatureCache:
        """Features of ``stream`` by chunks of ``seq_len`` tokens, ``batch`` chunks per LLM call (``bar``: a
        progress bar counting tokens). The tokens after the last whole chunk are left out."""
        chunks = stream[: len(stream) // seq_len * seq_len].view(-1, seq_len)  # [chunks, seq_len]
        if len(chunks) == 0:
            raise ValueError(f"the stream has {len(stream)} tokens, fewer than one chunk of {seq_len}")
        parts = []
        for i in range(0, len(chunks), batch):
            parts.append(teacher.features(chunks[i : i + batch]).flatten(0, 1))  # [batch * seq_len, F]
            if bar is not None:
                bar.update(parts[-1].shape[0])
        return FeatureCache(chunks.flatten(), torch.cat(parts))

    def windows(self, count: int, length: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """``count`` spans of ``length`` tokens at random offsets (drawn as
        :func:`~specinfer.training.corpus.random_windows` draws them) and their features.
        # [count, length], [count, length, F]"""
        starts = torch.randint(0, len(self.stream) - length, (count,), generator=generator)
        index = starts[:, None] + torch.arange(length)  # [count, length]
        return self.stream[index], self.features[index]
