"""LlmVerifier over gRPC (a separate process) against verify_trees in process."""

from __future__ import annotations

import itertools

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from specinfer import wire, wire_jobs
from specinfer.core import DraftTree, ExpansionConfig, SamplingParams, TokenTree
from specinfer.core.costs import BUCKETS
from specinfer.core.iteration import DraftSpec, VerifySpec, draft_stream
from specinfer.models.drafting import draft_trees
from specinfer.models.loading import load_backend
from specinfer.models.verification import verify_trees
from specinfer.v1 import internal_pb2

_ids = itertools.count()

GREEDY = SamplingParams()
SAMPLING = SamplingParams(temperature=0.9, top_p=0.9)


def fresh_id(prefix: str) -> str:
    return f"{prefix}-{next(_ids)}"


@pytest.fixture(scope="module")
def local_models(model_pair):
    """The verifier's LLM and an SSM in process (backend auto, as in the services)."""
    return load_backend(model_pair.llm, "llm", "float32", kv_cache_bytes=128 << 20), load_backend(
        model_pair.ssm, "ssm", "float32", kv_cache_bytes=16 << 20
    )


@pytest.fixture
def local(local_models):
    """:func:`local_models`, whose KV caches are freed after each test."""
    yield local_models
    for model in local_models:
        for rid in model.cached_requests():
            model.release(rid)


def drafted_jobs(local, model_pair, sampling: SamplingParams, prefix: str, count: int = 3) -> list[VerifySpec]:
    """Verify jobs on trees the SSM drafted for the first prompts (fresh request IDs)."""
    ssm = local[1]
    prompts = model_pair.prompts[:count]
    ids = [fresh_id(prefix) for _ in prompts]
    drafts = draft_trees(
        ssm,
        [
            DraftSpec(rid, p[:-1], p[-1], ExpansionConfig((2, 2, 1)), sampling, 32, 7, 0, draft_stream(0))
            for rid, p in zip(ids, prompts, strict=True)
        ],
    )
    jobs = []
    for i, (rid, p, d) in enumerate(zip(ids, prompts, drafts, strict=True)):
        # the verifier's stream of step i: (seed 40 + i, step i), as verify_item(job, 40 + i, i) asks
        jobs.append(VerifySpec(rid, list(p[:-1]), d, sampling, 40 + i, i))
    return jobs


def verify_item(
    job: VerifySpec, seed: int, step: int, offset: int = 0, output_start: int = 0
) -> internal_pb2.VerifyItem:
    return internal_pb2.VerifyItem(
        context=wire_jobs.context_to_proto(job.request_id, job.context_tokens, offset),
        tree=wire.draft_to_proto(job.draft),
        sampling=wire.sampling_to_proto(job.sampling),
        seed=seed,
        step=step,
        output_start=output_start,
    )


def release(stub, ids) -> None:
    stub.Release(internal_pb2.ReleaseRequest(request_ids=list(ids)), timeout=10)


def greedy_continuation(model, tokens: list[int], n: int) -> list[int]:
    """The LLM's own argmax decoding, n tokens (the oracle of greedy verification)."""
    seq = list(tokens)
    with torch.inference_mode():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(tokens) :]


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLING], ids=["greedy", "sampling"])
def test_verify_matches_verify_trees(services, local, model_pair, sampling):
    jobs = drafted_jobs(local, model_pair, sampling, "verify")
    # the service derives each job's generator from (seed, step) and the verifier's stream, as drafted_jobs did
    request = internal_pb2.VerifyRequest(items=[verify_item(j, 40 + i, i) for i, j in enumerate(jobs)])
    response = services.llm_stub.Verify(request, timeout=60)
    want = verify_trees(local[0], jobs)
    assert [r.request_id for r in response.results] == [j.request_id for j in jobs]
    for result, expected in zip(response.results, want, strict=True):
        assert not result.cache_miss
        assert tuple(result.accepted_tokens) == expected.accepted_tokens  # the root excluded
        assert result.bonus_token == expected.bonus_token
    if sampling.greedy:
        hf = AutoModelForCausalLM.from_pretrained(str(model_pair.llm), dtype=torch.float32).eval()
        for job, result in zip(jobs, response.results, strict=True):
            committed = [*result.accepted_tokens, result.bonus_token]
            assert committed == greedy_continuation(hf, [*job.context_tokens, job.draft.tree.tokens[0]], len(committed))
        assert any(r.accepted_tokens for r in response.results), "the trained SSM should get some token accepted"
    release(services.llm_stub, [j.request_id for j in jobs])


