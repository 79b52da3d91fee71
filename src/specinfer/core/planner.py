"""The speculation planner: each iteration, how many tree nodes each request gets and which SSM drafts them.

One pure function, :func:`plan_batch`, used by the in-process engine and by the request
manager. It maximises the batch's expected committed tokens per second, draft cost included:

- Each request r, drafting with SSM s, has *node values* (:func:`~specinfer.core.acceptance.node_values`):
  the expected acceptance of the best-first tree's nodes, best first. Its tree of n + 1 nodes is
  expected to commit ``1 + v_1 + ... + v_n`` tokens (the bonus token always comes).
- Per request the SSM is the one with the best tokens per second alone; then every request's
  nodes are merged best first, so extra nodes go where they are worth most. For each total N of
  extra nodes the iteration is expected to take ``verify(batch tokens + N, context work) + the SSM
  passes over the frontiers those nodes imply + overhead`` (:class:`~specinfer.core.costs.StepCosts`);
  the planner takes the N with the most expected tokens per second. N = 0 (no speculation: each
  request verifies its root alone and no SSM runs) is always a candidate, so where speculation
  does not pay the plan says so.
- Hysteresis: the previous iteration's N is kept unless another is ``hysteresis`` better, so
  budgets do not thrash on noise.
- ``min_value``: the acceptance a node must reach to pay for its verify tokens at the planned rate
  (rate x the marginal seconds of the plan's last token); the draft tree builder drops slots
  predicted below it, so a step whose SSM is unsure verifies a smaller tree than planned.

The plan works from average acceptances; the trees the SSMs then draft carry each node's own
predicted acceptance (from its score). :func:`select_nodes`, the second pure function, runs after
drafting and before verification: it merges the drafted nodes of the batch best first and keeps
the count with the most expected tokens per second, now with the real nodes. That matters where
the verify cost is not linear: on a CPU, 4 rows of a matrix product cost little more than 1 but 6
cost far more than 4, so a plan for 28 extra nodes (where each costs little) that the builder cut
to 2 unsure ones (where each costs much) would otherwise be verified as drafted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from specinfer.core.acceptance import NodeValues
from specinfer.core.costs import NO_TOKENS, StepCosts, VerifyShape
from specinfer.core.head_gate import HeadGateConfig


@dataclass(frozen=True)
class PlannerConfig:
    """``max_nodes``: most tree nodes per request (root included); ``max_depth``: most depths
    (SSM passes); ``hysteresis``: relative gain needed to leave the previous plan's size;
    ``head_gate``: when steps ask the verifier's draft head for next trees (:mod:`specinfer.core.head_gate`:
    whichever of asking or not measures more committed tokens per second at the batch size);
    ``speculation_gate``: the same measured choice between speculating for the adaptive requests and not at all
    (their roots alone), per batch-size bucket: the backstop where the cost model's plan still loses (a CPU whose
    verify cost grows with tokens, at a large batch); speculation is measured first at every batch size, unless a
    smaller batch size measured it less than 10 % faster than its roots alone;
    ``explore_costs``: every this many iterations plan and cut on the cost model's optimistic copy
    (:meth:`~specinfer.core.costs.StepCosts.optimistic`), so sizes that no real step measured, whose seed
    may be a calibration taken under load, get measured (0: never)."""

    max_nodes: int = 32
    max_depth: int = 8
    hysteresis: float = 0.05
    head_gate: HeadGateConfig = HeadGateConfig()
    speculation_gate: HeadGateConfig = HeadGateConfig(explore_every=32, first_on_max_batch=1 << 16, first_on_margin=0.1)
    explore_costs: int = 8

    def __post_init__(self) -> None:
        if self.max_nodes < 1 or self.max_depth < 0 or not 0.0 <= self.hysteresis < 1.0 or self.explore_costs < 0:
            raise ValueError(f"invalid planner config {self}")


# Offloaded verifiers (docs/offloading.md): a verify step costs a transfer of the model whatever its
# tokens, so the caps are what limits trees; these let the planner grow them as far as acceptance pays
# (the native backend's default 256 tree rows per request hold them).
OFFLOAD_PLANNER = PlannerConfig(max_nodes=128, max_depth=16)


@dataclass(frozen=True)
class PlanInput:
    """One request the planner may speculate for: its committed length ``context_len``, tokens it may
    still generate (``remaining``), and its node values for each SSM it allows."""

    request_id: str
    context_len: int
    remaining: int
    options: Mapping[int, NodeValues]


@dataclass(frozen=True)
class RequestPlan:
    """``nodes``: tree nodes with the root (1: no speculation, no SSM call); ``ssm``: who drafts
    (None when ``nodes == 1``); ``depth``: most depths; ``predicted_accepted``: expected accepted tokens."""

    ssm: int | None
    nodes: int
    depth: int
    predicted_accepted: float


@dataclass(frozen=True)
class BatchPlan:
    requests: Mapping[str, RequestPlan]
    extra_nodes: int  # N: tree nodes beyond the roots, over the planned requests
    predicted_seconds: float
    predicted_tokens_per_second: float
    min_value: float  # the acceptance a node must reach to be worth verifying


def _within_depth(values: NodeValues, depth_cap: int) -> NodeValues:
    """The nodes of ``values`` at most ``depth_cap`` deep: still best first with parents before
    children (a node's ancestors are shallower), parents renumbered. Filtering, not cutting at the
    first deeper node: the shallow siblings listed after it are as usable as those before it."""
    keep = np.nonzero(values.depths <= depth_cap)[0]
    if keep.size == len(values.depths):
        return values
    index = np.full(len(values.depths) + 1, -1, dtype=np.int64)  # the extra -1 maps parent -1 to -1
    index[keep] = np.arange(keep.size)
    return NodeValues(values.values[keep], values.depths[keep], index[values.parents[keep]])


class _Frontiers:
    """Draft seconds as planned nodes join, one at a time: a node whose parent is not expanded yet
    puts the parent on the frontier of the node's pass, which then costs its SSM one more token.
    ``most``: the largest frontier it will be asked about (the candidate nodes)."""

    def __init__(self, costs: StepCosts, most: int) -> None:
        self.costs = costs
        self.most = most
        self._sizes: dict[tuple[int, int], int] = {}  # (ssm, pass) -> frontier tokens
        self._expanded: set[tuple[int, int]] = set()  # (request, parent index) already on a frontier
        # each SSM's pass seconds by frontier size 0..most, read once per plan: one table read per
        # candidate node made a batch-16 plan take 10-18 ms
        self._seconds: dict[int, list[float]] = {}

    def _table(self, ssm: int) -> list[float]:
        if ssm not in self._seconds:
            sizes = np.arange(self.most + 2)
            table = self.costs.drafts.get(ssm)
            self._seconds[ssm] = table.many(sizes).tolist() if table is not None else [0.0] * len(sizes)
        return self._seconds[ssm]

    def add(self, ssm: int, request: int, values: NodeValues, k: int) -> float:
        """The draft seconds node ``k`` of ``values`` (request ``request``, drafted by ``ssm``) adds."""
        key = (request, int(values.parents[k]))
        if key in self._expanded:
            return 0.0
        self._expanded.add(key)
        slot = (ssm, int(values.depths[k]))
        before = self._sizes.get(slot, 0)
        self._sizes[slot] = before + 1
        seconds = self._table(ssm)  # a frontier never holds more than the nodes added: before + 1 <= most
        return seconds[before + 1] - seconds[before]


def _choose_ssm(inp: PlanInput, costs: StepCosts, config: PlannerConfig) -> tuple[int | None, int]:
    """The SSM with the best tokens per second for this request alone, and its usable node count."""
    best: tuple[float, int | None, int] = (-1.0, None, 0)
    for ssm, values in sorted(inp.options.items()):
        n = min(len(values.values), config.max_nodes - 1)  # plan_batch already dropped nodes past the depth caps
        if n <= 0:
            continue
        gained = np.concatenate(([0.0], np.cumsum(values.values[:n])))
        k = np.arange(n + 1)
        verify = costs.verify_many(1 + k, (1 + k) * inp.context_len)
        frontiers = _Frontiers(costs, n)
        draft = np.concatenate(([0.0], np.cumsum([frontiers.add(ssm, 0, values, j) for j in range(n)])))
        rate = float(np.max((1.0 + gained) / (verify + draft + costs.overhead)))
        if rate > best[0]:
            best = (rate, ssm, n)
    return best[1], best[2]


def beside_prompts(
    costs: StepCosts, tokens: np.ndarray, work: np.ndarray, prompts: VerifyShape = NO_TOKENS
) -> np.ndarray:
    """Verify seconds of calls of ``tokens`` with context ``work`` (the first entry: the call without speculation),
    when the call also computes ``prompts``' rows (a request's first step), less what those cost the call without
    speculation: a prompt is computed whatever the trees, so its cost is not the plan's, but where rows cost more as a
    call grows (a CPU past the size its weights stream at), a node beside it costs what it adds on top of it.
    # like tokens"""
    if not prompts.tokens:
        return costs.verify_many(tokens, work)
    verify = costs.verify_many(tokens + prompts.tokens, work + prompts.context_work)
    return verify - (verify[0] - costs.verify_seconds(VerifyShape(int(tokens[0]), int(work[0]))))


