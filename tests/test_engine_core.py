"""The engine core without a model: applying an admission plan, running a coroutine that never suspends, and
:meth:`EngineCore.step` over a scripted executor (fabricated drafts and verdicts, as vLLM tests its scheduler with
fabricated model outputs): static trees, adaptive ones, head and suffix trees, preemption, cancellation."""

from __future__ import annotations

import asyncio
import copy
import time
from collections import deque
from collections.abc import Mapping, Sequence

import pytest

from specinfer.core.adaptive import AdaptiveSpeculation
from specinfer.core.admission import admit
from specinfer.core.costs import CostTable, StepCosts
from specinfer.core.drafts import DraftTree, ExpansionConfig
from specinfer.core.engine_core import DraftRound, EngineCore, StepReport, Verdict, VerifyRound, run_to_end
from specinfer.core.head_gate import HeadGateConfig
from specinfer.core.iteration import DraftSpec, Running, StepOutcome, VerifySpec
from specinfer.core.kv_budget import Schedule
from specinfer.core.planner import PlannerConfig
from specinfer.core.requests import GenerationRequest, SpeculationConfig
from specinfer.core.tree import TokenTree


def _running(rid: str) -> Running:
    return Running(GenerationRequest(rid, (1, 2), 4), seed=0)


def test_admit_requeues_the_preempted_at_the_head_then_admits_a_prefix() -> None:
    a, b, c, d = (_running(x) for x in "abcd")
    active = {"a": a, "b": b}
    waiting = deque([c, d])
    back = admit(active, waiting, Schedule(run=("a", "b", "c"), preempted=("b",), admitted=("b", "c"), blocks_used=()))
    assert back == [b]
    assert list(active) == ["a", "b", "c"] and list(waiting) == [d]


def test_admit_refuses_a_plan_that_skips_the_head_of_the_queue() -> None:
    active: dict[str, Running] = {}
    waiting = deque([_running("a"), _running("b")])
    with pytest.raises(AssertionError, match="not at the head"):
        admit(active, waiting, Schedule(run=("b",), preempted=(), admitted=("b",), blocks_used=()))


def test_run_to_end_returns_what_a_coroutine_without_suspension_returns() -> None:
    async def add(x: int) -> int:
        async def inner() -> int:
            return x + 1

        return await inner()

    assert run_to_end(add(1)) == 2


def test_run_to_end_refuses_a_coroutine_that_suspends() -> None:
    async def waits() -> None:
        await asyncio.sleep(0)

    with pytest.raises(RuntimeError, match="suspended"):
        run_to_end(waits())


# -- EngineCore.step over a scripted executor -------------------------------------------------------------
#
# The scripted LLM's greedy choice after token t is ``truth(t)``; the scripted SSM k drafts a chain that follows
# it for ``GOOD[k]`` tokens and then goes wrong. Verification accepts the tree's path that follows ``truth``, as
# a greedy verifier of that LLM would: whatever was drafted, the output is the chain of ``truth``.

VOCAB = 8
GOOD = {0: 2, 1: 3}  # tokens SSM k drafts right before it goes wrong
PASS_SECONDS = 5e-3  # what a scripted SSM call reports (the cost model is seeded with 1e-4)


def truth(token: int) -> int:
    return (token + 1) % VOCAB  # periodic: a request's text repeats, which suffix drafts feed on


def expected(prompt: tuple[int, ...], n: int) -> list[int]:
    out, last = [], prompt[-1]
    for _ in range(n):
        last = truth(last)
        out.append(last)
    return out


def chain(root: int, depth: int, good: int) -> DraftTree:
    """A scored chain of ``depth`` tokens after ``root``, right for its first ``good``."""
    tokens, last = [root], root
    for d in range(depth):
        last = truth(last) if d < good else (truth(last) + 3) % VOCAB
        tokens.append(last)
    return DraftTree(TokenTree.chain(tokens), scores=tuple(0.9**d for d in range(depth + 1)))


