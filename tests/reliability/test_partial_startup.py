"""Start-up with parts of the stack down (issue 20): the request manager serves as soon as the
verifier answers, adopts SSM workers when they come up, and leaves no Redis behind when it fails
or is killed. Real processes on 127.0.0.1; outputs checked against transformers' greedy decoding."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from email.message import Message
from pathlib import Path

import grpc
import pytest
from request_manager.test_redis_server import redis_servers_in  # tests/request_manager/
from services.harness import wait_until  # tests/services/harness.py

from specinfer.client import Client
from specinfer.launcher import Stack, StackConfig
from specinfer.request_manager.startup import SPECULATION_HEALTH
from specinfer.request_manager.state.redis_server import free_tcp_port
from specinfer.serving.healthcheck import check

pytestmark = pytest.mark.reliability

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def stack(model_pair, tmp_path_factory):
    """A verifier and one SSM worker; the tests start their own request managers and workers."""
    cfg = StackConfig(
        llm=model_pair.llm,
        ssms=(model_pair.ssm,),
        workers=1,
        port=0,
        state_dir=tmp_path_factory.mktemp("state"),
        threads=1,
    )
    s = Stack(cfg).start()
    try:
        yield s
    finally:
        s.stop()


def spawn(stack: Stack, name: str, module: str, args: list[str]) -> subprocess.Popen:
    """Start a service of ``stack``'s models without waiting for it (``<workdir>/<name>.port`` and
    ``.log`` as the launcher writes them)."""
    port_file = stack.workdir / f"{name}.port"
    port_file.unlink(missing_ok=True)
    log = open(stack.workdir / f"{name}.log", "ab")  # noqa: SIM115 (lives as long as the process)
    cmd = [sys.executable, "-m", module, "--host", "127.0.0.1", "--port-file", str(port_file), *args]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def port_of(stack: Stack, name: str, proc: subprocess.Popen, timeout: float = 60) -> str:
    port_file = stack.workdir / f"{name}.port"
    wait_until(
        lambda: proc.poll() is not None or (port_file.is_file() and port_file.read_text().strip() != ""),
        timeout,
        f"{name} listening",
    )
    assert proc.poll() is None, f"{name} exited with {proc.returncode}: {log_of(stack, name)[-2000:]}"
    return f"127.0.0.1:{port_file.read_text().strip()}"


def log_of(stack: Stack, name: str) -> str:
    return (stack.workdir / f"{name}.log").read_text(errors="replace")


def log_records(stack: Stack, name: str) -> list[dict]:
    out = []
    for line in log_of(stack, name).splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def worker_args(stack: Stack, port: int) -> list[str]:
    return [
        "--port",
        str(port),
        "--ssm",
        str(stack.config.ssms[0]),
        "--torch-threads",
        "1",
        "--backend",
        stack.config.backend,
    ]


def manager_args(stack: Stack, name: str, verifier: str, workers: list[str]) -> list[str]:
    return [
        "--port",
        "0",
        "--verifier",
        verifier,
        "--ssm-workers",
        ",".join(workers),
        "--model-dir",
        str(stack.config.llm),
        "--state-dir",
        str(stack.workdir / f"{name}-state"),
        "--rpc-timeout-seconds",
        "8",
        "--expansion",
        "1,1,1,1",
        "--http-port",
        "0",
    ]


def stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(10)


def generate(address: str, prompt, n: int = NEW_TOKENS):
    with Client(address, timeout=120) as client:
        return client.generate(Client.request(prompt, n, ignore_eos=True))


def test_starts_with_a_worker_down_and_adopts_it(stack, model_pair, greedy):
    """The issue's reproduction: a verifier and one worker up, a second worker address down. The
    manager serves at once (not after --rpc-timeout-seconds), speculates with the live worker, and
    adopts the other when it comes up: killing the first then leaves speculation running."""
    up = stack.process("ssm-worker-0").address
    down_port = free_tcp_port()
    name = "rm-one-down"
    rm = spawn(
        stack,
        name,
        "specinfer.request_manager",
        manager_args(stack, name, stack.process("llm-verifier").address, [up, f"127.0.0.1:{down_port}"]),
    )
    late: subprocess.Popen | None = None
    try:
        address = port_of(stack, name, rm)
        wait_until(lambda: check(address, timeout=2) == "SERVING", 30, "request manager serving")
        records = log_records(stack, name)
        listening = next(r["ts"] for r in records if r["msg"] == "listening; starting up")
        serving = next(r["ts"] for r in records if r["msg"] == "serving")
        assert serving - listening < 1.5, f"took {serving - listening:.2f} s to serve with a worker down"
        assert check(address, timeout=2, service=SPECULATION_HEALTH) == "SERVING"  # the SSM has a live worker
        prompt = model_pair.prompts[0]
        first = generate(address, prompt)
        assert list(first.token_ids) == greedy(prompt, NEW_TOKENS) and first.finished.usage.mean_tree_size > 1

        late = spawn(stack, "ssm-worker-late", "specinfer.ssm_worker", worker_args(stack, down_port))
        port_of(stack, "ssm-worker-late", late)
        wait_until(lambda: "SSM workers changed" in log_of(stack, name), 60, "the late worker adopted")
        stack.process("ssm-worker-0").popen.kill()  # now only the adopted worker can draft
        prompt = model_pair.prompts[1]
        after = generate(address, prompt)
        assert list(after.token_ids) == greedy(prompt, NEW_TOKENS) and after.finished.usage.mean_tree_size > 1
        assert check(address, timeout=2, service=SPECULATION_HEALTH) == "SERVING"
    finally:
        assert stop(rm) == 0
        if late is not None:
            stop(late)
        stack.process("ssm-worker-0").popen.wait()
        stack.respawn("ssm-worker-0")
    assert redis_servers_in(stack.workdir / f"{name}-state") == []


def test_starts_with_the_verifier_and_every_worker_down(stack, model_pair, greedy):
    """Nothing but the manager is up: it listens (health NOT_SERVING, calls UNAVAILABLE), serves once a
    verifier comes up (generating without speculation: no SSM is known yet), then speculates once a
    worker comes up, exactly."""
    verifier_port, worker_port, http_port = free_tcp_port(), free_tcp_port(), free_tcp_port()
    name = "rm-all-down"
    args = manager_args(stack, name, f"127.0.0.1:{verifier_port}", [f"127.0.0.1:{worker_port}"])
    rm = spawn(stack, name, "specinfer.request_manager", [*args, "--http-port", str(http_port)])
    started: list[subprocess.Popen] = []
    try:
        address = port_of(stack, name, rm)
        time.sleep(10)  # beyond --rpc-timeout-seconds: it must not give up
        assert rm.poll() is None
        assert check(address, timeout=2) == "NOT_SERVING"
        with pytest.raises(grpc.RpcError) as refused:
            generate(address, model_pair.prompts[0])
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "starting" in refused.value.details()
        base = f"http://127.0.0.1:{http_port}"
        assert http_call(f"{base}/health")[:2] == (503, {"status": "starting", "detail": refused.value.details()})
        status, body, headers = http_call(f"{base}/v1/completions", {"prompt": "x", "max_tokens": 1})
        assert status == 503 and body["error"]["code"] == "unavailable" and headers.get("Retry-After") == "1"

        verifier_args = [
            "--port",
            str(verifier_port),
            "--llm",
            str(stack.config.llm),
            "--torch-threads",
            "1",
            "--backend",
            stack.config.backend,
        ]
        started.append(spawn(stack, "llm-verifier-late", "specinfer.llm_verifier", verifier_args))
        wait_until(
            lambda: check(address, timeout=2) == "SERVING", 120, "request manager serving once the verifier is up"
        )
        prompt = model_pair.prompts[2]
        plain = generate(address, prompt)
        assert list(plain.token_ids) == greedy(prompt, NEW_TOKENS) and plain.finished.usage.mean_tree_size == 1
        assert check(address, timeout=2, service=SPECULATION_HEALTH) == "NOT_SERVING"  # no worker yet

        started.append(spawn(stack, "ssm-worker-late2", "specinfer.ssm_worker", worker_args(stack, worker_port)))
        wait_until(lambda: "speculating with more SSMs" in log_of(stack, name), 120, "the SSM adopted")
        with Client(address, timeout=30) as client:
            assert list(client.model_info().ssms) == [Path(stack.config.ssms[0]).name]
        prompt = model_pair.prompts[3]
        spec = generate(address, prompt)
        assert list(spec.token_ids) == greedy(prompt, NEW_TOKENS) and spec.finished.usage.mean_tree_size > 1
        assert check(address, timeout=2, service=SPECULATION_HEALTH) == "SERVING"
    finally:
        assert stop(rm) == 0
        for proc in started:
            stop(proc)
    assert redis_servers_in(stack.workdir / f"{name}-state") == []


def http_call(url: str, body: dict | None = None) -> tuple[int, dict, Message]:
    """(status, JSON body, headers: case-insensitive) of a GET, or a POST of ``body``."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as reply:
            return reply.status, json.loads(reply.read()), reply.headers
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), exc.headers


