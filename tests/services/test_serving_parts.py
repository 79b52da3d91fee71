"""The shared pieces of the model services, in process: context protocol, settings, empty
forwards (a prefill) and the status a full KV pool or a backend failure maps to."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch
from prometheus_client import CollectorRegistry

from specinfer import wire, wire_jobs
from specinfer.core import InvalidArgument
from specinfer.llm_verifier.servicer import SERVICE_NAME, LlmVerifierServicer
from specinfer.models.interface import TreeForward
from specinfer.models.loading import load_backend
from specinfer.serving.config import parse_named_paths
from specinfer.serving.contexts import ContextStore
from specinfer.serving.metrics import ModelMetrics
from specinfer.serving.server import ServerConfig, Service
from specinfer.v1 import internal_pb2, internal_pb2_grpc


def update(rid: str, offset: int, tokens: list[int]) -> wire_jobs.ContextUpdate:
    return wire_jobs.ContextUpdate(rid, offset, tuple(tokens))


def test_context_store_protocol():
    store = ContextStore()
    assert store.resolve(update("a", 0, [1, 2, 3])) == [1, 2, 3]
    assert store.resolve(update("a", 1, [])) is None  # unknown request: only offset 0 works
    assert "a" not in store  # resolving stores nothing
    store.store("a", [1, 2, 3])
    assert store.resolve(update("a", 3, [4, 5])) == [1, 2, 3, 4, 5]
    assert store.resolve(update("a", 4, [9])) is None  # past what it knows
    assert store.resolve(update("a", 1, [7])) == [1, 7]  # a rewind
    assert store.resolve(update("a", 0, [])) == []
    store.forget("a")
    assert store.resolve(update("a", 2, [])) is None
    with pytest.raises(InvalidArgument, match=r"items\[1\].context.request_id"):
        store.resolve_all([update("b", 0, []), update("b", 0, [])])


def test_parse_named_paths():
    assert parse_named_paths("/m/ssm-a, small=/m/b/", "ssm") == {"ssm-a": "/m/ssm-a", "small": "/m/b/"}
    assert parse_named_paths(None, "ssm") == {}
    with pytest.raises(InvalidArgument, match="ssm: name 'x' is given twice"):
        parse_named_paths("x=/a,/b/x", "ssm")
    with pytest.raises(InvalidArgument, match="ssm: expected NAME=PATH"):
        parse_named_paths("=/a", "ssm")


@pytest.mark.parametrize("backend", ["native", "reference"])
def test_forward_without_nodes_prefills(model_pair, backend):
    """A forward with no tree nodes (a prefill) computes the context only; later trees see it."""
    prompt = model_pair.prompts[1]
    warm = load_backend(model_pair.llm, "llm", "float32", backend=backend, kv_cache_bytes=64 << 20)
    cold = load_backend(model_pair.llm, "llm", "float32", backend=backend, kv_cache_bytes=64 << 20)
    half = len(prompt) // 2
    for context in (prompt[:half], prompt[:half], prompt[:-1]):  # a chunk, an up-to-date cache, the rest
        out = warm.forward_tree([TreeForward("r", context, [], []), TreeForward("s", prompt[:3], [], [])])
        assert [tuple(o.shape) for o in out] == [(0, warm.vocab_size)] * 2
    tree = TreeForward("r", prompt[:-1], [prompt[-1], 5, 6], [-1, 0, 0])
    # a mixed batch: one request prefills while another verifies a tree
    got = warm.forward_tree([tree, TreeForward("s", prompt[:4], [], [])])
    want = cold.forward_tree([tree])
    assert got[1].shape == (0, warm.vocab_size)
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)


def one_slot_bytes(model_pair) -> int:
    """A KV budget of exactly one request slot of the native backend."""
    probe = load_backend(model_pair.llm, "llm", "float32", backend="native", kv_cache_bytes=1 << 30)
    return probe.options.kv_cache_bytes // probe.max_requests


def test_full_kv_pool_and_backend_errors_map_to_statuses(model_pair):
    llm = load_backend(model_pair.llm, "llm", "float32", backend="native", kv_cache_bytes=one_slot_bytes(model_pair))
    assert llm.max_requests == 1
    servicer = LlmVerifierServicer("llm", llm, ModelMetrics(CollectorRegistry(), "llm"))
    prompt = model_pair.prompts[0]

    def item(rid: str, context: list[int], tokens: list[int]) -> internal_pb2.VerifyItem:
        return internal_pb2.VerifyItem(
            context=wire_jobs.context_to_proto(rid, context, 0),
            tree=internal_pb2.DraftTree(tokens=tokens, parents=[-1] * len(tokens)),
        )

    async def scenario() -> None:
        service = Service(ServerConfig("127.0.0.1", 0, 1.0), [SERVICE_NAME], servicer.register)
        await service.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{service.port}") as channel:
                stub = internal_pb2_grpc.LlmVerifierStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Verify(
                        internal_pb2.VerifyRequest(items=[item("a", prompt, [5]), item("b", prompt, [5])])
                    )
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                await stub.Release(internal_pb2.ReleaseRequest(request_ids=["a"]))
                (ok,) = (await stub.Verify(internal_pb2.VerifyRequest(items=[item("b", prompt, [5])]))).results
                assert not ok.cache_miss
                # a failure inside the backend (here: more tree nodes than a nearly full slot has
                # rows for) is INTERNAL, and the service goes on
                # 300 nodes of depth <= 2 with valid IDs for any vocabulary >= 151 (a trie: no
                # parent has the same token twice): the root, 150 children, 149 grandchildren
                tokens = [5] + list(range(150)) + list(range(149))
                wide = internal_pb2.DraftTree(tokens=tokens, parents=[-1] + [0] * 150 + [1] * 149)
                long_context = [7] * (llm.max_positions - 10)
                too_big = internal_pb2.VerifyItem(context=wire_jobs.context_to_proto("b", long_context, 0), tree=wide)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Verify(internal_pb2.VerifyRequest(items=[too_big]))
                assert err.value.code() == grpc.StatusCode.INTERNAL
                (ok,) = (await stub.Verify(internal_pb2.VerifyRequest(items=[item("b", prompt, [5])]))).results
                assert not ok.cache_miss
        finally:
            await service.stop()

    asyncio.run(scenario())


def test_wire_adaptive_round_trips():
    """Budgets, scores, cost tables and pass timings survive the wire; a broken one names its field."""
    from specinfer.core import DraftTree, ExpansionConfig, SamplingParams, TokenTree
    from specinfer.core.costs import CostTable
    from specinfer.core.dynamic_trees import EDGE_KNOTS, TreeBudget
    from specinfer.core.iteration import DraftSpec

    curve = tuple(min(1.0, 2 * k) for k in EDGE_KNOTS)
    for expansion, budget in (
        (ExpansionConfig((2, 1)), None),
        (None, TreeBudget(9, 4, 3, 0.05)),
        (None, TreeBudget(9, 4, 3, 0.05, curve)),
    ):
        job = DraftSpec("r", [1, 2, 3], 4, expansion, SamplingParams(temperature=0.5, seed=3), 16, 11, 2, 1, budget)
        item = wire_jobs.draft_job_to_proto(job, wire_jobs.context_to_proto("r", job.context_tokens, 0))
        back = wire_jobs.draft_job_from_proto(item, job.context_tokens, 100, 64, "items[0]")
        assert back == DraftSpec("r", [1, 2, 3], 4, expansion, job.sampling, 16, 11, 2, 1, budget)
    with pytest.raises(InvalidArgument) as err:  # the budget's tree must fit the model's positions
        wire_jobs.draft_job_from_proto(item, list(range(60)), 100, 64, "items[0]")
    assert err.value.field == "items[0].context.tokens"

    draft = DraftTree(TokenTree((5, 6, 7), (-1, 0, 0)), (), (1.0, 0.6, 0.25))
    assert wire.draft_from_proto(wire.draft_to_proto(draft)).scores == draft.scores
    assert wire.draft_from_proto(wire.draft_to_proto(DraftTree(draft.tree))).scores == ()
    bad = wire.draft_to_proto(draft)
    del bad.scores[-1]
    with pytest.raises(InvalidArgument) as err:
        wire.draft_from_proto(bad)
    assert err.value.field == "tree.scores"

    table = CostTable({1: 0.01, 4: 0.012, 16: 0.02})
    back = wire.cost_table_from_proto(wire.cost_points_to_proto(table))
    assert back is not None and back.as_dict() == pytest.approx(table.as_dict())
    assert wire.cost_points_to_proto(None) == [] and wire.cost_table_from_proto([]) is None
    (profile,) = wire.ssm_profiles_to_proto(
        ["ssm"], {"ssm": table}, {"ssm": (0.6, 0.1)}, {}, {"ssm": "token-intersection"}
    )
    assert wire.slot_prior_from_proto(profile.slot_prior) == pytest.approx((0.6, 0.1))
    assert wire.slot_prior_from_proto([]) is None and wire.slot_prior_from_proto([1.5]) is None
    passes = [(3, 0.002), (5, 0.004)]
    assert wire.pass_timings_from_proto(wire.pass_timings_to_proto(passes)) == passes


def test_wire_constraints_round_trip():
    """A draft job's and a head draft's constraint cross the wire; an unknown kind names its field."""
    from specinfer.core import DraftTree, ExpansionConfig, SamplingParams, TokenTree
    from specinfer.core.constraints import Constraint
    from specinfer.core.dynamic_trees import TreeBudget
    from specinfer.core.iteration import DraftSpec, HeadDraft, VerifySpec

    for constraint in (Constraint("json_object"), Constraint("regex", "[a-z]+"), None):
        job = DraftSpec("r", [1, 2], 3, ExpansionConfig((2,)), SamplingParams(), 8, 1, 0, 1, None, 1, constraint)
        item = wire_jobs.draft_job_to_proto(job, wire_jobs.context_to_proto("r", job.context_tokens, 0))
        assert wire_jobs.draft_job_from_proto(item, job.context_tokens, 100, 64, "items[0]") == job
        head = HeadDraft(TreeBudget(9, 4, 3, 0.0), 8, constraint)
        verify = VerifySpec("r", [1, 2], DraftTree(TokenTree((3,), (-1,))), SamplingParams(), 1, 0, head)
        item = wire_jobs.verify_job_to_proto(verify, wire_jobs.context_to_proto("r", verify.context_tokens, 0))
        assert wire_jobs.head_draft_from_proto(item, "items[0]") == head
    item = wire_jobs.draft_job_to_proto(job, wire_jobs.context_to_proto("r", job.context_tokens, 0))
    item.constraint.kind = "yaml"
    with pytest.raises(InvalidArgument) as err:
        wire_jobs.draft_job_from_proto(item, job.context_tokens, 100, 64, "items[0]")
    assert err.value.field == "items[0].constraint.kind"


def test_request_manager_planner_from_reports_and_through_calls(services):
    """The request manager's planner starts from the tables the services calibrated at start-up;
    where one reports none, a few real Verify and Speculate calls measure them."""
    from specinfer.core.acceptance import DEFAULT_SLOT_PRIOR
    from specinfer.core.costs import VerifyShape
    from specinfer.request_manager.cluster.remote import Verifiers
    from specinfer.request_manager.cluster.ssm_workers import SsmWorkers
    from specinfer.request_manager.scheduling.adaptive import (
        CALIBRATION_SIZES,
        calibrate_through_calls,
        costs_from_reports,
        priors_from_reports,
    )

    async def scenario():
        verifier = Verifiers([services.llm_verifier.address], 60)
        workers = SsmWorkers([services.ssm_worker.address], 60)
        try:
            await workers.discover()
            await verifier.discover()
            info = await verifier.wait_ready(1.0)
            reported = costs_from_reports(info, workers.profiles, ["ssm", "ssm2"])
            assert reported is not None and sorted(reported.drafts) == [0, 1]
            assert priors_from_reports(workers.profiles, ["ssm"]) == {0: DEFAULT_SLOT_PRIOR}  # no tuning file installed
            measured = await calibrate_through_calls(verifier, workers, ["ssm"], info.vocab_size, None)
            assert (
                tuple(sorted(measured.verify_table.as_dict())) == CALIBRATION_SIZES
                and measured.verify_seconds(VerifyShape(4, 0)) > 0
            )
            assert 0 in measured.drafts and measured.draft_seconds(0, 4) > 0
        finally:
            await verifier.close()
            await workers.close()

    asyncio.run(scenario())


def test_calls_are_counted_under_the_grpc_service_they_call():
    """A health check is a call to ``grpc.health.v1.Health``, not to the process's own service
    (issue 40): the metrics label each call with the service in its path."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async def scenario():
        service = Service(ServerConfig("127.0.0.1", 0), [SERVICE_NAME], lambda server: None)
        await service.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{service.port}") as channel:
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
        finally:
            await service.stop()
        registry = service.metrics.registry
        samples = [s for m in registry.collect() for s in m.samples]
        started = {
            (s.labels["service"], s.labels["method"]): s.value
            for s in samples
            if s.name == "specinfer_grpc_server_started_total"
        }
        assert started == {("grpc.health.v1.Health", "Check"): 1.0}
        health = {"service": "grpc.health.v1.Health", "method": "Check", "code": "OK"}
        assert registry.get_sample_value("specinfer_grpc_server_handling_seconds_count", health) == 1.0

    asyncio.run(scenario())