def plan_batch(
    inputs: Sequence[PlanInput],
    costs: StepCosts,
    config: PlannerConfig,
    fixed: VerifyShape = NO_TOKENS,
    previous_extra: int | None = None,
    prompts: VerifyShape = NO_TOKENS,
) -> BatchPlan:
    """Plan one iteration for ``inputs``; ``fixed``: the verify tokens and context work of the
    batch's requests with static trees (or none); ``prompts``: the rows of the prompts the call computes
    (:func:`beside_prompts`)."""
    # never draft past a request's token budget (the bonus token comes on top) nor the depth cap
    inputs = [
        PlanInput(
            inp.request_id,
            inp.context_len,
            inp.remaining,
            {s: _within_depth(v, min(config.max_depth, inp.remaining - 1)) for s, v in inp.options.items()},
        )
        for inp in inputs
    ]
    base_tokens = fixed.tokens + len(inputs)
    base_work = fixed.context_work + sum(inp.context_len for inp in inputs)
    # every candidate node: (value, request, its index in the request's list)
    chosen_ssm: dict[str, int | None] = {}
    items: list[tuple[float, int, int]] = []
    for r, inp in enumerate(inputs):
        ssm, n = _choose_ssm(inp, costs, config)
        chosen_ssm[inp.request_id] = ssm
        if ssm is not None:
            items.extend((float(v), r, k) for k, v in enumerate(inp.options[ssm].values[:n]))
    items.sort(
        key=lambda it: (-it[0], it[1], it[2])
    )  # a node never precedes its parent: its value is no larger, its index is later

    # cumulative value, tokens, context work and draft seconds of the first N items, N = 0..len
    total = len(items)
    value = np.zeros(total + 1)
    work = np.full(total + 1, float(base_work))
    draft = np.zeros(total + 1)
    frontiers = _Frontiers(costs, total)
    for i, (v, r, k) in enumerate(items):
        inp = inputs[r]
        ssm = chosen_ssm[inp.request_id]
        value[i + 1] = value[i] + v
        work[i + 1] = work[i] + inp.context_len
        draft[i + 1] = draft[i] + frontiers.add(ssm, r, inp.options[ssm], k)
    tokens = base_tokens + np.arange(total + 1)
    verify = beside_prompts(costs, tokens, work, prompts)
    seconds = verify + draft + costs.overhead
    committed = len(inputs) + value
    rates = committed / np.maximum(seconds, 1e-12)
    best = int(np.argmax(rates))
    if (
        previous_extra is not None
        and 0 <= previous_extra <= total
        and rates[previous_extra] >= (1.0 - config.hysteresis) * rates[best]
    ):
        best = previous_extra

    counts: dict[int, list[int]] = {}
    for _, r, k in items[:best]:
        counts.setdefault(r, []).append(k)
    plans: dict[str, RequestPlan] = {}
    for r, inp in enumerate(inputs):
        ks = counts.get(r, [])
        if not ks:
            plans[inp.request_id] = RequestPlan(None, 1, 0, 0.0)
            continue
        values = inp.options[chosen_ssm[inp.request_id]]
        plans[inp.request_id] = RequestPlan(
            chosen_ssm[inp.request_id], 1 + len(ks), int(values.depths[ks].max()), float(values.values[ks].sum())
        )
    context = base_work / max(1, base_tokens)
    min_value = _min_value(costs, int(tokens[best]) + prompts.tokens, context, float(rates[best]))
    return BatchPlan(plans, best, float(seconds[best]), float(rates[best]), min_value)


