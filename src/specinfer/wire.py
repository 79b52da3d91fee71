"""The one protobuf <-> core conversion module.

Servicers translate messages with these functions and nothing else; every validation error
is an :class:`InvalidArgument` naming the field as the public API spells it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specinfer.core import DraftGroup, DraftTree, ExpansionConfig, InvalidArgument, SamplingParams, SparseDist, TokenTree, VerifyResult
from specinfer.core.drafts import DEFAULT_DRAFT_SUPPORT
from specinfer.core.errors import check_token_ids
from specinfer.core.iteration import DraftSpec, VerifySpec
from specinfer.v1 import api_pb2, internal_pb2


def _prefixed(field: str, fn):
    try:
        return fn()
    except InvalidArgument as exc:
        raise InvalidArgument(f"{field}.{exc.field}", exc.message) from exc


def sampling_from_proto(msg: api_pb2.SamplingParams, field: str = "sampling") -> SamplingParams:
    """Unset ``top_p`` (0) means 1: proto3 cannot tell 0 from unset, and 0 is invalid anyway."""
    seed = msg.seed if msg.HasField("seed") else None
    top_p = msg.top_p if msg.top_p != 0 else 1.0
    return _prefixed(field, lambda: SamplingParams(temperature=float(msg.temperature), top_k=int(msg.top_k), top_p=float(top_p), seed=seed))


def sampling_to_proto(params: SamplingParams) -> api_pb2.SamplingParams:
    msg = api_pb2.SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
    if params.seed is not None:
        msg.seed = params.seed
    return msg


def expansion_from_proto(widths: Sequence[int], field: str = "speculation.expansion") -> ExpansionConfig:
    try:
        return ExpansionConfig(tuple(int(w) for w in widths))
    except InvalidArgument as exc:
        raise InvalidArgument(field, exc.message) from exc


def draft_to_proto(draft: DraftTree) -> internal_pb2.DraftTree:
    msg = internal_pb2.DraftTree(tokens=draft.tree.tokens, parents=draft.tree.parents)
    for g in draft.groups:
        group = msg.groups.add(parent=g.parent, children=g.children)
        if g.q is not None:
            group.q_tokens.extend(int(t) for t in g.q.tokens)
            group.q_probs.extend(float(p) for p in g.q.probs)
    return msg


def draft_from_proto(msg: internal_pb2.DraftTree, field: str = "tree") -> DraftTree:
    try:
        tree = TokenTree(tuple(msg.tokens), tuple(msg.parents))
    except ValueError as exc:
        raise InvalidArgument(field, str(exc)) from exc
    groups = []
    for i, g in enumerate(msg.groups):
        if not 0 <= g.parent < len(tree) or any(not g.parent < c < len(tree) or tree.parents[c] != g.parent for c in g.children):
            raise InvalidArgument(f"{field}.groups[{i}]", "children must be nodes whose parent is the group's parent")
        q = None
        if g.q_tokens:
            if len(g.q_tokens) != len(g.q_probs):
                raise InvalidArgument(f"{field}.groups[{i}]", "q_tokens and q_probs differ in length")
            probs = np.asarray(g.q_probs, dtype=np.float64)
            if np.any(probs < 0) or not np.isfinite(probs).all() or probs.sum() <= 0:
                raise InvalidArgument(f"{field}.groups[{i}].q_probs", "must be finite, non-negative and not all zero")
            # float32 on the wire: renormalise in float64 so verification sees a distribution
            q = SparseDist(np.asarray(g.q_tokens, dtype=np.int64), probs / probs.sum())
        groups.append(DraftGroup(int(g.parent), tuple(int(c) for c in g.children), q))
    return DraftTree(tree, tuple(groups))


def context_to_proto(request_id: str, context: Sequence[int], offset: int) -> internal_pb2.Context:
    """Context tokens from ``offset`` on (the callee is assumed to hold the rest)."""
    return internal_pb2.Context(request_id=request_id, offset=offset, tokens=context[offset:])


# -- service side: validation of what SsmWorker / LlmVerifier receive --------------------------


@dataclass(frozen=True)
class ContextUpdate:
    """A validated :class:`internal_pb2.Context`: context tokens ``[offset, offset + len(tokens))``."""

    request_id: str
    offset: int
    tokens: tuple[int, ...]


def context_from_proto(msg: internal_pb2.Context, vocab_size: int, field: str = "context") -> ContextUpdate:
    if not msg.request_id:
        raise InvalidArgument(f"{field}.request_id", "must not be empty")
    return ContextUpdate(msg.request_id, int(msg.offset), check_token_ids(f"{field}.tokens", msg.tokens, vocab_size))


def check_distinct_requests(updates: Sequence[ContextUpdate], field: str = "items") -> None:
    """One item per request and call: a model batch holds each request's cache once."""
    seen: set[str] = set()
    for i, u in enumerate(updates):
        if u.request_id in seen:
            raise InvalidArgument(f"{field}[{i}].context.request_id", f"request {u.request_id!r} appears twice in one call")
        seen.add(u.request_id)


