"""The one protobuf <-> core conversion module.

Servicers translate messages with these functions and nothing else; every validation error
is an :class:`InvalidArgument` naming the field as the public API spells it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from specinfer.core import (
    DraftGroup,
    DraftTree,
    ExpansionConfig,
    InvalidArgument,
    SamplingParams,
    SparseDist,
    TokenTree,
    VerifyResult,
)
from specinfer.core.costs import CostTable
from specinfer.core.drafts import DEFAULT_DRAFT_SUPPORT
from specinfer.core.dynamic_trees import TreeBudget
from specinfer.core.errors import check_positions, check_token_ids
from specinfer.core.iteration import DraftSpec, HeadDraft, VerifySpec
from specinfer.core.kv_budget import KVBudget
from specinfer.core.requests import TokenLogprob, check_logprobs
from specinfer.v1 import api_pb2, internal_pb2


def _prefixed(field: str, fn):
    try:
        return fn()
    except InvalidArgument as exc:
        raise InvalidArgument(f"{field}.{exc.field}", exc.message) from exc


def sampling_from_proto(
    msg: api_pb2.SamplingParams, field: str = "sampling", vocab_size: int | None = None
) -> SamplingParams:
    """Unset ``top_p`` (0) means 1: proto3 cannot tell 0 from unset, and 0 is invalid anyway. With ``vocab_size``,
    ``logit_bias`` must name tokens of that vocabulary (a draft model's may be smaller: it ignores the others)."""
    seed = msg.seed if msg.HasField("seed") else None
    top_p = msg.top_p if msg.top_p != 0 else 1.0
    verification = msg.verification or "auto"
    if vocab_size is not None:
        check_token_ids(f"{field}.logit_bias", list(msg.logit_bias), vocab_size)
    return _prefixed(
        field,
        lambda: SamplingParams(
            temperature=float(msg.temperature),
            top_k=int(msg.top_k),
            top_p=float(top_p),
            seed=seed,
            verification=verification,
            presence_penalty=float(msg.presence_penalty),
            frequency_penalty=float(msg.frequency_penalty),
            repetition_penalty=float(msg.repetition_penalty) if msg.repetition_penalty != 0 else 1.0,
            min_p=float(msg.min_p),
            logit_bias=tuple(sorted((int(t), float(b)) for t, b in msg.logit_bias.items())),
        ),
    )


def skip_special_tokens_from_proto(msg: api_pb2.GenerateRequest) -> bool:
    """Whether the request's text leaves special tokens out: unset (proto3 ``optional``) means yes."""
    return msg.skip_special_tokens if msg.HasField("skip_special_tokens") else True


def sampling_to_proto(params: SamplingParams) -> api_pb2.SamplingParams:
    msg = api_pb2.SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        min_p=params.min_p,
        logit_bias=dict(params.logit_bias),
    )
    if params.repetition_penalty != 1.0:
        msg.repetition_penalty = params.repetition_penalty
    if params.verification != "auto":
        msg.verification = params.verification
    if params.seed is not None:
        msg.seed = params.seed
    return msg


def expansion_from_proto(widths: Sequence[int], field: str = "speculation.expansion") -> ExpansionConfig:
    try:
        return ExpansionConfig(tuple(int(w) for w in widths))
    except InvalidArgument as exc:
        raise InvalidArgument(field, exc.message) from exc


def draft_to_proto(draft: DraftTree) -> internal_pb2.DraftTree:
    msg = internal_pb2.DraftTree(tokens=draft.tree.tokens, parents=draft.tree.parents, scores=draft.scores)
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
        if not 0 <= g.parent < len(tree) or any(
            not g.parent < c < len(tree) or tree.parents[c] != g.parent for c in g.children
        ):
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
    scores = tuple(float(x) for x in msg.scores)
    if scores and (len(scores) != len(tree) or not all(0.0 <= x <= 1.0 for x in scores)):
        raise InvalidArgument(f"{field}.scores", "one score in [0, 1] per node, or none")
    return DraftTree(tree, tuple(groups), scores)


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
    return item


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
        _budget_to_proto(job.head.budget, item.head)
        item.head.draft_support = job.head.draft_support
    if job.logprobs is not None:
        item.logprobs = job.logprobs
    return item


def logprobs_from_proto(msg: api_pb2.GenerateRequest | internal_pb2.VerifyItem, field: str) -> int | None:
    """How many alternatives a request or verify item asks at each token (None: no logprobs)."""
    if not msg.HasField("logprobs"):
        return None
    check_logprobs(int(msg.logprobs), field)
    return int(msg.logprobs)


def token_logprobs_to_proto(logprobs: Sequence[TokenLogprob]) -> list[api_pb2.TokenLogprob]:
    return [
        api_pb2.TokenLogprob(
            token_id=lp.token,
            logprob=lp.logprob,
            top_token_ids=[t for t, _ in lp.top],
            top_logprobs=[v for _, v in lp.top],
        )
        for lp in logprobs
    ]