def _min_value(costs: StepCosts, tokens: int, context: float, rate: float) -> float:
    """The least expected acceptance a node must have to pay at the planned ``rate`` (tokens per second): its
    marginal verify seconds, those of the plan's last token of a call of ``tokens`` (a mean ``context`` each). Not
    of the next one, past the plan: that is the node that did not pay, and where the table bends just after the
    plan (flat to 16 tokens, steep after, as on a CPU with AMX) its cost would cut most of the nodes the plan chose."""
    marginal = costs.verify_seconds(VerifyShape(tokens, 0)) - costs.verify_seconds(VerifyShape(max(1, tokens - 1), 0))
    return float(np.clip(rate * (marginal + costs.per_context * context), 0.0, 1.0))


@dataclass(frozen=True)
class DraftedNodes:
    """One request's drafted tree, as :func:`select_nodes` sees it: its committed length ``context_len``, and
    for each non-root node (node i + 1 of the tree) its predicted acceptance ``values[i]`` and its
    ``parents[i]`` (tree numbering, 0: the root; parents come before children)."""

    request_id: str
    context_len: int
    values: np.ndarray  # [nodes - 1] float64
    parents: np.ndarray  # [nodes - 1] int64


def select_nodes(
    drafted: Sequence[DraftedNodes],
    costs: StepCosts,
    fixed: VerifyShape = NO_TOKENS,
    fixed_committed: float = 0.0,
    spent_seconds: float = 0.0,
    prompts: VerifyShape = NO_TOKENS,
) -> dict[str, list[int]]:
    """The nodes to verify of each request's drafted tree (root included, parents before children):
    every drafted node of the batch best first, cut at the count K with the most expected committed
    tokens per second, ``(fixed_committed + requests + sum of the first K values) / (verify(fixed +
    roots + K tokens) + spent_seconds + overhead)``. ``fixed`` / ``fixed_committed``: the verify tokens
    and context work of the batch's other requests and the tokens they are expected to commit;
    ``spent_seconds``: what the iteration already took (drafting), the same whatever K is; ``prompts``: the rows of
    the prompts the call computes (:func:`beside_prompts`)."""
    items: list[tuple[float, int, int]] = []  # (value, request, node)
    for r, d in enumerate(drafted):
        # a node is worth at most its parent (its path goes through it): then best first never
        # lists a node before its parent, whatever the values given
        value = np.ones(len(d.values) + 1)
        for i, (v, parent) in enumerate(zip(d.values, d.parents, strict=True)):
            value[i + 1] = min(float(v), value[int(parent)])
            items.append((float(value[i + 1]), r, i + 1))
    items.sort(key=lambda it: (-it[0], it[1], it[2]))
    gained = np.concatenate(([0.0], np.cumsum([v for v, _, _ in items])))
    tokens = fixed.tokens + len(drafted) + np.arange(len(items) + 1)
    work = (
        fixed.context_work
        + sum(d.context_len for d in drafted)
        + np.concatenate(([0.0], np.cumsum([drafted[r].context_len for _, r, _ in items])))
    )
    seconds = beside_prompts(costs, tokens, work, prompts) + spent_seconds + costs.overhead
    best = int(np.argmax((fixed_committed + len(drafted) + gained) / np.maximum(seconds, 1e-12)))
    keep: dict[str, list[int]] = {d.request_id: [0] for d in drafted}
    for _, r, node in items[:best]:
        keep[drafted[r].request_id].append(node)
    return {rid: sorted(nodes) for rid, nodes in keep.items()}