def check_positions(context_len: int, depth: int, max_positions: int, field: str) -> None:
    """The deepest tree node sits at position ``context_len + depth``; the model has ``max_positions``."""
    if context_len + depth >= max_positions:
        raise InvalidArgument(field, f"context of {context_len} tokens plus a tree of depth {depth} exceeds the model's {max_positions} positions")


def draft_job_from_proto(item: internal_pb2.SpeculateItem, context: Sequence[int], vocab_size: int, max_positions: int, field: str) -> DraftSpec:
    """A :class:`DraftSpec` on ``context`` (the request's full context, resolved by the caller)
    with the random stream the item names; the tree must fit the model's positions."""
    (root,) = check_token_ids(f"{field}.root_token", [item.root_token], vocab_size)
    expansion = expansion_from_proto(item.expansion, f"{field}.expansion")
    sampling = sampling_from_proto(item.sampling, f"{field}.sampling")
    check_positions(len(context), expansion.depth, max_positions, f"{field}.context.tokens")
    support = int(item.draft_support) or DEFAULT_DRAFT_SUPPORT
    return DraftSpec(item.context.request_id, list(context), root, expansion, sampling, support, int(item.seed), int(item.step), int(item.stream))


def _check_draft(draft: DraftTree, greedy: bool, vocab_size: int, field: str) -> None:
    """Token IDs in range and, under sampling, the draft distributions verification divides by."""
    check_token_ids(f"{field}.tokens", draft.tree.tokens, vocab_size)
    if greedy:
        return
    for i, g in enumerate(draft.groups):
        if g.q is None:
            raise InvalidArgument(f"{field}.groups[{i}]", "sampling needs the draft distribution (q_tokens, q_probs)")
        check_token_ids(f"{field}.groups[{i}].q_tokens", g.q.tokens.tolist(), vocab_size)
        if len(set(g.q.tokens.tolist())) != len(g.q.tokens):
            raise InvalidArgument(f"{field}.groups[{i}].q_tokens", "must be distinct")
        if any(g.q.prob_of(draft.tree.tokens[c]) <= 0 for c in g.children):
            raise InvalidArgument(f"{field}.groups[{i}]", "every child must have a positive draft probability")
    grouped = {g.parent for g in draft.groups}
    for node, kids in enumerate(draft.tree.children):
        if kids and node not in grouped:
            raise InvalidArgument(f"{field}.groups", f"node {node} has children but no draft group")


def verify_job_from_proto(item: internal_pb2.VerifyItem, context: Sequence[int], vocab_size: int, max_positions: int, field: str) -> VerifySpec:
    """A :class:`VerifySpec` on ``context`` (resolved by the caller) with the verifier's random
    stream of the step; the tree must fit the model's positions."""
    draft = draft_from_proto(item.tree, f"{field}.tree")
    sampling = sampling_from_proto(item.sampling, f"{field}.sampling")
    _check_draft(draft, sampling.greedy, vocab_size, f"{field}.tree")
    check_positions(len(context), int(draft.tree.depths.max()), max_positions, f"{field}.context.tokens")
    return VerifySpec(item.context.request_id, list(context), draft, sampling, int(item.seed), int(item.step))


def speculate_result_to_proto(request_id: str, draft: DraftTree | None) -> internal_pb2.SpeculateResult:
    """``draft`` None: the worker lacked the request's context (cache miss)."""
    if draft is None:
        return internal_pb2.SpeculateResult(request_id=request_id, cache_miss=True)
    return internal_pb2.SpeculateResult(request_id=request_id, tree=draft_to_proto(draft))


def verify_result_to_proto(request_id: str, result: VerifyResult | None) -> internal_pb2.VerifyResult:
    """``result`` None: cache miss. The root is not among ``accepted_tokens``; the bonus token comes separately."""
    if result is None:
        return internal_pb2.VerifyResult(request_id=request_id, cache_miss=True)
    return internal_pb2.VerifyResult(request_id=request_id, accepted_tokens=result.accepted_tokens, bonus_token=result.bonus_token)