def token_logprobs_from_proto(messages: Sequence[api_pb2.TokenLogprob]) -> tuple[TokenLogprob, ...]:
    return tuple(
        TokenLogprob(
            int(m.token_id),
            float(m.logprob),
            tuple(zip(map(int, m.top_token_ids), map(float, m.top_logprobs), strict=True)),
        )
        for m in messages
    )


def head_draft_from_proto(item: internal_pb2.VerifyItem, field: str) -> HeadDraft | None:
    """The item's ask of the verifier's draft head, or None."""
    if not item.HasField("head"):
        return None
    budget = budget_from_proto(item.head, f"{field}.head")
    if budget is None:
        return None
    if item.head.draft_support <= 0:
        raise InvalidArgument(f"{field}.head.draft_support", "must be > 0")
    return HeadDraft(budget, int(item.head.draft_support))


# -- cost tables (start-up calibration, reported by GetInfo / ListModels) ----------------------


def cost_points_to_proto(table: CostTable | None) -> list[internal_pb2.CostPoint]:
    """A table's buckets as (tokens, seconds) points; none for no table (calibration off)."""
    if table is None:
        return []
    return [internal_pb2.CostPoint(tokens=t, seconds=s) for t, s in table.as_dict().items()]


def cost_table_from_proto(points: Sequence[internal_pb2.CostPoint]) -> CostTable | None:
    """The table the points describe; None when there are none or they make no sense (the caller calibrates itself)."""
    seconds = {
        int(p.tokens): float(p.seconds) for p in points if p.tokens > 0 and np.isfinite(p.seconds) and p.seconds >= 0
    }
    return CostTable(seconds) if seconds else None


def ssm_profiles_to_proto(
    names: Sequence[str],
    costs: Mapping[str, CostTable],
    priors: Mapping[str, Sequence[float]],
    budgets: Mapping[str, KVBudget | None],
    vocabularies: Mapping[str, str],
) -> list[internal_pb2.SsmProfile]:
    """ListModels' profile of each SSM: its calibrated draft costs, its slot prior (either may be missing), its KV
    budget and how its drafts reach the LLM's token IDs (:func:`specinfer.models.cross_vocab.vocabulary_method`)."""
    profiles = []
    for n in names:
        block_size, blocks = kv_budget_to_proto(budgets.get(n))
        draft_costs = cost_points_to_proto(costs.get(n))
        profiles.append(
            internal_pb2.SsmProfile(
                model=n,
                draft_costs=draft_costs,
                slot_prior=priors.get(n, ()),
                kv_block_size=block_size,
                kv_blocks=blocks,
                vocabulary=vocabularies.get(n, ""),
            )
        )
    return profiles


def kv_budget_to_proto(budget: KVBudget | None) -> tuple[int, int]:
    """The ``kv_block_size`` and ``kv_blocks`` fields of ``LlmInfo`` / ``SsmProfile`` (0, 0: no budget)."""
    return (budget.block_size, budget.blocks) if budget is not None else (0, 0)


def kv_budget_from_proto(msg: internal_pb2.LlmInfo | internal_pb2.SsmProfile) -> KVBudget | None:
    """The KV budget a service reported (None: bounded only by memory, or not reported); an SSM's
    (``SsmProfile``) holds what it expands while drafting (:attr:`KVBudget.drafts`)."""
    if msg.kv_block_size == 0 or msg.kv_blocks == 0:
        return None
    return KVBudget(msg.kv_block_size, msg.kv_blocks, drafts=isinstance(msg, internal_pb2.SsmProfile))


def slot_prior_from_proto(values: Sequence[float]) -> tuple[float, ...] | None:
    """A reported slot prior, or None when there is none or it is not a list of probabilities."""
    prior = tuple(float(v) for v in values)
    return prior if prior and all(0.0 <= v <= 1.0 for v in prior) else None


def pass_timings_to_proto(passes: Sequence[tuple[int, float]]) -> list[internal_pb2.PassTiming]:
    return [internal_pb2.PassTiming(frontier_tokens=n, seconds=s) for n, s in passes]


def pass_timings_from_proto(passes: Sequence[internal_pb2.PassTiming]) -> list[tuple[int, float]]:
    """(frontier tokens, seconds) of each SSM pass a worker reported."""
    return [
        (int(p.frontier_tokens), float(p.seconds))
        for p in passes
        if p.frontier_tokens > 0 and np.isfinite(p.seconds) and p.seconds >= 0
    ]


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
    )


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


def next_tree_from_proto(result: internal_pb2.VerifyResult, field: str) -> DraftTree | None:
    """The head tree a verify result carries for the next step, or None."""
    return draft_from_proto(result.next_tree, f"{field}.next_tree") if result.HasField("next_tree") else None
