"""Protobuf <-> core conversions, of the parts that messages share: sampling parameters, expansions,
draft trees, logprobs, and what the services report of themselves (cost tables, KV budgets, slot priors,
pass timings). Whole items of the internal ``Speculate`` and ``Verify`` calls, built from these, are
:mod:`specinfer.wire_jobs`.

Servicers translate messages with these two modules and nothing else; every validation error
is an :class:`InvalidArgument` naming the field as the public API spells it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from specinfer.core import (
    DraftGroup,
    DraftTree,
    ExpansionConfig,
    InvalidArgument,
    SamplingParams,
    SparseDist,
    TokenTree,
)
from specinfer.core.costs import CostTable
from specinfer.core.errors import check_token_ids
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