class ScriptedExecutor:
    """The :class:`Executor` of a scripted LLM and SSMs (see above); records every job it gets. ``fail``:
    request IDs whose next verification fails (they are left out of one round)."""

    def __init__(self) -> None:
        self.drafts: list[dict[int, list[DraftSpec]]] = []
        self.verifies: list[list[VerifySpec]] = []
        self.fail: set[str] = set()

    async def draft(self, jobs: Mapping[int, Sequence[DraftSpec]]) -> DraftRound:
        self.drafts.append({k: list(v) for k, v in jobs.items()})
        trees: dict[int, dict[str, DraftTree]] = {}
        for ssm, specs in jobs.items():
            for s in specs:
                depth = s.expansion.depth if s.expansion is not None else s.budget.depth
                trees.setdefault(ssm, {})[s.request_id] = chain(s.root_token, depth, GOOD[ssm])
        passes = tuple((ssm, len(specs), PASS_SECONDS) for ssm, specs in jobs.items())
        return DraftRound(trees, passes)

    async def verify(self, jobs: Sequence[VerifySpec]) -> VerifyRound:
        self.verifies.append(list(jobs))
        verdicts, failed = {}, tuple(j.request_id for j in jobs if j.request_id in self.fail)
        self.fail.clear()
        for j in jobs:
            if j.request_id in failed:
                continue
            tree, node, accepted = j.draft.tree, 0, []
            while True:
                want = truth(tree.tokens[node])
                child = next((c for c in range(len(tree)) if tree.parents[c] == node and tree.tokens[c] == want), None)
                if child is None:
                    break
                node = child
                accepted.append(want)
            bonus = truth(tree.tokens[node])
            next_tree = chain(bonus, j.head.budget.depth, 1) if j.head is not None else None
            verdicts[j.request_id] = Verdict(tuple(accepted), bonus, next_tree=next_tree)
        return VerifyRound(verdicts, failed, timings=(("scripted", tuple(jobs), 0.01),))


ALWAYS = HeadGateConfig(measure=False)  # a gate that does not measure: on every step


def _adaptive(
    ssms: int = 1, max_nodes: int = 8, per_token: float = 1e-5, gate: HeadGateConfig = ALWAYS, frozen: bool = False
) -> AdaptiveSpeculation:
    """Costs where speculation pays (a verify token is cheap beside the step), the head asked every step and, unless
    ``gate`` says otherwise, speculation every step (the speculation gate does not measure). ``frozen``: the costs
    do not learn from the scripted calls' times (plans that depend on the seed's slope alone)."""
    tables = {b: 1e-2 + per_token * b for b in (1, 2, 4, 8, 16, 32, 64)}
    costs = StepCosts(
        CostTable(tables), 0.0, {s: CostTable({b: 1e-4 for b in tables}) for s in range(ssms)}, frozen=frozen
    )
    config = PlannerConfig(
        max_nodes=max_nodes,
        max_depth=4,
        head_gate=HeadGateConfig(measure=False),
        speculation_gate=gate,
        explore_costs=0,
    )
    return AdaptiveSpeculation(costs, config, {s: (0.8, 0.1) for s in range(ssms)})


def _request(rid: str, speculation: SpeculationConfig | None, n: int = 12, prompt=(0, 1, 2, 3, 4, 5, 6, 7, 0, 1)):
    return Running(GenerationRequest(rid, tuple(prompt), n, speculation=speculation), seed=0)


def _auto(ssms: tuple[int, ...] = (0,), suffix: bool = False, head: bool = False) -> SpeculationConfig:
    return SpeculationConfig(None, ssms, suffix=suffix, head=head)


def _run(core: EngineCore, batch: list[Running], steps: int, live=None) -> list[StepReport]:
    """``steps`` steps over ``batch`` (its finished requests leave it, and the core forgets them, as drivers do)."""
    reports = []

    async def commit(r: Running, outcome: StepOutcome) -> None:
        r.commit(outcome)
        if outcome.finish_reason is not None:
            batch.remove(r)
            core.forget(r.request_id)

    for _ in range(steps):
        if batch:
            reports.append(run_to_end(core.step(list(batch), commit, live)))
    return reports


def test_static_trees_draft_each_named_ssm_merge_and_commit_the_llms_tokens() -> None:
    executor = ScriptedExecutor()
    core = EngineCore(executor, 2, eos_token_id=None)
    static = _request("static", SpeculationConfig(ExpansionConfig((1, 1, 1, 1)), (0, 1)))
    plain = _request("plain", None)
    batch = [static, plain]
    reports = _run(core, batch, 2)
    first = executor.drafts[0]
    assert sorted(first) == [0, 1] and [s.request_id for s in first[0]] == ["static"]
    assert first[1][0].expansion == ExpansionConfig((1, 1, 1, 1)) and first[1][0].budget is None
    assert first[0][0].stream != first[1][0].stream, "each SSM draws on its own stream"
    jobs = {j.request_id: j for j in executor.verifies[0]}
    assert len(jobs["static"].draft.tree) == 1 + 4 + 2, "the SSMs' chains merged where they agree"
    assert len(jobs["plain"].draft.tree) == 1
    assert static.stats.accepted == 2 * GOOD[1] and plain.stats.accepted == 0
    assert static.output == expected(static.request.prompt_tokens, 2 * (GOOD[1] + 1))
    assert plain.output == expected(plain.request.prompt_tokens, 2)
    assert reports[0].planned_nodes == () and core.adaptive is None


