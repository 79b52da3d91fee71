"""Drafting token trees with a draft head (:mod:`specinfer.models.draft_head`) next to its LLM.

:class:`HeadDrafter` keeps, per request, the head's keys and values of the committed text's pairs (one
layer: a pair's key and value depend on its input alone, so absorbing a pair runs no attention) and the
LLM's feature at the last committed token. The verifier feeds it after each verification
(:meth:`HeadDrafter.absorb`: the features the LLM computed for the context and the accepted path), then
grows the next step's tree from the bonus token through :meth:`HeadDrafter.forward_tree`, which is the
:class:`~specinfer.models.interface.CausalLM` call that :func:`specinfer.models.drafting.draft_trees` makes of an
SSM: the same tree builders, the same drawing of drafts (so sampling stays exact under multi-step
speculative sampling), rows on the model's device.

A tree node's input pair is (its parent's predicted feature, its token) at RoPE position
``len(context) - 1 + depth``; the root's is (the true feature at the last context token, the root token).
Positions whose features the LLM did not compute (prompt tokens taken from its prefix cache) have no
pair: the head attends to the pairs it has.
"""

from __future__ import annotations

import contextlib
import functools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from specinfer.models.draft_head import DraftHead
from specinfer.models.interface import CausalLM, TreeForward
from specinfer.models.on_device import serial_on_cpu

if TYPE_CHECKING:
    from specinfer.models.native.backend import NativeBackend


@dataclass
class _Round:
    """The nodes drafted so far in one request's current round."""

    keys: torch.Tensor  # [n, kv_heads, head_dim]
    values: torch.Tensor  # [n, kv_heads, head_dim]
    predicted: torch.Tensor  # [n, feature_dim] each node's predicted feature (its children's input)
    positions: list[int]  # each node's RoPE position
    ancestors: list[list[int]]  # each node's ancestors in the round and itself


RECENT_FEATURES = 64  # features kept per request: a request that goes back (a dropped step) keeps its last pair's


@dataclass
class _State:
    """One request: ``tokens``, the committed tokens it was fed (the pairs' tokens); its pairs' keys and
    values at ``positions``; ``recent``, the LLM's features of the last committed positions, from
    ``recent_start`` to ``len(tokens) - 1`` (the last one roots the next draft)."""

    tokens: list[int]
    keys: torch.Tensor  # [P, kv_heads, head_dim]
    values: torch.Tensor  # [P, kv_heads, head_dim]
    recent: torch.Tensor  # [R, feature_dim]
    positions: list[int] = field(default_factory=list)  # sorted
    recent_start: int = 0
    round: _Round | None = None

    @property
    def last(self) -> torch.Tensor | None:
        """The feature at ``tokens[-1]`` (None: unknown)."""
        ok = self.recent.shape[0] and self.recent_start + self.recent.shape[0] == len(self.tokens)
        return self.recent[-1] if ok else None

    def feature(self, position: int) -> torch.Tensor | None:
        at = position - self.recent_start
        return self.recent[at] if 0 <= at < self.recent.shape[0] else None


