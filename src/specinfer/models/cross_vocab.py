"""An SSM with another tokenizer, seen as a causal LM in the LLM's token IDs (token-level intersection).

:class:`CrossVocabularyLM` wraps the SSM's backend. Everything outside it (drafting, merging trees, the
wire, the verifier) sees only LLM token IDs: contexts and tree nodes arrive in LLM IDs and are spelt in
SSM tokens (:meth:`specinfer.core.vocab_map.VocabMap.ssm_tokens`); the SSM's logits go back restricted to
the shared tokens and written in LLM IDs, ``-inf`` elsewhere, so whatever is drafted from them is a shared
token and the distribution it was drawn from is the one the verifier receives. The method and why it is
exact: :mod:`specinfer.core.vocab_map` and docs/models.md.

Positions: an LLM token may take several SSM tokens, so a request's SSM context can be longer than its
LLM context. Where it would outgrow the SSM's positions the SSM reads a *window*, the last half of its
positions, moved forward in one jump when it fills up (a rebuild of the SSM's cache every half window);
the wrapper itself has no position limit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specinfer.checkpoint import token_table, vocab_size
from specinfer.core.errors import InvalidArgument
from specinfer.core.kv_budget import KVBudget, PrefixCacheStats
from specinfer.core.vocab_map import SHARED_VOCABULARY, TOKEN_INTERSECTION, VocabMap
from specinfer.models.interface import CausalLM, TreeForward

if TYPE_CHECKING:
    from specinfer.models.native.graphs import GraphStats

UNBOUNDED_POSITIONS = 2**31 - 1  # the wrapper's max_positions: the window keeps the SSM within its own
TREE_MARGIN = 128  # SSM positions kept free past the window for the draft tree's nodes


def draft_vocabulary(llm_dir: str | Path, ssm_dir: str | Path, field: str) -> VocabMap | None:
    """How an SSM's drafts reach the LLM's token IDs: None when it speaks them already (same tokenizer
    and vocabulary size), else the token-level intersection of the two tokenizers. Refuses (naming
    ``field``) an SSM whose tokenizer differs when either checkpoint ships none, or when no token is shared."""
    llm, ssm = token_table(llm_dir), token_table(ssm_dir)
    if llm is not None and ssm is not None and llm.spellings == ssm.spellings and llm.special == ssm.special:
        return None
    if llm is None or ssm is None:
        if vocab_size(llm_dir) == vocab_size(ssm_dir):
            return None  # no tokenizer to compare: taken on trust, as before
        raise InvalidArgument(
            field,
            "vocabulary size differs from the LLM's, "
            "and a draft with another tokenizer needs both checkpoints' tokenizer.json",
        )
    vmap = VocabMap(llm, ssm)
    if vmap.shared == 0:
        raise InvalidArgument(field, "its tokenizer shares no token with the LLM's")
    return vmap


def in_llm_ids(ssm: CausalLM, vmap: VocabMap | None) -> CausalLM:
    """The SSM as the LLM's token IDs see it: itself when it speaks them (``vmap`` None), else wrapped."""
    return ssm if vmap is None else CrossVocabularyLM(ssm, vmap)


def vocabulary_method(vmap: VocabMap | None) -> str:
    """The name GetModelInfo reports for an SSM's :func:`draft_vocabulary`."""
    return SHARED_VOCABULARY if vmap is None else TOKEN_INTERSECTION


@dataclass
class _Spelling:
    """One request's SSM side: its context spelt in SSM tokens, the window's start, and the SSM pending
    node that ends each LLM pending node of the current round."""

    llm_context: list[int] = field(default_factory=list)
    ssm_context: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)  # SSM length after each LLM context token
    start: int = 0  # the SSM reads ssm_context[start:]
    node_ends: list[int] = field(default_factory=list)  # per LLM pending node: its last SSM pending node
    ssm_pending: int = 0  # SSM pending nodes of the round
    seen: Sequence[int] | None = None  # the context object last synced (unchanged since, as callers never mutate one)

    def sync(self, context: Sequence[int], vmap: VocabMap, span: int) -> bool:
        """Spell ``context``; True when it changed (the round's pending nodes are gone)."""
        if context is self.seen or (len(context) == len(self.llm_context) and list(context) == self.llm_context):
            self.seen = context  # a drafter passes one context object to every depth of a round: compared once
            return False
        self.seen = context
        common = 0
        limit = min(len(context), len(self.llm_context))
        while common < limit and context[common] == self.llm_context[common]:
            common += 1
        keep = self.ends[common - 1] if common else 0
        del self.ssm_context[keep:], self.ends[common:]
        tokens, ends = vmap.ssm_context(context[common:])
        self.ssm_context.extend(tokens)
        self.ends.extend(keep + e for e in ends)
        self.llm_context = list(context)
        if self.start > len(self.ssm_context):
            self.start = 0
        if len(self.ssm_context) - self.start > span:  # jump: the window keeps the last half of its span
            self.start = len(self.ssm_context) - span // 2
        return True