FREEZE_PROBE = """
import asyncio, gc, os, signal, sys
from specinfer.serving.server import ServerConfig, Service, run_service

seen = {}
kept = [[i] for i in range(50_000)]  # what start-up left: a model, modules


async def start_up():
    seen["during start-up"] = gc.get_freeze_count()


def ready(port):
    seen["port open"] = gc.get_freeze_count()
    os.kill(os.getpid(), signal.SIGTERM)


async def main(with_start_up):
    service = Service(ServerConfig("127.0.0.1", 0, 0.1), ["probe"], lambda server: None)
    code = await run_service(service, ready=ready, start_up=start_up if with_start_up else None)
    seen["after"] = gc.get_freeze_count()
    print(code, seen["port open"], seen.get("during start-up", -1), seen["after"])


asyncio.run(main(sys.argv[1] == "1"))
"""


@pytest.mark.parametrize("with_start_up", [False, True])
def test_a_service_freezes_what_start_up_made_before_it_serves(with_start_up):
    """``run_service`` moves start-up's objects out of the garbage collector's view (``gc.freeze``) once everything
    is loaded: before the port opens, or after the start-up step (whose own objects it then covers too)."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", FREEZE_PROBE, "1" if with_start_up else "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    code, port_open, during, after = map(int, done.stdout.split())
    assert code == 0
    if with_start_up:  # the port opens before the start-up step; the freeze follows that step
        assert port_open == 0 and during == 0 and after >= 50_000
    else:
        assert port_open >= 50_000 and after >= 50_000


SIGNAL_PROBE = """
import asyncio, sys
from specinfer.serving.server import ServerConfig, Service, run_service