def test_verifier_lost_after_start_up(stack, model_pair, greedy):
    """The verifier dies after start-up: a running request waits for it; meanwhile health is
    NOT_SERVING (gRPC) and 503 (HTTP /health), and a new HTTP request is answered 503 with
    Retry-After at once. Once a verifier is back on the address, the waiting request finishes
    exactly and everything serves again."""
    verifier_port, http_port = free_tcp_port(), free_tcp_port()
    verifier_args = [
        "--port",
        str(verifier_port),
        "--llm",
        str(stack.config.llm),
        "--torch-threads",
        "1",
        "--backend",
        stack.config.backend,
    ]
    verifier = spawn(stack, "llm-verifier-lost", "specinfer.llm_verifier", verifier_args)
    name = "rm-verifier-lost"
    args = manager_args(stack, name, f"127.0.0.1:{verifier_port}", [stack.process("ssm-worker-0").address])
    rm = spawn(stack, name, "specinfer.request_manager", [*args, "--http-port", str(http_port)])
    base = f"http://127.0.0.1:{http_port}"
    try:
        address = port_of(stack, name, rm)
        wait_until(lambda: check(address, timeout=2) == "SERVING", 120, "request manager serving")
        assert http_call(f"{base}/health")[0] == 200
        verifier.kill()
        verifier.wait()
        prompt = model_pair.prompts[4]
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(generate, address, prompt)  # its verify call fails: the manager learns
            wait_until(lambda: check(address, timeout=2) == "NOT_SERVING", 30, "health NOT_SERVING without a verifier")
            status, body, _ = http_call(f"{base}/health")
            assert status == 503 and "verifier" in body["detail"]
            status, body, headers = http_call(f"{base}/v1/completions", {"prompt": prompt, "max_tokens": 4})
            assert (
                status == 503 and body["error"]["code"] == "verifier_unavailable" and headers.get("Retry-After") == "1"
            )
            assert not waiting.done()  # the running request waits instead
            verifier = spawn(stack, "llm-verifier-lost", "specinfer.llm_verifier", verifier_args)
            result = waiting.result(timeout=180)
        assert list(result.token_ids) == greedy(prompt, NEW_TOKENS)
        wait_until(lambda: check(address, timeout=2) == "SERVING", 30, "health SERVING again")
        status, body, _ = http_call(
            f"{base}/v1/completions", {"prompt": prompt, "max_tokens": NEW_TOKENS, "ignore_eos": True}
        )
        assert status == 200 and body["choices"][0]["text"]
        assert http_call(f"{base}/health")[0] == 200
    finally:
        assert stop(rm) == 0
        stop(verifier)
    assert redis_servers_in(stack.workdir / f"{name}-state") == []


