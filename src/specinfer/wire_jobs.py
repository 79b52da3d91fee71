"""The items of the internal ``Speculate`` and ``Verify`` calls <-> the core's jobs, contexts and verdicts.

:mod:`specinfer.wire` converts the parts that messages share (sampling parameters, draft trees, logprobs,
the services' reports); this module converts whole items with them, on both ends of a call: the request
manager turns :class:`~specinfer.core.iteration.DraftSpec` / :class:`~specinfer.core.iteration.VerifySpec`
into items and reads the results; an SSM worker or LLM verifier validates the items it receives into
jobs on its own copy of the context, and answers with results. As in :mod:`specinfer.wire`, every
validation error is an :class:`InvalidArgument` naming the field.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from specinfer.core import DraftTree, InvalidArgument, VerifyResult
from specinfer.core.constraints import Constraint
from specinfer.core.drafts import DEFAULT_DRAFT_SUPPORT
from specinfer.core.dynamic_trees import TreeBudget
from specinfer.core.errors import check_positions, check_token_ids
from specinfer.core.iteration import DraftSpec, HeadDraft, VerifySpec
from specinfer.v1 import internal_pb2
from specinfer.wire import (
    draft_from_proto,
    draft_to_proto,
    expansion_from_proto,
    logprobs_from_proto,
    sampling_from_proto,
    sampling_to_proto,
    token_logprobs_to_proto,
)

# -- the request manager's side: the items it sends, the results it reads -------------------------


def draft_job_to_proto(job: DraftSpec, context: internal_pb2.Context) -> internal_pb2.SpeculateItem:
    """A Speculate item of ``job`` (``context``: what the worker lacks of the job's context)."""
    item = internal_pb2.SpeculateItem(
        context=context,
        root_token=job.root_token,
        sampling=sampling_to_proto(job.sampling),
        draft_support=job.draft_support,
        seed=job.seed,
        step=job.step,
        stream=job.stream,
        output_start=job.output_start,
    )
    if job.expansion is not None:
        item.expansion.extend(job.expansion.widths)
    if job.budget is not None:
        _budget_to_proto(job.budget, item)
    if job.constraint is not None:
        item.constraint.CopyFrom(constraint_to_proto(job.constraint))
    return item


def constraint_to_proto(c: Constraint) -> internal_pb2.Constraint:
    return internal_pb2.Constraint(kind=c.kind, text=c.text)


def _budget_to_proto(b: TreeBudget, item: internal_pb2.SpeculateItem | internal_pb2.HeadDraft) -> None:
    item.budget_nodes, item.budget_depth, item.budget_width, item.budget_min_score = (
        b.nodes,
        b.depth,
        b.max_width,
        b.min_score,
    )
    item.budget_edge_curve.extend(b.edge_curve)


def verify_job_to_proto(job: VerifySpec, context: internal_pb2.Context) -> internal_pb2.VerifyItem:
    """A Verify item of ``job`` (``context``: what the verifier lacks of the job's context)."""
    item = internal_pb2.VerifyItem(
        context=context,
        tree=draft_to_proto(job.draft),
        sampling=sampling_to_proto(job.sampling),
        seed=job.seed,
        step=job.step,
        output_start=job.output_start,
    )
    if job.head is not None:
        item.head.SetInParent()  # present with no budget: the head keeps up, drafting nothing
        if job.head.budget is not None:
            _budget_to_proto(job.head.budget, item.head)
        item.head.draft_support = job.head.draft_support
        if job.head.constraint is not None:
            item.head.constraint.CopyFrom(constraint_to_proto(job.head.constraint))
    if job.logprobs is not None:
        item.logprobs = job.logprobs
    if job.masks is not None:
        item.token_masks = np.ascontiguousarray(job.masks, dtype="<i4").tobytes()
    return item


def context_to_proto(request_id: str, context: Sequence[int], offset: int) -> internal_pb2.Context:
    """Context tokens from ``offset`` on (the callee is assumed to hold the rest)."""
    return internal_pb2.Context(request_id=request_id, offset=offset, tokens=context[offset:])


def next_tree_from_proto(result: internal_pb2.VerifyResult, field: str) -> DraftTree | None:
    """The head tree a verify result carries for the next step, or None."""
    return draft_from_proto(result.next_tree, f"{field}.next_tree") if result.HasField("next_tree") else None


# -- the services' side: the items an SsmWorker / LlmVerifier validates, the results it answers ----


# a dynamic tree's node budget: far above any plan, small enough that no message can make a worker draft without end
MAX_BUDGET_NODES = 1024


def budget_from_proto(item: internal_pb2.SpeculateItem | internal_pb2.HeadDraft, field: str) -> TreeBudget | None:
    """The item's dynamic tree budget, or None (``budget_nodes`` 0: a static tree of ``expansion``). A
    :class:`HeadDraft` has the same ``budget_*`` fields."""
    if item.budget_nodes == 0:
        return None
    if item.budget_nodes > MAX_BUDGET_NODES:
        raise InvalidArgument(f"{field}.budget_nodes", f"at most {MAX_BUDGET_NODES}, got {item.budget_nodes}")
    try:
        budget = TreeBudget(
            int(item.budget_nodes), int(item.budget_depth), int(item.budget_width), float(item.budget_min_score)
        )
    except ValueError as exc:
        raise InvalidArgument(f"{field}.budget_nodes", str(exc)) from exc
    if not item.budget_edge_curve:
        return budget
    try:
        return replace(budget, edge_curve=tuple(float(v) for v in item.budget_edge_curve))
    except ValueError as exc:
        raise InvalidArgument(f"{field}.budget_edge_curve", str(exc)) from exc


def head_draft_from_proto(item: internal_pb2.VerifyItem, field: str) -> HeadDraft | None:
    """The item's ask of the verifier's draft head (no budget: keep up, draft nothing), or None."""
    if not item.HasField("head"):
        return None
    budget = budget_from_proto(item.head, f"{field}.head")
    if budget is not None and item.head.draft_support <= 0:
        raise InvalidArgument(f"{field}.head.draft_support", "must be > 0")
    return HeadDraft(budget, int(item.head.draft_support), constraint_from_proto(item.head, f"{field}.head"))


def constraint_from_proto(item: internal_pb2.SpeculateItem | internal_pb2.HeadDraft, field: str) -> Constraint | None:
    """The item's constraint, or None (compiled where it is used: an invalid one is refused then, naming its kind)."""
    if not item.HasField("constraint"):
        return None
    try:
        return Constraint(item.constraint.kind, item.constraint.text)
    except InvalidArgument as exc:
        raise InvalidArgument(f"{field}.constraint.kind", exc.message) from None


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
            raise InvalidArgument(
                f"{field}[{i}].context.request_id", f"request {u.request_id!r} appears twice in one call"
            )
        seen.add(u.request_id)


def draft_job_from_proto(
    item: internal_pb2.SpeculateItem, context: Sequence[int], vocab_size: int, max_positions: int, field: str
) -> DraftSpec:
    """A :class:`DraftSpec` on ``context`` (the request's full context, resolved by the caller)
    with the random stream the item names; the tree must fit the model's positions."""
    (root,) = check_token_ids(f"{field}.root_token", [item.root_token], vocab_size)
    budget = budget_from_proto(item, field)
    if budget is not None and item.expansion:
        raise InvalidArgument(f"{field}.budget_nodes", "a draft has either an expansion or a budget, not both")
    expansion = expansion_from_proto(item.expansion, f"{field}.expansion") if budget is None else None
    sampling = sampling_from_proto(item.sampling, f"{field}.sampling")
    check_positions(
        len(context), budget.depth if budget is not None else expansion.depth, max_positions, f"{field}.context.tokens"
    )
    support = int(item.draft_support) or DEFAULT_DRAFT_SUPPORT
    return DraftSpec(
        item.context.request_id,
        list(context),
        root,
        expansion,
        sampling,
        support,
        int(item.seed),
        int(item.step),
        int(item.stream),
        budget,
        int(item.output_start),  # past the committed tokens it only means no output yet: nothing to check
        constraint_from_proto(item, field),
    )


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


def verify_job_from_proto(
    item: internal_pb2.VerifyItem, context: Sequence[int], vocab_size: int, max_positions: int, field: str
) -> VerifySpec:
    """A :class:`VerifySpec` on ``context`` (resolved by the caller) with the verifier's random
    stream of the step; the tree must fit the model's positions."""
    draft = draft_from_proto(item.tree, f"{field}.tree")
    sampling = sampling_from_proto(item.sampling, f"{field}.sampling", vocab_size)
    _check_draft(draft, sampling.greedy, vocab_size, f"{field}.tree")
    check_positions(len(context), int(draft.tree.depths.max()), max_positions, f"{field}.context.tokens")
    head = head_draft_from_proto(item, field)
    return VerifySpec(
        item.context.request_id,
        list(context),
        draft,
        sampling,
        int(item.seed),
        int(item.step),
        head,
        logprobs_from_proto(item, f"{field}.logprobs"),
        int(item.output_start),  # past the committed tokens it only means no output yet: nothing to check
        token_masks_from_proto(item.token_masks, len(draft.tree), vocab_size, f"{field}.token_masks"),
    )


def token_masks_from_proto(data: bytes, nodes: int, vocab_size: int, field: str) -> np.ndarray | None:
    """A verify item's grammar masks, one row per tree node (None: no grammar).  # [nodes, W] int32"""
    if not data:
        return None
    words = (vocab_size + 31) // 32
    if len(data) != nodes * words * 4:
        expected = nodes * words * 4
        raise InvalidArgument(field, f"holds {len(data)} bytes; {nodes} nodes of {words} int32 words take {expected}")
    masks = np.frombuffer(data, dtype="<i4").astype(np.int32).reshape(nodes, words)
    if not masks.any(axis=1).all():
        raise InvalidArgument(field, "a node allows no token")
    return masks


def speculate_result_to_proto(request_id: str, draft: DraftTree | None) -> internal_pb2.SpeculateResult:
    """``draft`` None: the worker lacked the request's context (cache miss)."""
    if draft is None:
        return internal_pb2.SpeculateResult(request_id=request_id, cache_miss=True)
    return internal_pb2.SpeculateResult(request_id=request_id, tree=draft_to_proto(draft))


def verify_result_to_proto(request_id: str, result: tuple[VerifyResult, int] | None) -> internal_pb2.VerifyResult:
    """``result``: the verdict and the context tokens the forward took from the prefix cache; None:
    cache miss. The root is not among ``accepted_tokens``; the bonus token comes separately."""
    if result is None:
        return internal_pb2.VerifyResult(request_id=request_id, cache_miss=True)
    verdict, prefix_hits = result
    message = internal_pb2.VerifyResult(
        request_id=request_id,
        accepted_tokens=verdict.accepted_tokens,
        bonus_token=verdict.bonus_token,
        prefix_hit_tokens=prefix_hits,
    )
    if verdict.next_tree is not None:
        message.next_tree.CopyFrom(draft_to_proto(verdict.next_tree))
    if verdict.logprobs is not None:
        message.logprobs.extend(token_logprobs_to_proto(verdict.logprobs))
    return message
