"""Drafts with another tokenizer: token-level intersection between an SSM's vocabulary and the LLM's.

Terms:
- A token's *spelling* is the byte string it stands for in decoded text (``" def"`` as UTF-8 bytes,
  however the tokenizer writes it: ``Ġdef`` in byte-level BPE, ``▁def`` in SentencePiece).
  *Special* tokens (``</s>``, ``<|endoftext|>``) have no spelling; they are matched by their
  content string instead.
- The *shared tokens* are the pairs (SSM token, LLM token) with the same spelling (or the same
  special content; and the two EOS tokens). Each side's tokens appear in at most one pair.
- *Token-level intersection* (TLI; Timor et al., ICML 2025, "Accelerating LLM Inference with
  Lossless Speculative Decoding Algorithms for Heterogeneous Vocabularies"; vLLM and Hugging Face
  assisted generation use the same idea): the SSM drafts only shared tokens. Its next-token
  distribution is restricted to them and renormalised, then written in LLM token IDs, so the tree
  it drafts is made of LLM tokens and the verifier never sees the SSM's vocabulary.
- An LLM token's *SSM spelling* (:meth:`VocabMap.ssm_tokens`) is what the SSM reads for it in a
  context: the shared SSM token when there is one, else the SSM tokens that spell the same bytes,
  found by greedy longest match. Text is not re-tokenised as a whole, so a context grows by whole
  tokens and the SSM's KV cache is only ever appended to.

Why verification stays exact: the SSM's restricted distribution q is the distribution its children
are drawn from (top-k under greedy decoding), and it is exactly what the verifier receives with
them. Multi-step speculative sampling is lossless for any q that the draws follow, and greedy
verification for any tree, so the choice of shared tokens and spellings changes acceptance, never
the output.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

SHARED_VOCABULARY = "shared"  # the SSM speaks the LLM's token IDs
TOKEN_INTERSECTION = "token-intersection"  # this module's method


@dataclass(frozen=True)
class TokenTable:
    """One tokenizer's view of a model's vocabulary: ``spellings[i]`` is token i's bytes (None for
    special tokens and for embedding rows no token uses), ``special`` maps special token IDs to
    their content, ``eos`` is the end-of-sequence token (None: unknown)."""

    spellings: tuple[bytes | None, ...]
    special: Mapping[int, str] = field(default_factory=dict)
    eos: int | None = None

    @property
    def size(self) -> int:
        return len(self.spellings)


class VocabMap:
    """The shared tokens of an SSM and an LLM, and the SSM spelling of every LLM token.

    ``ssm_ids[i]`` and ``llm_ids[i]`` are the two IDs of shared token i. Built once per SSM; the
    SSM spellings are computed on first use and kept (a pure function of the two tables)."""

    def __init__(self, llm: TokenTable, ssm: TokenTable) -> None:
        self.llm_size, self.ssm_size = llm.size, ssm.size
        by_spelling: dict[bytes, int] = {}
        for i, s in enumerate(ssm.spellings):
            if s:  # the empty spelling is no token worth drafting
                by_spelling.setdefault(s, i)
        by_special = {content: i for i, content in sorted(ssm.special.items(), reverse=True)}  # lowest ID wins
        pairs: dict[int, int] = {}  # SSM id -> LLM id
        taken: set[int] = set()

        def pair(s: int | None, t: int | None) -> None:
            if s is not None and t is not None and s not in pairs and t not in taken and s < ssm.size and t < llm.size:
                pairs[s] = t
                taken.add(t)

        pair(ssm.eos, llm.eos)
        for t, content in sorted(llm.special.items()):
            pair(by_special.get(content), t)
        for t, s in enumerate(llm.spellings):
            if s:
                pair(by_spelling.get(s), t)
        order = sorted(pairs)
        self.ssm_ids = np.array(order, dtype=np.int64)  # [shared]
        self.llm_ids = np.array([pairs[s] for s in order], dtype=np.int64)  # [shared]
        self._shared_of_llm = {t: s for s, t in pairs.items()}
        self._llm_spellings = llm.spellings
        self._fallback = (ssm.eos,) if ssm.eos is not None else (0,)  # what the SSM reads for a token it cannot spell
        self._pieces = by_spelling
        self._longest = max((len(s) for s in by_spelling), default=1)
        self._spelled: dict[int, tuple[int, ...]] = {}

    @property
    def shared(self) -> int:
        """Number of shared tokens."""
        return int(self.ssm_ids.size)

    def ssm_tokens(self, llm_token: int) -> tuple[int, ...]:
        """The SSM spelling of one LLM token (never empty; see the module docstring)."""
        out = self._spelled.get(llm_token)
        if out is None:
            out = self._spell(llm_token)
            self._spelled[llm_token] = out
        return out

    def ssm_context(self, llm_tokens: Sequence[int]) -> tuple[list[int], list[int]]:
        """The SSM spelling of a token sequence and, per LLM token, the SSM length after it (so a prefix of
        ``k`` LLM tokens is the first ``ends[k - 1]`` SSM tokens)."""
        tokens: list[int] = []
        ends: list[int] = []
        for t in llm_tokens:
            tokens.extend(self.ssm_tokens(int(t)))
            ends.append(len(tokens))
        return tokens, ends

    def _spell(self, llm_token: int) -> tuple[int, ...]:
        shared = self._shared_of_llm.get(llm_token)
        if shared is not None:
            return (shared,)
        spelling = self._llm_spellings[llm_token] if 0 <= llm_token < self.llm_size else None
        out: list[int] = []
        i = 0
        while spelling and i < len(spelling):
            for n in range(min(self._longest, len(spelling) - i), 0, -1):  # greedy longest match
                piece = self._pieces.get(spelling[i : i + n])
                if piece is not None:
                    out.append(piece)
                    i += n
                    break
            else:  # a byte no SSM token spells: skipped
                i += 1
        return tuple(out) or self._fallback