def test_adaptive_requests_draft_the_planned_trees_and_teach_the_planner() -> None:
    executor = ScriptedExecutor()
    adaptive = _adaptive(2)
    core = EngineCore(executor, 2, eos_token_id=None, adaptive=adaptive)
    r = _request("auto", _auto((0, 1)))
    seeded = adaptive.costs.describe()["draft_seconds"]
    reports = _run(core, [r], 4)
    assert adaptive.costs.describe()["draft_seconds"] != seeded, "the SSM passes' seconds were learned"
    assert all(n > 1 for n in reports[0].planned_nodes), "speculation pays at these costs"
    budgets = [s.budget for round_ in executor.drafts for specs in round_.values() for s in specs]
    assert budgets and all(b is not None for b in budgets)
    assert r.output[: len(r.output)] == expected(r.request.prompt_tokens, len(r.output))
    assert r.stats.accepted > 0
    t = adaptive.totals
    assert sum(t.drafter_steps.values()) == t.speculative_steps == 4
    for ssm, steps in t.drafter_steps.items():
        assert t.drafter_accepted[ssm] <= GOOD[ssm] * steps
    assert adaptive.costs.overhead >= 0.0


def test_head_trees_are_asked_with_a_budget_then_verified_in_the_next_step() -> None:
    executor = ScriptedExecutor()
    adaptive = _adaptive(0)
    core = EngineCore(executor, 0, eos_token_id=None, adaptive=adaptive, head=True)
    r = _request("head", _auto((), head=True))
    _run(core, [r], 3)
    first, second = executor.verifies[0][0], executor.verifies[1][0]
    assert first.head is not None and len(first.draft.tree) == 1, "no head tree yet: the root alone"
    assert len(second.draft.tree) > 1, "the head tree drafted with the first verification"
    assert second.head is not None and second.head.budget.nodes <= adaptive.config.max_nodes
    assert executor.drafts == [], "no SSM ran"
    t = adaptive.totals
    assert t.drafter_steps["head"] == 2 and t.drafter_accepted["head"] == 2
    assert r.output == expected(r.request.prompt_tokens, len(r.output)) and r.stats.accepted == 2
    assert core.drafters["head"].gate is not None


def test_a_head_tree_is_dropped_once_its_request_committed_other_tokens() -> None:
    executor = ScriptedExecutor()
    core = EngineCore(executor, 0, eos_token_id=None, adaptive=_adaptive(0), head=True)
    r = _request("head", _auto((), head=True))
    _run(core, [r], 1)
    r.output.append(truth(r.output[-1]))  # a step that did not come from the core (the tree is stale)
    _run(core, [r], 1)
    assert len(executor.verifies[1][0].draft.tree) == 1


def test_suffix_trees_draft_from_the_requests_own_text() -> None:
    executor = ScriptedExecutor()
    adaptive = _adaptive(0)
    core = EngineCore(executor, 0, eos_token_id=None, adaptive=adaptive)
    r = _request("suffix", _auto((), suffix=True), n=20)
    _run(core, [r], 3)
    assert executor.drafts == [] and all(len(v[0].draft.tree) > 1 for v in executor.verifies)
    assert r.output == expected(r.request.prompt_tokens, len(r.output))
    t = adaptive.totals
    assert t.drafter_steps["suffix"] == 3 and t.drafter_accepted["suffix"] == r.stats.accepted > 3
    assert "suffix" in adaptive.edges


