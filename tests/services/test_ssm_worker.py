"""SsmWorker over gRPC (a separate process) against draft_trees in process."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import grpc
import numpy as np
import pytest

from specinfer import wire, wire_jobs
from specinfer.core import DraftTree, ExpansionConfig, SamplingParams
from specinfer.core.costs import BUCKETS
from specinfer.core.drafts import DEFAULT_DRAFT_SUPPORT
from specinfer.core.dynamic_trees import EDGE_KNOTS, TreeBudget
from specinfer.core.iteration import DraftSpec
from specinfer.models.drafting import draft_trees
from specinfer.models.loading import load_backend
from specinfer.v1 import internal_pb2

_ids = itertools.count()

GREEDY = SamplingParams()
SAMPLING = SamplingParams(temperature=0.8, top_k=50, top_p=0.95)


def fresh_id(prefix: str) -> str:
    """A request ID no test used before: both sides then compute its cache from scratch."""
    return f"{prefix}-{next(_ids)}"


@dataclass(frozen=True)
class Draft:
    """One item of a Speculate call, and the same job for draft_trees."""

    request_id: str
    context: list[int]
    root: int
    widths: tuple[int, ...]
    sampling: SamplingParams
    seed: int = 0
    step: int = 0
    stream: int = 1
    draft_support: int = 0

    def item(self, offset: int = 0) -> internal_pb2.SpeculateItem:
        return internal_pb2.SpeculateItem(
            context=wire_jobs.context_to_proto(self.request_id, self.context, offset),
            root_token=self.root,
            expansion=self.widths,
            sampling=wire.sampling_to_proto(self.sampling),
            draft_support=self.draft_support,
            seed=self.seed,
            step=self.step,
            stream=self.stream,
        )

    def job(self) -> DraftSpec:
        return DraftSpec(
            self.request_id,
            self.context,
            self.root,
            ExpansionConfig(self.widths),
            self.sampling,
            self.draft_support or DEFAULT_DRAFT_SUPPORT,
            self.seed,
            self.step,
            self.stream,
        )


def speculate(stub, ssm: str, drafts: list[Draft], offsets: list[int] | None = None) -> internal_pb2.SpeculateResponse:
    offsets = offsets or [0] * len(drafts)
    return stub.Speculate(
        internal_pb2.SpeculateRequest(ssm=ssm, items=[d.item(o) for d, o in zip(drafts, offsets, strict=True)]),
        timeout=60,
    )


def assert_same_draft(got: DraftTree, want: DraftTree) -> None:
    assert got.tree == want.tree
    assert [(g.parent, g.children) for g in got.groups] == [(g.parent, g.children) for g in want.groups]
    for g, w in zip(got.groups, want.groups, strict=True):
        assert (g.q is None) == (w.q is None)
        if w.q is not None:
            np.testing.assert_array_equal(g.q.tokens, w.q.tokens)
            np.testing.assert_allclose(g.q.probs, w.q.probs, rtol=1e-5, atol=1e-9)


@pytest.fixture(scope="module")
def loaded_ssms(model_pair):
    """The worker's SSMs in process, with the worker's backend choice (auto)."""
    return {
        name: load_backend(path, name, "float32", kv_cache_bytes=64 << 20)
        for name, path in (("ssm", model_pair.ssm), ("ssm2", model_pair.ssm2))
    }


@pytest.fixture
def local_ssms(loaded_ssms):
    """:func:`loaded_ssms`, whose KV caches are freed after each test."""
    yield loaded_ssms
    for model in loaded_ssms.values():
        for rid in model.cached_requests():
            model.release(rid)


def some_drafts(model_pair, sampling: SamplingParams, prefix: str) -> list[Draft]:
    widths = [(2, 2, 1), (3, 1), (1, 1, 1, 1)]
    return [
        Draft(
            fresh_id(prefix),
            list(p[:-1]),
            p[-1],
            w,
            sampling,
            seed=100 + i,
            step=i,
            stream=1 + i % 2,
            draft_support=16 * i,
        )
        for i, (p, w) in enumerate(zip(model_pair.prompts[:3], widths, strict=True))
    ]


@pytest.mark.parametrize("ssm", ["ssm", "ssm2"])
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLING], ids=["greedy", "sampling"])
def test_speculate_matches_draft_trees(services, local_ssms, model_pair, ssm, sampling):
    drafts = some_drafts(model_pair, sampling, f"match-{ssm}")
    response = speculate(services.ssm_stub, ssm, drafts)  # one call: batched through the SSM
    want = draft_trees(local_ssms[ssm], [d.job() for d in drafts])
    assert [r.request_id for r in response.results] == [d.request_id for d in drafts]
    for result, expected in zip(response.results, want, strict=True):
        assert not result.cache_miss
        assert_same_draft(wire.draft_from_proto(result.tree), expected)
    if not sampling.greedy:
        assert all(g.q_tokens for r in response.results for g in r.tree.groups)
    services.ssm_stub.Release(internal_pb2.ReleaseRequest(request_ids=[d.request_id for d in drafts]), timeout=10)


def test_list_models(services):
    info = services.ssm_stub.ListModels(internal_pb2.ListModelsRequest(), timeout=10)
    assert list(info.models) == ["ssm", "ssm2"]
    assert info.vocab_size > 0
    # start-up calibration (--calibrate-tokens, default 32) of each SSM's draft pass; no tuning file installed: no prior
    assert [p.model for p in info.profiles] == ["ssm", "ssm2"]
    for profile in info.profiles:
        assert [p.tokens for p in profile.draft_costs] == [b for b in BUCKETS if b <= 32] and all(
            p.seconds > 0 for p in profile.draft_costs
        )
        assert wire.cost_table_from_proto(profile.draft_costs) is not None and not profile.slot_prior


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLING], ids=["greedy", "sampling"])
def test_speculate_budgeted_tree(services, local_ssms, model_pair, sampling):
    """Items with a budget grow best-first dynamic trees, the same as draft_trees in process, with
    their scores; the response carries the worker's SSM passes. The last budget carries an edge
    curve (an underconfident SSM's), which reaches the worker and shapes its tree as in process."""
    underconfident = tuple(float(np.sqrt(k)) for k in EDGE_KNOTS)
    budgets = [TreeBudget(8, 4), TreeBudget(5, 2, 2), TreeBudget(12, 6, 3, 0.01, underconfident)]
    jobs = [
        DraftSpec(fresh_id("budget"), list(p[:-1]), p[-1], None, sampling, DEFAULT_DRAFT_SUPPORT, 7 + i, i, 1, b)
        for i, (p, b) in enumerate(zip(model_pair.prompts[:3], budgets, strict=True))
    ]
    request = internal_pb2.SpeculateRequest(
        ssm="ssm",
        items=[
            wire_jobs.draft_job_to_proto(j, wire_jobs.context_to_proto(j.request_id, j.context_tokens, 0)) for j in jobs
        ],
    )
    response = services.ssm_stub.Speculate(request, timeout=60)
    passes: list[tuple[int, float]] = []
    want = draft_trees(local_ssms["ssm"], jobs, lambda n, s: passes.append((n, s)))
    for result, job, expected in zip(response.results, jobs, want, strict=True):
        got = wire.draft_from_proto(result.tree)
        assert_same_draft(got, expected)
        assert len(got.tree) <= job.budget.nodes and int(got.tree.depths.max()) <= job.budget.depth
        np.testing.assert_allclose(
            got.scores, expected.scores, rtol=1e-4
        )  # float32 models: batching moves the last bits
        assert len(got.scores) == len(got.tree) and got.scores[0] == 1.0
    reported = wire.pass_timings_from_proto(response.passes)
    assert [n for n, _ in reported] == [n for n, _ in passes] and all(s > 0 for _, s in reported)
    services.ssm_stub.Release(internal_pb2.ReleaseRequest(request_ids=[j.request_id for j in jobs]), timeout=10)


def test_cache_miss_protocol(services, local_ssms, model_pair):
    stub, prompt = services.ssm_stub, model_pair.prompts[5]
    first = Draft(fresh_id("miss"), list(prompt[:-1]), prompt[-1], (2, 1), GREEDY)

    # the worker never saw this request: an offset past what it knows is a miss, without a tree
    (miss,) = speculate(stub, "ssm", [first], [3]).results
    assert miss.cache_miss and not miss.HasField("tree")
    (hit,) = speculate(stub, "ssm", [first], [0]).results
    assert not hit.cache_miss
    assert_same_draft(wire.draft_from_proto(hit.tree), draft_trees(local_ssms["ssm"], [first.job()])[0])

    # next step: the root and one drafted token were committed; only the new tokens travel
    tree = wire.draft_from_proto(hit.tree).tree
    grown = Draft(first.request_id, first.context + [first.root, tree.tokens[1]], tree.tokens[2], (2, 1), GREEDY)
    (hit,) = speculate(stub, "ssm", [grown], [len(first.context)]).results
    assert not hit.cache_miss
    local = Draft(fresh_id("miss-local"), grown.context, grown.root, grown.widths, GREEDY)
    assert_same_draft(wire.draft_from_proto(hit.tree), draft_trees(local_ssms["ssm"], [local.job()])[0])

    # a rewind: the caller's context diverged at position 2
    rewound = Draft(first.request_id, first.context[:2] + [7, 8], 9, (1,), GREEDY)
    (hit,) = speculate(stub, "ssm", [rewound], [2]).results
    assert not hit.cache_miss
    local = Draft(fresh_id("miss-local"), rewound.context, rewound.root, rewound.widths, GREEDY)
    assert_same_draft(wire.draft_from_proto(hit.tree), draft_trees(local_ssms["ssm"], [local.job()])[0])

    # after Release the request is unknown again
    stub.Release(internal_pb2.ReleaseRequest(request_ids=[first.request_id]), timeout=10)
    (miss,) = speculate(stub, "ssm", [rewound], [1]).results
    assert miss.cache_miss
    # misses and hits mix in one call
    other = Draft(fresh_id("miss"), list(prompt[:-1]), prompt[-1], (1,), GREEDY)
    results = speculate(stub, "ssm", [rewound, other], [1, 0]).results
    assert [r.cache_miss for r in results] == [True, False]
    stub.Release(internal_pb2.ReleaseRequest(request_ids=[other.request_id]), timeout=10)


def _good(model_pair) -> internal_pb2.SpeculateRequest:
    prompt = model_pair.prompts[0]
    drafts = [Draft(fresh_id("bad"), list(prompt[:-1]), prompt[-1], (2, 1), SAMPLING, seed=1) for _ in range(2)]
    return internal_pb2.SpeculateRequest(ssm="ssm", items=[d.item() for d in drafts])


def _clear_expansion(request):
    del request.items[0].expansion[:]


def _duplicate_id(request):
    request.items[1].context.request_id = request.items[0].context.request_id


def _too_long(request):
    request.items[0].context.tokens[:] = [5] * 2047


def _budget(
    nodes: int,
    depth: int = 3,
    width: int = 2,
    min_score: float = 0.0,
    keep_expansion: bool = False,
    edge_curve: tuple[float, ...] = (),
):
    def mutate(request):
        item = request.items[0]
        if not keep_expansion:
            del item.expansion[:]
        item.budget_nodes, item.budget_depth, item.budget_width, item.budget_min_score = nodes, depth, width, min_score
        item.budget_edge_curve.extend(edge_curve)

    return mutate


# mutations of a good two-item request, and what the status details must say
BAD_REQUESTS = {
    "unknown-ssm": (lambda r: setattr(r, "ssm", "nope"), "ssm: unknown SSM 'nope' (have: ssm, ssm2)"),
    "context-token-too-big": (lambda r: r.items[1].context.tokens.__setitem__(0, 1 << 20), "items[1].context.tokens"),
    "context-token-negative": (lambda r: r.items[0].context.tokens.__setitem__(2, -1), "items[0].context.tokens"),
    "root-token": (lambda r: setattr(r.items[0], "root_token", 1 << 20), "items[0].root_token"),
    "expansion-width-0": (lambda r: r.items[1].expansion.__setitem__(1, 0), "items[1].expansion"),
    "expansion-empty": (_clear_expansion, "items[0].expansion"),
    "temperature-negative": (
        lambda r: setattr(r.items[0].sampling, "temperature", -0.5),
        "items[0].sampling.temperature",
    ),
    "top-p-above-1": (lambda r: setattr(r.items[1].sampling, "top_p", 1.5), "items[1].sampling.top_p"),
    "empty-request-id": (lambda r: setattr(r.items[0].context, "request_id", ""), "items[0].context.request_id"),
    "duplicate-request-id": (_duplicate_id, "items[1].context.request_id"),
    "context-too-long": (_too_long, "items[0].context.tokens"),
    "budget-and-expansion": (_budget(8, keep_expansion=True), "items[0].budget_nodes"),
    "budget-depth-0": (_budget(8, depth=0), "items[0].budget_nodes"),
    "budget-nodes-1": (_budget(1), "items[0].budget_nodes"),
    "budget-too-big": (_budget(1 << 20), "items[0].budget_nodes"),
    "budget-min-score": (_budget(8, min_score=2.0), "items[0].budget_nodes"),
    "budget-edge-curve-short": (_budget(8, edge_curve=(0.5, 0.6)), "items[0].budget_edge_curve"),
    "budget-edge-curve-falling": (
        _budget(8, edge_curve=tuple(1.0 - k for k in EDGE_KNOTS)),
        "items[0].budget_edge_curve",
    ),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_invalid_argument_names_the_field(services, model_pair, case):
    mutate, expected = BAD_REQUESTS[case]
    request = _good(model_pair)
    mutate(request)
    with pytest.raises(grpc.RpcError) as err:
        services.ssm_stub.Speculate(request, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert expected in err.value.details()
    # a rejected call stored nothing: continuing from its context is a miss
    if request.items[0].context.request_id:
        follow = _good(model_pair)
        follow.items[0].context.request_id = request.items[0].context.request_id
        follow.items[0].context.offset = 1
        del follow.items[0].context.tokens[:]
        assert services.ssm_stub.Speculate(follow, timeout=30).results[0].cache_miss
    # and the worker goes on serving
    good = _good(model_pair)
    results = services.ssm_stub.Speculate(good, timeout=30).results
    assert [len(r.tree.tokens) for r in results] == [5, 5]
    services.ssm_stub.Release(
        internal_pb2.ReleaseRequest(request_ids=[i.context.request_id for i in good.items]), timeout=10
    )


@pytest.mark.parametrize("via", ["stream", "socket"])
def test_speculate_calls_over_a_stream_or_the_socket_match_draft_trees(services, local_ssms, model_pair, via):
    """SpeculateStream through the request manager's StreamedUnary, and the same messages over the worker's socket
    (specinfer/serving/socket_calls.py, the port ListModels names): each exchange drafts what draft_trees drafts,
    for each SSM on its own stream or connection; an unknown SSM ends it with Speculate's status, and the next call
    works."""
    import asyncio

    from specinfer.request_manager.cluster.streamed import StreamedUnary
    from specinfer.serving.security import ClientAuth
    from specinfer.serving.socket_calls import SocketUnary
    from specinfer.v1 import internal_pb2_grpc

    drafts = {ssm: some_drafts(model_pair, SAMPLING, f"{via}-{ssm}") for ssm in ("ssm", "ssm2")}
    port = services.ssm_stub.ListModels(internal_pb2.ListModelsRequest(), timeout=10).socket_port
    assert port > 0
    host = services.ssm_worker.address.rpartition(":")[0]

    def request(ssm: str) -> internal_pb2.SpeculateRequest:
        return internal_pb2.SpeculateRequest(ssm=ssm, items=[d.item() for d in drafts[ssm]])

    async def scenario():
        async with grpc.aio.insecure_channel(services.ssm_worker.address) as channel:
            stub = internal_pb2_grpc.SsmWorkerStub(channel)
            calls = {
                ssm: StreamedUnary(stub.SpeculateStream, stub.Speculate, ())
                if via == "stream"
                else SocketUnary(host, port, internal_pb2.SpeculateResponse, ClientAuth())
                for ssm in drafts
            }
            responses = await asyncio.gather(*(calls[ssm](request(ssm), 60) for ssm in drafts))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await calls["ssm"](internal_pb2.SpeculateRequest(ssm="nope", items=[]), 60)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            again = await calls["ssm"](request("ssm"), 60)  # a new stream; the contexts are known
            assert via == "socket" or all(calls[ssm].streams for ssm in drafts)
            return responses, again

    (first, second), again = asyncio.run(scenario())
    for ssm, response in (("ssm", first), ("ssm2", second)):
        want = draft_trees(local_ssms[ssm], [d.job() for d in drafts[ssm]])
        for result, expected in zip(response.results, want, strict=True):
            assert not result.cache_miss
            assert_same_draft(wire.draft_from_proto(result.tree), expected)
    assert not any(r.cache_miss for r in again.results)
    for ssm in drafts:
        services.ssm_stub.Release(
            internal_pb2.ReleaseRequest(request_ids=[d.request_id for d in drafts[ssm]]), timeout=10
        )
