"""``specinfer up`` supervises its processes (issue 34, item 4): with two verifier replicas and two
request managers, kill -9 of one of each while 8 streams run ends every stream exactly as
transformers' greedy (the request managers fail over between the verifiers and adopt each other's
requests), the launcher starts both killed processes again on their ports (health SERVING there),
and Ctrl-C leaves no process behind. A process that fails at start-up again and again stops the
stack instead, with its last log lines."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import re
import shutil
import signal
from pathlib import Path

import pytest
from services.harness import SpecinferUp, processes_naming, wait_until  # tests/services/harness.py

from specinfer.client import Client
from specinfer.core.drafts import PAPER_EXPANSION
from specinfer.serving.healthcheck import check
from specinfer.v1 import api_pb2

from .conftest import check_streams, progress, run_streams

pytestmark = pytest.mark.reliability

STREAMS = 8
NEW_TOKENS = 64


def up_env() -> dict[str, str]:
    # short leases: the surviving request manager adopts the killed one's requests within seconds
    return {
        **os.environ,
        "SPECINFER_LEASE_SECONDS": "3",
        "SPECINFER_RPC_TIMEOUT_SECONDS": "30",
        "SPECINFER_MAX_BATCH": "16",
    }


def up_args(llm: Path, ssm: Path, tmp_path: Path, *extra: str) -> list[str]:
    """``specinfer up``'s arguments: these models, free ports, a state folder in ``tmp_path``, then ``extra``."""
    return [
        *("--llm", str(llm), "--ssm", str(ssm)),
        *("--port", "0", "--http-port", "0", "--state-dir", str(tmp_path / "state")),
        *extra,
    ]


def stream_with_failover(addresses: list[str], prompt, rid: str) -> list[api_pb2.GenerateResponse]:
    """Stream ``rid`` through ``addresses[0]``; when that request manager goes away (UNAVAILABLE), the client
    reattaches through the next one from the tokens received so far (specinfer.client's failover)."""
    with Client(addresses, timeout=600) as client:
        return list(client.stream(Client.request(prompt, NEW_TOKENS, request_id=rid, ignore_eos=True)))


def test_up_restarts_a_killed_verifier_and_request_manager_and_every_stream_stays_exact(model_pair, greedy, tmp_path):
    up = SpecinferUp(
        up_args(
            model_pair.llm,
            model_pair.ssm,
            tmp_path,
            "--verifiers",
            "2",
            "--request-managers",
            "2",
            "--expansion",
            PAPER_EXPANSION,
            "--verifier-threads",
            "1",
        ),
        up_env(),
    )
    try:
        up.wait_serving()
        members = up.members()
        assert {"llm-verifier", "llm-verifier-1", "ssm-worker-0", "request-manager", "request-manager-1"} <= set(
            members
        ), up.output
        main, other = members["request-manager"][0], members["request-manager-1"][0]
        prompts = model_pair.prompts[:STREAMS]
        ids = [f"up-{tmp_path.name}-{i}" for i in range(STREAMS)]
        # half the streams on each request manager; each reattaches through the other if its own goes away
        routes = [[main, other] if i % 2 == 0 else [other, main] for i in range(STREAMS)]
        with concurrent.futures.ThreadPoolExecutor(STREAMS) as pool, Client(main, timeout=60) as client:
            futures = [
                pool.submit(stream_with_failover, r, p, rid) for r, p, rid in zip(routes, prompts, ids, strict=True)
            ]
            wait_until(lambda: all(progress(client, r) > 0 for r in ids), 180, "every stream committing")
            assert all(progress(client, r) < NEW_TOKENS for r in ids), (
                "a stream finished before the kills: ask for more tokens"
            )
            for name in ("llm-verifier-1", "request-manager-1"):
                os.kill(members[name][1], signal.SIGKILL)
            results = [f.result(timeout=600) for f in futures]
        check_streams(results, prompts, greedy, NEW_TOKENS)

        # both are back, on the ports they had (the others reach them there)
        for name in ("llm-verifier-1", "request-manager-1"):
            address, old_pid = members[name]
            up.wait_line(
                rf"{name} \(pid {old_pid}\) exited with -9; starting it again in 0\.5 s on {re.escape(address)}",
                60,
                f"{name}'s exit reported",
            )
            back = up.wait_line(
                rf"{name} SERVING again on {re.escape(address)} \(pid (\d+), restart 1,", 300, f"{name} serving again"
            )
            assert int(back[1]) != old_pid
            # restarted with SIGINT and SIGTERM unblocked (the supervisor blocks them around the fork): it stops when
            # asked to
            status = Path(f"/proc/{back[1]}/status").read_text()
            blocked = int(re.search(r"^SigBlk:\s*([0-9a-f]+)$", status, re.M)[1], 16)
            assert not blocked & (1 << (signal.SIGINT - 1) | 1 << (signal.SIGTERM - 1)), status
            assert check(address, timeout=5) == "SERVING", name
        # the restarted request manager serves
        after = prompts[:2]
        check_streams(run_streams(other, after, f"after-{tmp_path.name}", 16), after, greedy, 16)
    finally:
        code = up.stop()
    assert code == 0, up.output
    assert re.search(r"^restarts: llm-verifier-1 1, request-manager-1 1$", up.output, re.M), up.output
    assert processes_naming(str(tmp_path)) == [], "processes left after specinfer up stopped"


def test_up_stops_when_a_process_fails_at_start_up_again_and_again(model_pair, tmp_path):
    """A verifier whose LLM folder has a config but no weights exits at every start (``up`` checks the folders
    before it starts anything, but not the weights): after 3 starts the stack stops with exit code 1 and the
    verifier's last log lines, and nothing is left running."""
    empty = tmp_path / "no-weights"
    empty.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(model_pair.llm / name, empty / name)
    up = SpecinferUp(up_args(empty, model_pair.ssm, tmp_path), up_env())
    try:
        code = up.popen.wait(300)
    finally:
        up.stop()
    up.reader.join(10)
    out = up.output
    assert code == 1, out
    assert (
        out.count("llm-verifier exited with") == 2
        and "starting it again in 0.5 s" in out
        and "starting it again in 1.0 s" in out
    ), out
    assert "stopping: llm-verifier exited before it served, 3 times in a row; the last lines of its log" in out, out
    tail = out.split("the last lines of its log", 1)[1]
    assert str(empty / "model.safetensors") in tail, f"the verifier's error is not among the lines shown:\n{out}"
    assert "ssm-worker" not in out  # nothing after the verifier was started
    assert processes_naming(str(tmp_path)) == [], "processes left after specinfer up stopped"


def test_a_killed_launcher_leaves_no_process_behind(model_pair, tmp_path):
    """kill -9 of ``specinfer up`` itself: nothing stops its processes, so each one notices that its launcher is
    gone (``--parent-pid``) and stops gracefully, the embedded Redis too (it dies with its parent)."""
    up = SpecinferUp(up_args(model_pair.llm, model_pair.ssm, tmp_path, "--workers", "1"), up_env())
    try:
        up.wait_serving()
        members = up.members()
        assert len(members) >= 3 and processes_naming(str(tmp_path)), up.output
        up.popen.kill()
        up.popen.wait(30)
        wait_until(lambda: processes_naming(str(tmp_path)) == [], 60, "every process of the killed stack to stop")
    finally:
        up.stop()
        for pid in (pid for _, pid in up.members().values()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    for name in members:
        log = (tmp_path / "state").rglob(f"{name}.log")
        text = "".join(p.read_text(errors="replace") for p in log)
        assert "the launcher that started us is gone; stopping" in text and '"msg": "stopped"' in text, name