def test_every_drafter_of_a_request_is_merged_in_one_verify_job() -> None:
    executor = ScriptedExecutor()
    # an SSM's plan leaves room for the suffix tree; frozen, as the scripted calls all take 0.01 s (which would teach
    # the model that nodes are free, and the SSM's plan would fill the budget)
    adaptive = _adaptive(1, max_nodes=16, per_token=1e-3, frozen=True)
    core = EngineCore(executor, 1, eos_token_id=None, adaptive=adaptive, head=True)
    r = _request("all", _auto((0,), suffix=True, head=True), n=40)
    _run(core, [r], 4)
    assert r.output == expected(r.request.prompt_tokens, len(r.output))
    t = adaptive.totals
    assert t.drafter_steps == {0: 4, "suffix": 4, "head": 3}
    assert t.drafter_accepted[0] == 4 * GOOD[0] and t.drafter_accepted["head"] == 3
    second = executor.verifies[1][0].draft.tree
    assert len(second) > max(executor.drafts[1][0][0].budget.nodes, 1 + 1 + 2), "three drafters' trees merged"


def test_a_preempted_request_is_forgotten_and_resumes_from_its_output() -> None:
    executor = ScriptedExecutor()
    core = EngineCore(executor, 0, eos_token_id=None, adaptive=_adaptive(0), head=True)
    a, b = _request("a", _auto((), head=True)), _request("b", _auto((), head=True))
    active, waiting = {"a": a, "b": b}, deque[Running]()
    _run(core, list(active.values()), 1)
    plan = Schedule(run=("a",), preempted=("b",), admitted=(), blocks_used=())
    for r in admit(active, waiting, plan):
        core.forget(r.request_id)
    _run(core, list(active.values()), 1)
    admit(active, waiting, Schedule(run=("a", "b"), preempted=(), admitted=("b",), blocks_used=()))
    _run(core, list(active.values()), 1)
    third = {j.request_id: j for j in executor.verifies[2]}
    assert len(third["a"].draft.tree) > 1, "a kept its head tree"
    assert len(third["b"].draft.tree) == 1, "b's head tree went with its preemption"
    for r in (a, b):
        assert r.output == expected(r.request.prompt_tokens, len(r.output))
    assert len(b.output) == 2 and b.stats.llm_steps == 2


def test_a_cancelled_request_commits_nothing_and_teaches_nothing() -> None:
    executor = ScriptedExecutor()
    adaptive = _adaptive(1)
    core = EngineCore(executor, 1, eos_token_id=None, adaptive=adaptive, head=True)
    kept, cancelled = _request("kept", _auto((0,), head=True)), _request("gone", _auto((0,), head=True))
    _run(core, [kept, cancelled], 1, live=lambda rid: rid != "gone")
    assert cancelled.output == [] and cancelled.stats.llm_steps == 0
    assert kept.output == expected(kept.request.prompt_tokens, len(kept.output)) and kept.stats.llm_steps == 1
    assert adaptive.totals.drafter_steps == {0: 1}, "only the live request's step was observed"


def test_a_request_whose_verification_failed_retries_the_step() -> None:
    executor = ScriptedExecutor()
    core = EngineCore(executor, 1, eos_token_id=None)
    r = _request("r", SpeculationConfig(ExpansionConfig((1, 1)), (0,)))
    executor.fail.add("r")
    reports = _run(core, [r], 2)
    assert reports[0].verify.failed == ("r",) and r.stats.llm_steps == 1
    assert executor.verifies[0][0].step == executor.verifies[1][0].step == 0, "the same step, drawn again"
    assert r.output == expected(r.request.prompt_tokens, GOOD[0] + 1)


def test_a_request_ends_at_its_length_and_leaves_the_core() -> None:
    executor = ScriptedExecutor()
    core = EngineCore(executor, 0, eos_token_id=None, adaptive=_adaptive(0))
    r = _request("short", _auto((), suffix=True), n=3)
    batch = [r]
    _run(core, batch, 3)
    assert batch == [] and r.output == expected(r.request.prompt_tokens, 3)
    for jobs in executor.verifies:
        assert len(jobs[0].draft.tree) <= r.request.max_new_tokens, "never drafts past the token budget"


class TimedExecutor(ScriptedExecutor):
    """The scripted models, with a verification that takes ``base + per_node * nodes`` seconds (the batch's tree
    nodes): a machine where speculation pays (``per_node`` small) or loses (large)."""

    def __init__(self, base: float, per_node: float) -> None:
        super().__init__()
        self.base, self.per_node = base, per_node

    async def verify(self, jobs: Sequence[VerifySpec]) -> VerifyRound:
        time.sleep(self.base + self.per_node * sum(len(j.draft.tree) for j in jobs))
        return await super().verify(jobs)


