"""kill -9 of an SSM worker, of the LLM verifier, of the request manager, while streams run: every
request finishes with exactly transformers' greedy output."""

from __future__ import annotations

import concurrent.futures
import os
import signal

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from oracles import hf_seeded_sampling  # tests/oracles.py
from services.harness import wait_until  # tests/services/harness.py

from specinfer.client import Client
from specinfer.core import SamplingParams
from specinfer.core.drafts import PAPER_EXPANSION
from specinfer.launcher import Stack, StackConfig
from specinfer.request_manager.startup import SPECULATION_HEALTH
from specinfer.request_manager.state.redis_server import EmbeddedRedis
from specinfer.v1 import api_pb2

from .conftest import check_streams, progress, run_streams

pytestmark = pytest.mark.reliability

STREAMS = 8
NEW_TOKENS = 64  # long enough that every stream is mid-way when the process dies (asserted)


@pytest.fixture(scope="module")
def stack(model_pair, tmp_path_factory):
    """Two SSM workers serving the same SSM (a request moves between them), short failure deadlines."""
    cfg = StackConfig(
        llm=model_pair.llm,
        ssms=(model_pair.ssm,),
        workers=2,
        port=0,
        state_dir=tmp_path_factory.mktemp("state"),
        expansion=PAPER_EXPANSION,
        threads=1,
        rm_args=("--max-batch", "16", "--ssm-failure-seconds", "5", "--rpc-timeout-seconds", "30"),
    )
    s = Stack(cfg).start()
    try:
        yield s
    finally:
        s.stop()  # processes killed on purpose exit with -9: no clean-shutdown check here


def _speculation_health(stack: Stack) -> int:
    with grpc.insecure_channel(stack.address) as channel:
        return (
            health_pb2_grpc.HealthStub(channel)
            .Check(health_pb2.HealthCheckRequest(service=SPECULATION_HEALTH), timeout=10)
            .status
        )


def _log(stack: Stack, name: str) -> str:
    return (stack.workdir / f"{name}.log").read_text(errors="replace")


def test_ssm_worker_killed_then_all_then_back(stack, model_pair, greedy):
    """kill -9 one of two SSM workers while 8 streams run: its requests move to the other; then
    kill the other too: requests decode incrementally (health says so); bring one back: speculation resumes."""
    prompts = model_pair.prompts[:STREAMS]
    assert _speculation_health(stack) == health_pb2.HealthCheckResponse.SERVING

    def kill_worker_1(client):
        stack.process("ssm-worker-1").popen.kill()

    results = run_streams(stack.address, prompts, "ssm-kill", NEW_TOKENS, kill_worker_1)
    check_streams(results, prompts, greedy, NEW_TOKENS)
    assert "SSM worker taken out" in _log(stack, "request-manager")
    assert _speculation_health(stack) == health_pb2.HealthCheckResponse.SERVING  # worker 0 still serves the SSM
    assert all(m[-1].finished.usage.mean_tree_size > 1 for m in results)

    def kill_worker_0(client):
        stack.process("ssm-worker-0").popen.kill()

    prompts = model_pair.prompts[STREAMS : STREAMS + 4]
    results = run_streams(stack.address, prompts, "ssm-none", NEW_TOKENS, kill_worker_0)
    check_streams(results, prompts, greedy, NEW_TOKENS)
    assert "no SSM worker left" in _log(stack, "request-manager")
    assert _speculation_health(stack) == health_pb2.HealthCheckResponse.NOT_SERVING
    with Client(stack.address, timeout=120) as client:
        after = client.generate(Client.request(prompts[0], 8, ignore_eos=True))
    assert after.token_ids == greedy(prompts[0], 8) and after.finished.usage.mean_tree_size == 1  # incremental decoding

    stack.process("ssm-worker-0").popen.wait()
    stack.respawn("ssm-worker-0")
    wait_until(lambda: _speculation_health(stack) == health_pb2.HealthCheckResponse.SERVING, 60, "speculation back")
    with Client(stack.address, timeout=120) as client:
        back = client.generate(Client.request(prompts[1], 16, ignore_eos=True))
    assert back.token_ids == greedy(prompts[1], 16) and back.finished.usage.mean_tree_size > 1
    assert "SSM worker back in service" in _log(stack, "request-manager")
    stack.process("ssm-worker-1").popen.wait()
    stack.respawn("ssm-worker-1")  # the next tests start request managers that want both workers


def test_slow_ssm_worker_is_taken_out_and_comes_back(stack, model_pair, greedy):
    """SIGSTOP an SSM worker (alive, connected, silent): its Speculate calls miss the deadline
    (--ssm-failure-seconds), its requests move on; after SIGCONT the health probe brings it back."""
    prompts = model_pair.prompts[32 : 32 + 4]
    worker = stack.process("ssm-worker-0")
    back = lambda: _log(stack, "request-manager").count("SSM worker back in service")  # noqa: E731
    wait_until(lambda: back() >= 2, 60, "both workers of the first test back")
    back_before, taken_out_before = back(), _log(stack, "request-manager").count("SSM worker taken out")
    try:
        results = run_streams(
            stack.address, prompts, "ssm-stop", NEW_TOKENS, lambda client: os.kill(worker.popen.pid, signal.SIGSTOP)
        )
    finally:
        os.kill(worker.popen.pid, signal.SIGCONT)
    check_streams(results, prompts, greedy, NEW_TOKENS)
    log = _log(stack, "request-manager")
    assert log.count("SSM worker taken out") > taken_out_before and "DEADLINE_EXCEEDED" in log
    wait_until(lambda: back() > back_before, 60, "the stopped worker back")