def test_failed_start_up_leaves_no_redis(stack, tmp_path):
    """A start-up that fails (a default SSM no worker serves) exits 1 and stops its embedded Redis."""
    state = tmp_path / "state"
    args = manager_args(
        stack, "rm-fails", stack.process("llm-verifier").address, [stack.process("ssm-worker-0").address]
    )
    args[args.index("--state-dir") + 1] = str(state)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "specinfer.request_manager",
            "--host",
            "127.0.0.1",
            *args,
            "--default-ssms",
            "no-such-ssm",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "no-such-ssm" in proc.stderr
    assert redis_servers_in(state) == []


def test_killed_manager_leaves_no_redis_and_a_successor_resumes(stack, model_pair, greedy):
    """kill -9 of the request manager: its embedded Redis goes with it (after flushing), a second
    manager on the same state dir while the first lives is refused, and a successor resumes from the
    same state: a finished request's result is still there."""
    name = "rm-killed"
    args = manager_args(stack, name, stack.process("llm-verifier").address, [stack.process("ssm-worker-0").address])
    state = Path(args[args.index("--state-dir") + 1])
    first = spawn(stack, name, "specinfer.request_manager", args)
    try:
        address = port_of(stack, name, first)
        wait_until(lambda: check(address, timeout=2) == "SERVING", 60, "first manager serving")
        prompt = model_pair.prompts[4]
        done = generate(address, prompt)
        assert list(done.token_ids) == greedy(prompt, NEW_TOKENS)
        twin = subprocess.run(
            [sys.executable, "-m", "specinfer.request_manager", "--host", "127.0.0.1", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert twin.returncode == 1 and "in use by another process" in twin.stderr, twin.stderr[-2000:]
        assert len(redis_servers_in(state)) == 1  # the refused twin started nothing
        first.kill()
        first.wait(10)
        wait_until(lambda: redis_servers_in(state) == [], 10, "the killed manager's Redis gone")
    finally:
        stop(first)
    second = spawn(stack, name + "-2", "specinfer.request_manager", args)
    try:
        address = port_of(stack, name + "-2", second)
        wait_until(lambda: check(address, timeout=2) == "SERVING", 60, "successor serving")
        with Client(address, timeout=30) as client:
            assert list(client.get_request(done.request_id).output_token_ids) == greedy(prompt, NEW_TOKENS)
    finally:
        assert stop(second) == 0
    assert redis_servers_in(state) == []
