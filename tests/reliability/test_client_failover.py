"""Our own client survives what the stack survives (issue 54): ``specinfer up --request-managers 2``, a stream
from ``specinfer generate --server A,B`` and one from ``Client([B, A])``, and kill -9 of the request manager each
stream is on, mid-stream: each client reattaches through the other manager from the last token it received, and
its text and tokens equal an undisturbed run's. The killed manager, started again by ``up``, takes its own
ownership lease at once (its predecessor's process is gone) instead of waiting out a 60 s lease.

The same stack serves the default speculation of ``SPECINFER_EXPANSION``, a ``specinfer tune`` result whose tree,
merged over the demo's three SSMs, is larger than the request manager's default --max-tree-nodes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import pytest
from services.harness import SPECINFER, SpecinferUp, processes_naming  # tests/services/harness.py

from specinfer.client import Client, Failover
from specinfer.v1 import api_pb2

pytestmark = pytest.mark.reliability

LEASE_SECONDS = 60  # a restart that waited for its own lease to lapse would wait 40 s or more
NEW_TOKENS = 400
PROMPT = "class Stack:\n"
TUNED = "2,2,2,1"  # 23 nodes: with three SSMs up to 67, over the request manager's default 64


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("failover")
    (tmp / "tuning.json").write_text(json.dumps({"pick": {"expansion": TUNED}}))
    env = {k: v for k, v in os.environ.items() if k != "SPECINFER_DEMO_MODELS"}  # the bundled demo models
    env |= {
        "SPECINFER_EXPANSION": f"@{tmp / 'tuning.json'}",
        "SPECINFER_LEASE_SECONDS": str(LEASE_SECONDS),
        "SPECINFER_RPC_TIMEOUT_SECONDS": "30",
    }
    args = ["--request-managers", "2", "--port", "0", "--http-port", "0", "--state-dir", str(tmp / "state")]
    up = SpecinferUp([*args, "--verifier-threads", "1"], env)
    try:
        up.wait_serving()
        yield up, env
    finally:
        code = up.stop()
        assert code == 0, up.output
        assert processes_naming(str(tmp)) == [], "processes left after specinfer up stopped"


def generate(env: dict[str, str], servers: str, **popen) -> subprocess.Popen:
    return subprocess.Popen(
        [str(SPECINFER), "generate", "--server", servers, "--max-new-tokens", str(NEW_TOKENS), PROMPT],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        **popen,
    )


def kill_and_time_restart(up: SpecinferUp, name: str) -> float:
    """kill -9 member ``name`` (as first started); seconds until ``up`` reports it SERVING again."""
    address, pid = up.members()[name]
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    up.wait_line(rf"{name} SERVING again on {re.escape(address)} \(pid \d+, restart 1,", 120, f"{name} back")
    return time.monotonic() - killed


def test_the_stack_serves_the_default_tree_of_the_environment(stack):
    up, _ = stack
    with Client(up.members()["request-manager"][0], timeout=60) as client:
        info = client.model_info()
    assert len(info.ssms) == 3 and info.default_speculation == TUNED, info
    assert ",".join(map(str, info.default_expansion)) == TUNED, info


def test_generate_with_two_servers_survives_a_kill_of_the_one_it_streams_from(stack):
    up, env = stack
    members = up.members()
    servers = f"{members['request-manager'][0]},{members['request-manager-1'][0]}"
    calm = generate(env, servers)
    want, calm_err = calm.communicate(timeout=300)
    assert calm.returncode == 0, calm_err
    done = re.search(r"^--- (\d+) tokens in", want, re.M)
    assert done and int(done[1]) > 100, want  # long enough to be killed in the middle

    disturbed = generate(env, servers, bufsize=1)
    head = ""
    while "--- generated (streamed)\n" not in head or len(head.split("--- generated (streamed)\n", 1)[1]) < 8:
        head += disturbed.stdout.read(1)  # until some of the text has arrived
    restart_s = kill_and_time_restart(up, "request-manager")
    got = head + disturbed.stdout.read()  # not communicate(): it would skip what the pipe's reader holds already
    err = disturbed.stderr.read()
    disturbed.wait(60)
    assert disturbed.returncode == 0, err
    moved = re.search(r"request manager (\S+) failed .*; reattaching through (\S+) from token (\d+)", err)
    assert moved, err
    assert (moved[1], moved[2]) == tuple(servers.split(",")) and 0 < int(moved[3]) < int(done[1]), err
    # the text equals the undisturbed run's (the statistics line after it counts steps, which may differ)
    text, calm_text = got.split("\n--- ", 2)[:2], want.split("\n--- ", 2)[:2]
    assert text == calm_text, f"{len(text[1])} characters against {len(calm_text[1])}:\n{got}\n{err}"
    assert re.search(rf"^--- {done[1]} tokens in", got, re.M), got
    assert restart_s < LEASE_SECONDS / 3, f"the restarted request manager served {restart_s:.1f} s after the kill"


def test_the_python_client_fails_over_between_managers_and_resumes_the_stream(stack):
    up, _ = stack
    members = up.members()
    order = [members["request-manager-1"][0], members["request-manager"][0]]  # this time the other one goes
    request = Client.request(PROMPT, NEW_TOKENS, ignore_eos=True)
    with Client(order, timeout=300) as client:
        calm = client.generate(request)
    moves: list[Failover] = []
    messages: list[api_pb2.GenerateResponse] = []
    with Client(order, timeout=300, on_failover=moves.append) as client:
        stream = client.stream(request)
        for msg in stream:
            messages.append(msg)
            if sum(len(m.token_ids) for m in messages) >= 16:
                break
        restart_s = kill_and_time_restart(up, "request-manager-1")
        messages += list(stream)
    tokens = [t for m in messages for t in m.token_ids]
    offsets = [m.offset for m in messages]
    assert offsets == [sum(len(m.token_ids) for m in messages[:k]) for k in range(len(messages))], "gap or repeat"
    assert tokens == calm.token_ids and "".join(m.text for m in messages) == calm.text
    assert len(tokens) == NEW_TOKENS and messages[-1].finished.reason == api_pb2.FINISH_REASON_LENGTH
    assert [(m.failed, m.next) for m in moves] == [tuple(order)] and moves[0].received >= 16, moves
    assert restart_s < LEASE_SECONDS / 3, f"the restarted request manager served {restart_s:.1f} s after the kill"


def test_one_target_of_several_addresses_fails_over_inside_grpc(stack):
    """A target that resolves to several addresses (a DNS name with several records; here gRPC's ``ipv4:`` list
    of both managers) is one entry: after a kill, the client's fresh channel connects to the first address that
    answers and the stream reattaches there."""
    up, _ = stack
    members = up.members()
    main = members["request-manager"][0]
    request = Client.request(PROMPT, NEW_TOKENS, ignore_eos=True)
    target = f"ipv4:{main},{members['request-manager-1'][0]}"
    moves: list[Failover] = []
    with Client(target, timeout=300, on_failover=moves.append) as client:
        calm = client.generate(request)
        stream = client.stream(request)
        messages = [next(stream)]
        restarted = re.findall(rf"request-manager SERVING again on {re.escape(main)} \(pid (\d+),", up.output)
        os.kill(int(restarted[-1]) if restarted else members["request-manager"][1], signal.SIGKILL)
        messages += list(stream)
    assert [t for m in messages for t in m.token_ids] == calm.token_ids
    assert "".join(m.text for m in messages) == calm.text
    assert [(m.failed, m.next) for m in moves] == [(target, target)] and moves[0].received < NEW_TOKENS, moves