def test_verify_cache_miss_protocol(services, local, model_pair):
    stub = services.llm_stub
    (job,) = drafted_jobs(local, model_pair, GREEDY, "vmiss", count=1)
    # a miss is a miss, whatever the item says of its output (the context is checked only once the verifier has it:
    # an output start past the few tokens a delta carries was refused, and the request manager retried forever)
    prompt = len(job.context_tokens) + 1
    miss_item = verify_item(job, 0, 0, offset=2, output_start=prompt)
    (miss,) = stub.Verify(internal_pb2.VerifyRequest(items=[miss_item]), timeout=30).results
    assert miss.cache_miss and not miss.accepted_tokens
    (hit,) = stub.Verify(internal_pb2.VerifyRequest(items=[verify_item(job, 0, 0, offset=0)]), timeout=30).results
    assert not hit.cache_miss
    # the next step sends only the newly committed tokens
    committed = [*job.context_tokens, job.draft.tree.tokens[0], *hit.accepted_tokens]
    nxt = VerifySpec(
        job.request_id, committed, DraftTree(TokenTree.root_only(hit.bonus_token)), GREEDY, job.seed, job.step
    )
    (hit2,) = stub.Verify(
        internal_pb2.VerifyRequest(items=[verify_item(nxt, 0, 1, offset=len(job.context_tokens))]), timeout=30
    ).results
    assert not hit2.cache_miss
    release(stub, [job.request_id])
    (miss,) = stub.Verify(
        internal_pb2.VerifyRequest(items=[verify_item(nxt, 0, 2, offset=len(nxt.context_tokens), output_start=prompt)]),
        timeout=30,
    ).results
    assert miss.cache_miss


def test_get_info(services, model_pair):
    info = services.llm_stub.GetInfo(internal_pb2.LlmInfoRequest(), timeout=10)
    assert info.model == "llm"
    assert info.vocab_size == local_vocab(model_pair)
    assert info.max_positions > 0
    assert info.max_requests > 0  # the native backend's KV pool (256 MiB in the fixture)
    # start-up calibration (--calibrate-tokens, default 64): verify seconds at every cost bucket up to 64 tokens
    table = wire.cost_table_from_proto(info.verify_costs)
    assert table is not None and [p.tokens for p in info.verify_costs] == [b for b in BUCKETS if b <= 64]
    assert all(p.seconds > 0 for p in info.verify_costs) and info.verify_seconds_per_context_token >= 0


def local_vocab(model_pair) -> int:
    import json

    return json.loads((model_pair.llm / "config.json").read_text())["vocab_size"]


def _tree(request, tokens, parents):
    del request.items[0].tree.groups[:]
    request.items[0].tree.tokens[:] = tokens
    request.items[0].tree.parents[:] = parents