class HeadDrafter:
    """See the module docstring. ``lm_logits_after``: the LLM's LM head after a linear map into features (given
    the map and the rows to compute, a function of the mapped rows:
    :meth:`~specinfer.models.native.backend.NativeBackend.lm_logits_after`); ``embed_rows``: the LLM's embedding
    rows; ``draft_vocab``  # [K] int64: the tokens it drafts from (:mod:`specinfer.models.draft_head`; None: all);
    ``max_requests``: the requests whose state it keeps (the least recently used goes first)."""

    def __init__(
        self,
        head: DraftHead,
        lm_logits_after: Callable[[torch.Tensor, torch.Tensor | None], Callable[[torch.Tensor], torch.Tensor]],
        embed_rows: Callable[[torch.Tensor], torch.Tensor],
        draft_vocab: torch.Tensor | None = None,
        max_requests: int = 4096,
    ) -> None:
        self.head = head
        param = next(head.parameters())
        self.device, self.dtype = param.device, param.dtype
        # [K] int64 sorted, the tokens of the logits' columns, on the head's device and on the host (None: all tokens)
        self.columns = None if draft_vocab is None else draft_vocab.to(self.device)
        self.columns_on_host = None if draft_vocab is None else draft_vocab.cpu().numpy()
        # the head's last product and the LM head as one: logits of the final state  # [N, hidden] -> [N, K]
        self.logits = lm_logits_after(head.out.weight, draft_vocab)
        self.embed_rows = embed_rows
        self.max_requests = max_requests
        self._states: OrderedDict[str, _State] = OrderedDict()

    def release(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def _serial(self) -> contextlib.AbstractContextManager:
        """Where the head's products run on the CPU kernels' team (with their own threads), its small PyTorch
        operations around them on one thread (why: :func:`~specinfer.models.on_device.serial_on_cpu`)."""
        return serial_on_cpu(self.device) if self.head.on_cpu_kernels else contextlib.nullcontext()

    @torch.inference_mode()
    def absorb(self, request_id: str, committed: Sequence[int], start: int, features: torch.Tensor) -> None:
        """The request's committed tokens are now ``committed`` and the LLM computed ``features``
        # [m, feature_dim] of positions ``start .. start + m - 1``, the last being ``len(committed) - 1``:
        cache the pairs this completes and keep the features for the next draft."""
        if start + features.shape[0] != len(committed) or start < 0:
            raise ValueError(
                f"features of positions {start}.. must end at the last committed token {len(committed) - 1}"
            )
        with self._serial():
            self._absorb(request_id, committed, start, features)

    def _absorb(self, request_id: str, committed: Sequence[int], start: int, features: torch.Tensor) -> None:
        state = self._state(request_id, committed)
        features = features.to(self.dtype)
        first = state.positions[-1] + 1 if state.positions else 0
        wanted, rows = [], []
        for j in range(first, len(committed) - 1):  # pair j: the feature at j and token j + 1
            row = features[j - start] if j >= start else state.feature(j)
            if row is not None:  # else a hole: a position the LLM took from its prefix cache
                wanted.append(j)
                rows.append(row)
        if wanted:
            nexts = torch.tensor([committed[j + 1] for j in wanted], device=self.device)
            x = self.head.inputs(torch.stack(rows), self.embed_rows(nexts).to(self.dtype))
            _, k, v = self.head.keys_values(x, torch.tensor(wanted, device=self.device), wanted[-1] + 1)
            state.keys = torch.cat([state.keys, k])
            state.values = torch.cat([state.values, v])
            state.positions.extend(wanted)
        kept = state.recent[: max(0, start - state.recent_start)]  # the features before this call's
        if kept.shape[0] and state.recent_start + kept.shape[0] == start:
            recent, recent_start = torch.cat([kept, features]), state.recent_start
        else:
            recent, recent_start = features, start
        cut = max(0, recent.shape[0] - RECENT_FEATURES)
        state.recent, state.recent_start = recent[cut:], recent_start + cut
        state.tokens = list(committed)
        state.round = None

    def _state(self, request_id: str, committed: Sequence[int]) -> _State:
        """The request's state, cut back to what ``committed`` still agrees with (a request that went back:
        output dropped after a failure, or resumed elsewhere and back), most recently used."""
        state = self._states.get(request_id)
        if state is None:
            c = self.head.config
            empty = torch.empty(0, c.kv_heads, c.head_dim, dtype=self.dtype, device=self.device)
            recent = torch.empty(0, c.feature_dim, dtype=self.dtype, device=self.device)
            state = self._states[request_id] = _State([], empty, empty, recent)
            while len(self._states) > self.max_requests:
                self._states.popitem(last=False)
        self._states.move_to_end(request_id)
        same = 0
        for a, b in zip(state.tokens, committed, strict=False):
            if a != b:
                break
            same += 1
        if same < len(state.tokens):  # pair j holds token j + 1: keep the pairs below same - 1, features below same
            keep = sum(1 for j in state.positions if j + 1 < same)
            state.keys, state.values = state.keys[:keep], state.values[:keep]
            del state.positions[keep:]
            state.tokens = state.tokens[:same]
            state.recent = state.recent[: max(0, same - state.recent_start)]
        return state

    def can_draft(self, request_id: str, context: Sequence[int]) -> bool:
        """Whether the head holds the feature at ``context``'s last token for this request (it drafts from it)."""
        state = self._states.get(request_id)
        return (
            state is not None
            and state.last is not None
            and len(state.tokens) == len(context)
            and state.tokens[-8:] == list(context[-8:])
        )

    @torch.inference_mode()
    def forward_tree(self, batch: Sequence[TreeForward]) -> list[torch.Tensor]:
        """Logits (the LLM's LM head on the head's predicted features) of each item's new nodes, which
        follow :class:`~specinfer.models.interface.TreeForward`'s rules; the context is what
        :meth:`absorb` last gave (:meth:`can_draft`); -inf outside the draft vocabulary.
        # each [n_new, vocab] float32"""
        rows = self.forward_tree_columns(batch)
        if self.columns is None:
            return rows
        vocab = self.head.config.vocab_size
        return [r.new_full((len(r), vocab), float("-inf")).index_copy_(1, self.columns, r) for r in rows]

    @torch.inference_mode()
    def forward_tree_columns(self, batch: Sequence[TreeForward]) -> list[torch.Tensor]:
        """:meth:`forward_tree`'s logits at the tokens :attr:`columns` alone (greedy drafting needs no others: a
        tenth of the row to rank where a draft vocabulary is a tenth of the vocabulary). # each [n_new, K] float32"""
        if not batch:
            return []
        with self._serial():
            return self._forward(batch)

    def _forward(self, batch: Sequence[TreeForward]) -> list[torch.Tensor]:
        inputs, positions, parents_of, rounds = [], [], [], []
        for item in batch:
            state = self._states[item.request_id]
            if not self.can_draft(item.request_id, item.context_tokens):
                raise ValueError(f"request {item.request_id!r}: the head has no feature at its last context token")
            first = item.parents[0] if item.parents else -1
            if first < 0:  # a new round: its root, on the true feature at the last context token
                if len(item.parents) != 1:
                    raise ValueError("a round starts with its root alone (a child needs its parent's prediction)")
                rnd, feats, pos, anc = None, state.last[None], [len(item.context_tokens) - 1], [[]]
            else:  # children of nodes drafted in earlier calls of the round, on their parents' predictions
                rnd = state.round
                if rnd is None or min(item.parents) < 0 or max(item.parents) >= len(rnd.positions):
                    raise ValueError("node parents must be nodes drafted earlier in this round")
                feats = rnd.predicted.index_select(0, torch.tensor(item.parents, device=self.device))
                pos = [rnd.positions[p] + 1 for p in item.parents]
                anc = [[*rnd.ancestors[p], p] for p in item.parents]
            inputs.append(feats)
            rounds.append(rnd)
            positions.append(pos)
            parents_of.append(anc)
        tokens = torch.tensor([t for item in batch for t in item.tokens], device=self.device)
        x = self.head.inputs(torch.cat(inputs), self.embed_rows(tokens).to(self.dtype))  # [N, hidden]
        flat = [p for pos in positions for p in pos]
        q, k, v = self.head.keys_values(x, torch.tensor(flat, device=self.device), max(flat) + 1)
        attended, at = [], 0
        for item, rnd, anc in zip(batch, rounds, parents_of, strict=True):
            n = len(item.tokens)
            state = self._states[item.request_id]
            attended.append(self._attend(state, rnd, q[at : at + n], k[at : at + n], v[at : at + n], anc))
            at += n
        final = self.head.final_state(x, torch.cat(attended))  # [N, hidden]
        predicted = self.head.product(self.head.out, final)  # [N, feature_dim]
        at = 0
        for item, pos, anc in zip(batch, positions, parents_of, strict=True):
            n = len(item.tokens)
            self._remember(item, k[at : at + n], v[at : at + n], predicted[at : at + n], pos, anc)
            at += n
        logits = self.logits(final)  # [N, K]
        return list(logits.split([len(item.tokens) for item in batch]))

    def _attend(
        self, state: _State, rnd: _Round | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, anc
    ) -> torch.Tensor:
        """Attention of one request's new nodes  # q [n, heads, d], k/v [n, kv_heads, d]: each sees the
        committed pairs, its ancestors among the round's nodes ``rnd`` (drafted earlier) and itself.
        -> [n, heads, d]"""
        pending = 0 if rnd is None else len(rnd.positions)
        n = q.shape[0]
        keys = torch.cat([state.keys, *(() if rnd is None else (rnd.keys,)), k])  # [P + pending + n, kvh, d]
        values = torch.cat([state.values, *(() if rnd is None else (rnd.values,)), v])
        cached = state.keys.shape[0]
        tree = np.zeros((n, pending + n), dtype=bool)  # built on the host: one copy, not an indexing op per entry
        for i, ancestors in enumerate(anc):
            tree[i, ancestors] = True
            tree[i, pending + i] = True
        mask = torch.cat(
            [torch.ones(n, cached, dtype=torch.bool, device=self.device), torch.from_numpy(tree).to(self.device)], 1
        )
        c = self.head.config
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            keys.transpose(0, 1)[None],
            values.transpose(0, 1)[None],
            attn_mask=mask[None, None],
            enable_gqa=c.heads != c.kv_heads,
        )  # [1, heads, n, d]
        return out[0].transpose(0, 1)

    def _remember(self, item: TreeForward, k, v, predicted, positions: list[int], ancestors: list[list[int]]) -> None:
        """The call's nodes join their request's round (a round starts at a node attached to the context)."""
        state = self._states[item.request_id]
        rnd = state.round
        if item.parents[0] < 0 or rnd is None:  # a new round
            state.round = _Round(k, v, predicted, list(positions), list(ancestors))
            return
        state.round = _Round(
            torch.cat([rnd.keys, k]),
            torch.cat([rnd.values, v]),
            torch.cat([rnd.predicted, predicted]),
            [*rnd.positions, *positions],
            [*rnd.ancestors, *ancestors],
        )