class CrossVocabularyLM:
    """A :class:`~specinfer.models.interface.CausalLM` in the LLM's token IDs over an SSM with its own
    tokenizer (module docstring)."""

    def __init__(self, ssm: CausalLM, vmap: VocabMap) -> None:
        self.ssm = ssm
        self.vmap = vmap
        self._ids = {
            torch.device("cpu"): (torch.from_numpy(vmap.llm_ids), torch.from_numpy(vmap.ssm_ids))
        }  # device -> ([shared], [shared])
        self._span = max(1, ssm.max_positions - min(TREE_MARGIN, ssm.max_positions // 4))
        self._requests: dict[str, _Spelling] = {}

    @property
    def vocab_size(self) -> int:
        return self.vmap.llm_size

    @property
    def max_positions(self) -> int:
        return UNBOUNDED_POSITIONS

    @property
    def max_requests(self) -> int | None:
        return self.ssm.max_requests

    @property
    def kv_budget(self) -> KVBudget | None:
        """The SSM's, counted in its own tokens (a request manager counts LLM tokens against it: see docs/models.md)."""
        return self.ssm.kv_budget

    @property
    def kv_blocks_free(self) -> int | None:
        return self.ssm.kv_blocks_free

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        return self.ssm.prefix_cache_stats

    @property
    def graph_stats(self) -> GraphStats | None:
        return self.ssm.graph_stats

    def prefix_hits(self, request_id: str) -> int:
        return self.ssm.prefix_hits(request_id)

    def release(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self.ssm.release(request_id)

    def forward_tree(self, batch: Sequence[TreeForward]) -> list[torch.Tensor]:
        items, wanted = [], []
        for item in batch:
            sp = self._requests.setdefault(item.request_id, _Spelling())
            if sp.sync(item.context_tokens, self.vmap, self._span) or (item.parents and item.parents[0] < 0):
                sp.node_ends.clear()
                sp.ssm_pending = 0
            tokens: list[int] = []
            parents: list[int] = []
            rows: list[int] = []  # per LLM node, the row of its last SSM token among this call's nodes
            for token, parent in zip(item.tokens, item.parents, strict=True):
                prev = -1 if parent < 0 else sp.node_ends[parent]
                for piece in self.vmap.ssm_tokens(int(token)):
                    parents.append(prev)
                    tokens.append(piece)
                    prev = sp.ssm_pending + len(tokens) - 1
                rows.append(len(tokens) - 1)
                sp.node_ends.append(prev)
            sp.ssm_pending += len(tokens)
            items.append(TreeForward(item.request_id, sp.ssm_context[sp.start :], tokens, parents))
            wanted.append(rows)
        try:
            logits = self.ssm.forward_tree(items)
        except BaseException:
            for item in batch:  # the SSM's caches and our spellings may disagree now: start both afresh
                self.release(item.request_id)
            raise
        return [self._to_llm(lg[rows]) for lg, rows in zip(logits, wanted, strict=True)]

    def _to_llm(self, logits: torch.Tensor) -> torch.Tensor:  # [n, ssm_vocab] -> [n, llm_vocab]
        """The SSM's logits over the shared tokens, in LLM IDs; ``-inf`` (never drafted) elsewhere."""
        ids = self._ids.get(logits.device)
        if ids is None:  # copied to the SSM's device once, not on every call
            ids = self._ids[logits.device] = tuple(t.to(logits.device) for t in self._ids[torch.device("cpu")])
        llm_ids, ssm_ids = ids
        out = logits.new_full((logits.shape[0], self.vmap.llm_size), float("-inf"))  # [n, llm_vocab]
        out[:, llm_ids] = logits[:, ssm_ids]
        return out