BAD_REQUESTS = {
    "parent-not-before-child": (
        lambda r: _tree(r, [5, 6, 7], [-1, 0, 2]),
        "items[0].tree: parents[2] = 2 must be in [0, 2)",
    ),
    "root-has-parent": (lambda r: _tree(r, [5, 6], [0, 0]), "items[0].tree"),
    "empty-tree": (lambda r: _tree(r, [], []), "items[0].tree"),
    "tree-token-out-of-vocab": (lambda r: r.items[1].tree.tokens.__setitem__(1, 1 << 20), "items[1].tree.tokens"),
    "context-token-out-of-vocab": (lambda r: r.items[1].context.tokens.__setitem__(0, -3), "items[1].context.tokens"),
    "temperature-negative": (
        lambda r: setattr(r.items[0].sampling, "temperature", -1.0),
        "items[0].sampling.temperature",
    ),
    "sampling-without-q": (
        lambda r: [g.ClearField("q_tokens") or g.ClearField("q_probs") for g in r.items[0].tree.groups],
        "items[0].tree.groups",
    ),
    "q-token-out-of-vocab": (
        lambda r: r.items[0].tree.groups[0].q_tokens.__setitem__(0, 1 << 20),
        "items[0].tree.groups[0].q_tokens",
    ),
    "bad-group-child": (lambda r: r.items[0].tree.groups[0].children.__setitem__(0, 99), "items[0].tree.groups[0]"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_invalid_argument_names_the_field(services, local, model_pair, case):
    mutate, expected = BAD_REQUESTS[case]
    jobs = drafted_jobs(local, model_pair, SAMPLING, "bad", count=2)
    request = internal_pb2.VerifyRequest(items=[verify_item(j, 1, 0) for j in jobs])
    mutate(request)
    with pytest.raises(grpc.RpcError) as err:
        services.llm_stub.Verify(request, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert expected in err.value.details()
    # the verifier goes on serving
    good = internal_pb2.VerifyRequest(items=[verify_item(j, 1, 0) for j in jobs])
    assert not any(r.cache_miss for r in services.llm_stub.Verify(good, timeout=30).results)
    release(services.llm_stub, [j.request_id for j in jobs])


def twin_jobs(local, model_pair, prefix: str) -> tuple[list[VerifySpec], list[VerifySpec]]:
    """Two drafted greedy jobs, and the same two under other request IDs (for unary calls beside them)."""
    jobs = drafted_jobs(local, model_pair, GREEDY, prefix, count=2)
    twins = [VerifySpec(fresh_id("unary"), j.context_tokens, j.draft, GREEDY, 40 + i, i) for i, j in enumerate(jobs)]
    return jobs, twins


def request(jobs: list[VerifySpec]) -> internal_pb2.VerifyRequest:
    return internal_pb2.VerifyRequest(items=[verify_item(j, 40 + i, i) for i, j in enumerate(jobs)])


def verdicts(response: internal_pb2.VerifyResponse) -> list[tuple[tuple[int, ...], int]]:
    return [(tuple(r.accepted_tokens), r.bonus_token) for r in response.results]


async def answers_as_unary(verify, stub, jobs: list[VerifySpec], twins: list[VerifySpec]) -> None:
    """``verify``'s exchanges answer what unary Verify calls of the same trees (``twins``) answer, the second on the
    same stream or connection too (the contexts are known); an invalid tree ends it with INVALID_ARGUMENT naming the
    field; the next call opens another, which knows the contexts."""
    for _ in range(2):
        assert verdicts(await verify(request(jobs), 30)) == verdicts(await stub.Verify(request(twins), timeout=30))
    bad = request(jobs)
    bad.items[0].tree.parents[0] = 0
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await verify(bad, 30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "items[0].tree" in err.value.details()
    assert all(not r.cache_miss for r in (await verify(request(jobs), 30)).results)


def test_verify_calls_over_a_stream_answer_what_unary_calls_answer(services, local, model_pair):
    """The request manager's StreamedUnary (services/request_manager/cluster/streamed.py) against the real verifier:
    each exchange answers what a Verify call answers; an invalid request ends its stream with the status Verify
    returns, naming the field, and the next call opens another; a call past its timeout is DEADLINE_EXCEEDED; a
    server without the stream method gets unary calls."""
    import asyncio

    from specinfer.request_manager.cluster.streamed import StreamedUnary
    from specinfer.v1 import internal_pb2_grpc

    streamed_jobs, unary_jobs = twin_jobs(local, model_pair, "streamed")

    async def scenario():
        async with grpc.aio.insecure_channel(services.llm_verifier.address) as channel:
            stub = internal_pb2_grpc.LlmVerifierStub(channel)
            verify = StreamedUnary(stub.VerifyStream, stub.Verify, ())
            await answers_as_unary(verify, stub, streamed_jobs, unary_jobs)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await verify(request(streamed_jobs), 1e-6)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert verify.streams
            # the SSM worker has no such stream method: the calls go unary (here to the verifier's Verify)
            async with grpc.aio.insecure_channel(services.ssm_worker.address) as other:
                missing = other.stream_stream(
                    "/specinfer.v1.LlmVerifier/VerifyStream",
                    internal_pb2.VerifyRequest.SerializeToString,
                    internal_pb2.VerifyResponse.FromString,
                )
                fallback = StreamedUnary(missing, stub.Verify, ())
                assert all(not r.cache_miss for r in (await fallback(request(unary_jobs), 30)).results)
                assert not fallback.streams

    asyncio.run(scenario())
    release(services.llm_stub, [j.request_id for j in streamed_jobs + unary_jobs])


def test_verify_calls_over_the_socket_answer_what_unary_calls_answer(services, local, model_pair):
    """The verify socket (specinfer/serving/socket_calls.py) of the real verifier, which GetInfo names: each
    exchange answers what a Verify call answers; an invalid request ends its connection with the status Verify
    returns, naming the field, and the next call opens another; bytes that are no VerifyRequest get
    INVALID_ARGUMENT; a socket that moved (a restart) is asked for again, and one that cannot be reached sends the
    replica's calls over gRPC's stream (SocketFirst)."""
    import asyncio

    from specinfer.request_manager.cluster.streamed import SocketFirst, StreamedUnary
    from specinfer.serving.security import ClientAuth
    from specinfer.serving.socket_calls import SocketUnary
    from specinfer.v1 import internal_pb2_grpc

    port = services.llm_stub.GetInfo(internal_pb2.LlmInfoRequest(), timeout=10).socket_port
    assert port > 0
    host = services.llm_verifier.address.rpartition(":")[0]
    socket_jobs, unary_jobs = twin_jobs(local, model_pair, "socket")

    async def scenario():
        verify = SocketUnary(host, port, internal_pb2.VerifyResponse, ClientAuth())
        async with grpc.aio.insecure_channel(services.llm_verifier.address) as channel:
            stub = internal_pb2_grpc.LlmVerifierStub(channel)
            await answers_as_unary(verify, stub, socket_jobs, unary_jobs)
            garbage = SocketUnary(host, port, internal_pb2.VerifyResponse, ClientAuth())
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await garbage(Garbage(), 30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request" in err.value.details()
            verify.close()
            closed = free_port()

            async def asked(timeout: float) -> int:  # what the verifier says its socket's port is
                return (await stub.GetInfo(internal_pb2.LlmInfoRequest(), timeout=timeout)).socket_port

            async def still_closed(timeout: float) -> int:  # a port it says, which this client cannot reach
                return closed

            # a port nothing listens on any more (a restarted verifier listens elsewhere): asked again, it moves
            moved = SocketFirst(
                SocketUnary(host, closed, internal_pb2.VerifyResponse, ClientAuth()),
                StreamedUnary(stub.VerifyStream, stub.Verify, ()),
                asked,
            )
            assert all(not r.cache_miss for r in (await moved(request(socket_jobs), 30)).results)
            assert moved.socket is not None and moved.socket.port == port and moved.socket.reached
            moved.close()
            # a port it names but this client cannot reach (a network policy): the calls go over the stream
            unreachable = SocketUnary(host, closed, internal_pb2.VerifyResponse, ClientAuth())
            calls = SocketFirst(unreachable, StreamedUnary(stub.VerifyStream, stub.Verify, ()), still_closed)
            assert all(not r.cache_miss for r in (await calls(request(socket_jobs), 30)).results)
            assert calls.socket is None and not unreachable.reached
            calls.close()

    asyncio.run(scenario())
    release(services.llm_stub, [j.request_id for j in socket_jobs + unary_jobs])


class Garbage:
    """A request whose bytes parse as no protobuf message (a truncated varint)."""

    def SerializeToString(self) -> bytes:
        return b"\xff\xff\xff"


def free_port() -> int:
    """A port nothing listens on (bound, then closed)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