def test_verifier_killed_and_restarted(stack, model_pair, greedy):
    """kill -9 the verifier while 8 streams run, start it again on the same port: the requests wait,
    then resume with KV caches rebuilt from their committed tokens."""
    prompts = model_pair.prompts[16 : 16 + STREAMS]

    def kill_and_restart(client):
        verifier = stack.process("llm-verifier")
        verifier.popen.kill()
        verifier.popen.wait()
        before = [progress(client, f"verifier-kill-{i}") for i in range(STREAMS)]
        stack.respawn("llm-verifier")
        assert all(b < NEW_TOKENS for b in before)

    results = run_streams(stack.address, prompts, "verifier-kill", NEW_TOKENS, kill_and_restart)
    check_streams(results, prompts, greedy, NEW_TOKENS)
    assert "verifier call failed; retrying" in _log(stack, "request-manager")
    assert "verifier answers again" in _log(stack, "request-manager")


def test_request_manager_killed_clients_reattach_from_their_offset(stack, model_pair, greedy, tmp_path):
    """kill -9 the request manager while 8 streams run, start it again on the same Redis: every
    request is recovered, and each client, resuming from the offset it had reached, gets exactly
    the remaining tokens (no gap, no duplicate). (tests/e2e/test_stack.py resumes one from 0.) Two of
    the streams sample with a seed: after the restart they go on with the same draw, equal to plain
    decoding with their seeds (coupled verification)."""
    prompts = model_pair.prompts[24 : 24 + STREAMS]
    ids = [f"rm-kill-{i}" for i in range(STREAMS)]
    sampled = {STREAMS - 2: 500, STREAMS - 1: 501}  # stream -> seed
    params = SamplingParams(temperature=1.0, top_p=0.95)
    oracle = dict(
        zip(
            sampled,
            hf_seeded_sampling(
                model_pair.llm, [prompts[i] for i in sampled], list(sampled.values()), params, NEW_TOKENS, True
            ),
            strict=True,
        )
    )
    with EmbeddedRedis(tmp_path / "redis", appendonly=True, appendfsync="always") as redis:
        # the restart under the same owner takes the killed process's lease at once (docs/request-managers.md)
        args = ["--redis-url", redis.url, "--owner", "rm-kill", "--max-batch", "16", "--lease-seconds", "2"]
        args += [
            "--redis-cluster",
            "off",
            "--redis-min-replica-acks",
            "0",
        ]  # this Redis, whatever the environment says (conftest)
        first = stack.spawn_request_manager("rm-kill-1", args)

        def consume(client: Client, prompt, rid: str, seed: int | None) -> list[int]:
            seen: list[int] = []
            sampling = {} if seed is None else {"temperature": 1.0, "top_p": 0.95, "seed": seed}
            try:
                for m in client.stream(Client.request(prompt, NEW_TOKENS, request_id=rid, ignore_eos=True, **sampling)):
                    assert m.offset == len(seen)
                    seen.extend(m.token_ids)
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
            return seen

        # failover_seconds=0: the stream's error, not a reattachment (the test reattaches after the restart)
        with (
            Client(first.address, timeout=600, failover_seconds=0) as client,
            concurrent.futures.ThreadPoolExecutor(STREAMS) as pool,
        ):
            futures = [
                pool.submit(consume, client, p, r, sampled.get(i))
                for i, (p, r) in enumerate(zip(prompts, ids, strict=True))
            ]
            wait_until(lambda: all(progress(client, r) > 0 for r in ids), 120, "every stream committing")
            first.popen.kill()
            first.popen.wait()
            stack.processes.remove(first)
            seen = [f.result(timeout=60) for f in futures]
        assert all(len(s) < NEW_TOKENS for s in seen), "a stream finished before the kill"
        second = stack.spawn_request_manager("rm-kill-2", args)
        assert '"resumed requests from Redis", "count": 8' in _log(stack, "rm-kill-2")
        with Client(second.address, timeout=600) as client:
            for i, (prompt, rid, got) in enumerate(zip(prompts, ids, seen, strict=True)):
                messages = list(client.resume(rid, len(got)))
                assert messages[0].offset == len(got)
                rest = []
                for m in messages:
                    assert m.offset == len(got) + len(rest), "gap or duplicate after reattaching"
                    rest.extend(m.token_ids)
                assert messages[-1].finished.reason == api_pb2.FINISH_REASON_LENGTH
                assert got + rest == (oracle[i] if i in sampled else greedy(prompt, NEW_TOKENS)), rid