class WithHead:
    """An LLM with its draft head: a :class:`~specinfer.models.interface.CausalLM` (the LLM's, by delegation)
    whose :meth:`release` forgets a request in both, and which
    :func:`~specinfer.models.verification.verify_trees` verifies with features, drafting the next trees with
    ``head``."""

    def __init__(self, llm: NativeBackend, head: HeadDrafter) -> None:
        self.llm = llm
        self.head = head

    def __getattr__(self, name: str):  # everything else is the LLM's
        return getattr(self.llm, name)

    def release(self, request_id: str) -> None:
        self.llm.release(request_id)
        self.head.release(request_id)


def with_head(llm: CausalLM, path: str | Path, llm_path: str | Path | None = None) -> WithHead:
    """``llm`` with the draft head of the checkpoint folder ``path``, in the LLM's dtype on its device.
    Raises :class:`~specinfer.core.errors.InvalidArgument` naming ``head`` when the head does not fit the LLM
    (the native backend in one process only; feature width, vocabulary, or, given the LLM's folder
    ``llm_path``, another LLM than the one it was trained for)."""
    import json

    from specinfer.core.errors import InvalidArgument
    from specinfer.models.draft_head import is_head_dir, llm_signature, load_draft_vocab, load_head
    from specinfer.models.native.backend import NativeBackend

    if not isinstance(llm, NativeBackend):
        raise InvalidArgument("head", "a draft head drafts from the native backend's features (--backend native)")
    if not is_head_dir(path):
        raise InvalidArgument("head", f"{path} is not a draft-head folder (specinfer train-head writes one)")
    feature_dim = llm.feature_dim  # refuses a parallel group first
    head = load_head(path, llm.options.dtype, llm.device)
    c = head.config
    if (c.feature_dim, c.vocab_size) != (feature_dim, llm.vocab_size):
        raise InvalidArgument(
            "head",
            f"{path} drafts for features of width {c.feature_dim} and {c.vocab_size} tokens; this LLM has "
            f"{feature_dim} and {llm.vocab_size}",
        )
    if llm_path is not None and c.llm:
        signature = llm_signature(json.loads((Path(llm_path) / "config.json").read_text()))
        if c.llm != signature:
            raise InvalidArgument(
                "head", f"{path} was trained for the LLM {c.llm}, not {signature} (specinfer train-head trains one)"
            )
    try:
        draft_vocab = load_draft_vocab(path, c.vocab_size)
    except ValueError as exc:
        raise InvalidArgument("head", str(exc)) from None
    # on the CPU the head's products and its logits run on the kernels' team, with the threads of the LLM's steps (a
    # service loads its model in the thread that runs it, with its thread count)
    threads = torch.get_num_threads() if torch.device(llm.device).type == "cpu" else 0
    threads = threads if head.cpu_products(threads) else 0
    drafter = HeadDrafter(head, functools.partial(llm.lm_logits_after, threads=threads), llm.embed_rows, draft_vocab)
    return WithHead(llm, drafter)