async def main():
    service = Service(ServerConfig("127.0.0.1", 0, 0.1), ["probe"], lambda server: None)
    code = await run_service(service, ready=lambda port: print("ready", flush=True))
    print("stopped", code, flush=True)


asyncio.run(main())
"""


def test_a_service_started_with_the_stop_signals_blocked_still_stops_on_them():
    """A signal mask survives fork and exec: ``specinfer up`` blocks SIGINT and SIGTERM around a member's restart (so
    that Ctrl-C cannot orphan it mid-fork), and a member started then had them blocked for life, deaf to a graceful
    stop (docker stop, systemd, the launcher's own). ``run_service`` unblocks them."""
    import signal
    import subprocess
    import sys

    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", SIGNAL_PROBE], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
        assert proc.returncode == 0, err
        assert out.split() == ["stopped", "0"]
    finally:
        proc.kill()
        proc.wait()


def test_no_process_is_started_with_a_preexec_fn():
    """A ``preexec_fn`` makes ``subprocess`` fork() where it would vfork(), and a fork from a process whose gRPC
    threads are busy aborts the child (SIGABRT) a few times in a hundred, before it execs: CI lost a fault campaign
    to a restarted SSM worker that died so (exit -6). The launcher, the fault campaign and the request manager all
    start processes while gRPC runs; what a child must do before it runs (unblock signals, ask for PDEATHSIG) is done
    in the child itself (``run_service``; the Redis trampoline)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    offenders = [
        f"{path.relative_to(root)}:{number}"
        for folder in ("src", "services", "bench", "scripts", "kernels", "training")
        if (root / folder).is_dir()
        for path in sorted((root / folder).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "preexec_fn=" in line.replace(" ", "")
    ]
    assert offenders == []