@pytest.mark.parametrize("per_node, speculation_wins", [(0.0, True), (1e-2, False)])
def test_the_speculation_gate_keeps_the_faster_of_speculating_and_not(per_node: float, speculation_wins: bool) -> None:
    """Speculation measured first, then a block without, then the faster arm kept: where each drafted node costs the
    verification more than the tokens it brings (the scripted SSM is right for 2 tokens, then wrong), the adaptive
    request ends up verifying its root alone; where nodes are free it keeps speculating. Five nodes commit three
    tokens: at 1 ms a call and 10 ms a node speculation loses while the host adds under 9 ms a step (a CI machine
    added ~3 ms, which at 2 and 4 ms made the arms a tie)."""
    gate = HeadGateConfig(block=3, explore_every=1000)
    executor = TimedExecutor(1e-3, per_node)
    adaptive = _adaptive(1, gate=gate)
    core = EngineCore(executor, 1, eos_token_id=None, adaptive=adaptive)
    r = _request("auto", _auto((0,)), n=400)
    _run(core, [r], 24)
    assert r.output == expected(r.request.prompt_tokens, len(r.output))
    on, off = core.speculation_gate.rates(1)
    assert on > 0 and off > 0, "both arms measured"
    assert (on > off) == speculation_wins
    sizes = [len(v[0].draft.tree) for v in executor.verifies]
    assert 1 in sizes[6:9], "the third block measured the adaptive request without speculation"
    kept = sizes[-9:]  # the blocks after the decision
    assert all(n > 1 for n in kept) if speculation_wins else all(n == 1 for n in kept)


def test_each_step_reports_the_cost_models_prediction_before_it_learns() -> None:
    """A step's report pairs each verify call's predicted seconds (the cost model before the call's time reaches it)
    with the seconds it took (the scripted executor reports 0.01 s); the model then learns, so its next prediction moves
    toward the measured time and the error the request manager exports shrinks."""
    executor = ScriptedExecutor()
    adaptive = _adaptive(1)
    core = EngineCore(executor, 1, eos_token_id=None, adaptive=adaptive)
    r = _request("auto", _auto((0,)), n=40)
    reports = _run(core, [r], 6)
    sampled = [(i, rep.verify_predictions[0]) for i, rep in enumerate(reports) if rep.verify_predictions]
    assert len(sampled) >= 4 and all(len(reports[i].verify_predictions) == 1 for i, _ in sampled)
    assert all(measured == 0.01 for _, (_, measured) in sampled)
    first, (predicted, _) = sampled[0]  # the step that prefilled the prompt: its rows are the prompt's and the tree's
    assert first == 0
    rows = len(r.request.prompt_tokens) - 1 + len(executor.verifies[first][0].draft.tree)
    assert predicted == pytest.approx(1e-2 + 1e-5 * rows), "the calibrated table"
    errors = [abs(p - m) / m for _, (p, m) in sampled]
    assert errors[-1] < errors[0], "the model learned from the calls' times"
    plain = EngineCore(ScriptedExecutor(), 1, eos_token_id=None)
    assert (
        _run(plain, [_request("static", SpeculationConfig(ExpansionConfig((1, 1)), (0,)))], 1)[0].verify_predictions
        == ()
    )


def test_each_step_reports_the_whole_steps_prediction() -> None:
    """Where its verify calls were predicted, a step's report also pairs the whole step's predicted seconds with the
    seconds it took: its verify calls' predictions, its draft passes' (the SSM's table at the passes' frontier
    tokens) and the overhead outside the models, each as the cost model stood before the step (it learns after)."""
    executor = ScriptedExecutor()
    adaptive = _adaptive(1)
    core = EngineCore(executor, 1, eos_token_id=None, adaptive=adaptive)
    batch = [_request("auto", _auto((0,)), n=400)]
    predicted_steps = 0
    for _ in range(12):
        costs = copy.deepcopy(adaptive.costs)  # the model before the step
        drafted = len(executor.drafts)
        (report,) = _run(core, batch, 1)
        assert (report.step_prediction is None) == (not report.verify_predictions)
        if report.step_prediction is None:
            continue
        predicted_steps += 1
        passes = [(ssm, len(specs)) for jobs in executor.drafts[drafted:] for ssm, specs in jobs.items()]
        draft = sum(costs.draft_seconds(ssm, tokens) for ssm, tokens in passes)
        predicted, measured = report.step_prediction
        verify = sum(p for p, _ in report.verify_predictions)
        assert predicted == pytest.approx(verify + draft + costs.overhead) and measured > 0
    assert predicted_steps >= 10
