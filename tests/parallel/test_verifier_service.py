"""The LLM verifier with ``--tensor-parallel 2`` as real processes: greedy generation through the
whole stack equals transformers', a killed rank ends the service (NOT_SERVING, non-zero exit,
bounded time) and settings the model cannot be split by exit 2 naming the setting."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from oracles import hf_greedy, hf_seeded_sampling, serving  # tests/oracles.py
from services.conftest import llm_verifier_command
from services.harness import start_service
from transformers import AutoModelForCausalLM

from specinfer import wire, wire_jobs
from specinfer.client import Client
from specinfer.core import DraftTree, SamplingParams, TokenTree
from specinfer.launcher import Stack, StackConfig
from specinfer.llm_verifier.__main__ import main as llm_verifier_main
from specinfer.v1 import internal_pb2, internal_pb2_grpc

TP2 = ("--tensor-parallel", "2")
NEW_TOKENS = 24
FAIL_WITHIN_SECONDS = 30.0  # the bound on noticing a dead rank and exiting


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    """Process IDs whose parent is ``pid``."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
def test_greedy_and_seeded_generation_through_the_stack_with_tp2(model_pair, tmp_path):
    prompts = model_pair.prompts[:4]
    expected = hf_greedy(model_pair.llm, prompts, NEW_TOKENS)
    config = StackConfig(
        llm=model_pair.llm,
        ssms=(model_pair.ssm,),
        port=0,
        state_dir=tmp_path / "state",
        expansion="2,2,1",
        threads=1,
        model_args=("--kv-cache-bytes", str(64 << 20)),
        verifier_args=TP2,
        rm_args=("--max-new-tokens", "256"),
    )
    with serving(config) as stack:
        greedy_streams(stack, prompts, expected)
        # seeded sampling through the parallel verifier: plain decoding's draw (coupled verification)
        params = SamplingParams(temperature=1.0, top_p=0.95)
        drawn = hf_seeded_sampling(model_pair.llm, prompts[:2], [71, 72], params, NEW_TOKENS)
        with Client(stack.address, timeout=120) as client:
            got = [
                client.generate(Client.request(ids, NEW_TOKENS, temperature=1.0, top_p=0.95, seed=s)).token_ids
                for ids, s in zip(prompts[:2], (71, 72), strict=True)
            ]
        assert got == drawn
    verifier_log = (stack.workdir / "llm-verifier.log").read_text()
    assert '"tensor_parallel": 2' in verifier_log and '"rank stopped"' in verifier_log  # rank 1 stopped cleanly too


def greedy_streams(stack: Stack, prompts: list[list[int]], expected: list[list[int]]) -> None:
    with Client(stack.address, timeout=120) as client:
        verifier = stack.process("llm-verifier").popen.pid
        assert len([p for p in children(verifier) if alive(p)]) == 1, "rank 0 runs one other rank"
        # all at once, so the verifier batches several requests' trees into one parallel step
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            streams = list(pool.map(lambda ids: list(client.stream(Client.request(ids, NEW_TOKENS))), prompts))
        for i, (messages, want) in enumerate(zip(streams, expected, strict=True)):
            assert messages[-1].HasField("finished")
            assert [t for m in messages for t in m.token_ids] == want, f"prompt {i} differs from transformers"
            assert (
                messages[-1].finished.usage.mean_tree_size > 1
            )  # speculation really ran through the parallel verifier


def _verify_forever(address: str, context: list[int], outcome: list[grpc.StatusCode]) -> None:
    """Verify calls of the root alone, each a new request, until one fails; its status goes to ``outcome``."""
    with grpc.insecure_channel(address) as channel:
        stub = internal_pb2_grpc.LlmVerifierStub(channel)
        for n in range(10_000):
            rid = f"hammer-{n}"
            item = internal_pb2.VerifyItem(
                context=wire_jobs.context_to_proto(rid, context[:-1], 0),
                tree=wire.draft_to_proto(DraftTree(TokenTree.root_only(context[-1]))),
                sampling=wire.sampling_to_proto(SamplingParams()),
            )
            try:
                stub.Verify(internal_pb2.VerifyRequest(items=[item]), timeout=FAIL_WITHIN_SECONDS)
                stub.Release(internal_pb2.ReleaseRequest(request_ids=[rid]), timeout=FAIL_WITHIN_SECONDS)
            except grpc.RpcError as exc:
                outcome.append(exc.code())
                return


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["rank1", "rank0"])
def test_killed_rank_ends_the_service(model_pair, tmp_path, victim):
    """SIGKILL a rank while calls are running. Rank 1: rank 0 turns NOT_SERVING, fails the calls
    and exits non-zero. Rank 0: the orphaned rank 1 exits. Both within a bounded time."""
    svc = start_service(llm_verifier_command(model_pair, *TP2), workdir=tmp_path)
    try:
        address = svc.wait_ready(120)
        deadline = time.monotonic() + 10
        while not (ranks := [p for p in children(svc.process.pid) if alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.05)
        (rank1,) = ranks
        with grpc.insecure_channel(address) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=60)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            outcome: list[grpc.StatusCode] = []
            hammer = threading.Thread(
                target=_verify_forever, args=(address, model_pair.prompts[0][:100], outcome), daemon=True
            )
            hammer.start()
            time.sleep(1.0)  # calls are running
            assert hammer.is_alive() and not outcome, (
                f"calls failed before any rank was killed: {outcome}\n{svc.log_tail()}"
            )
            killed = time.monotonic()
            if victim == "rank1":
                os.kill(rank1, signal.SIGKILL)
                assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING, svc.log_tail()
                code = svc.process.wait(timeout=FAIL_WITHIN_SECONDS)
                assert code not in (0, None), svc.log_tail()
                hammer.join(FAIL_WITHIN_SECONDS)
                assert outcome and outcome[0] in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), outcome
            else:
                svc.process.kill()
                svc.process.wait(timeout=10)
                while alive(rank1) and time.monotonic() - killed < FAIL_WITHIN_SECONDS:
                    time.sleep(0.1)
                assert not alive(rank1), "rank 1 outlived rank 0"
            assert time.monotonic() - killed < FAIL_WITHIN_SECONDS
        if victim == "rank1":
            assert "failed, not serving any more" in svc.log_tail(20000)
    finally:
        svc.kill()
        for pid in children(svc.process.pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_joined_launch_verifies_and_stops_cleanly(model_pair, tmp_path):
    """A torchrun-style launch (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set for each process):
    rank 0 serves, greedy verification of a tree holding the LLM's own continuation accepts it
    all, and SIGTERM to rank 0 stops both ranks with exit code 0."""
    prompt = model_pair.prompts[1][:40]
    hf = AutoModelForCausalLM.from_pretrained(str(model_pair.llm), dtype=torch.float32).eval()
    seq = list(prompt)
    with torch.inference_mode():
        for _ in range(4):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    greedy = seq[len(prompt) :]
    command = llm_verifier_command(model_pair, *TP2)
    rendezvous = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    log = open(tmp_path / "rank1.log", "wb")  # noqa: SIM115 (closed below)
    rank1 = subprocess.Popen(
        command, env={**os.environ, **rendezvous, "RANK": "1"}, stdout=log, stderr=subprocess.STDOUT
    )
    svc = start_service(command, env={**os.environ, **rendezvous, "RANK": "0"}, workdir=tmp_path)
    try:
        address = svc.wait_ready(120)
        assert children(svc.process.pid) == [], "a joined rank 0 starts no ranks itself"
        with grpc.insecure_channel(address) as channel:
            stub = internal_pb2_grpc.LlmVerifierStub(channel)
            # step 1: the root alone -> the bonus token is the LLM's next token
            first = internal_pb2.VerifyItem(
                context=wire_jobs.context_to_proto("joined", prompt[:-1], 0),
                tree=wire.draft_to_proto(DraftTree(TokenTree.root_only(prompt[-1]))),
                sampling=wire.sampling_to_proto(SamplingParams()),
            )
            (result,) = stub.Verify(internal_pb2.VerifyRequest(items=[first]), timeout=30).results
            assert result.bonus_token == greedy[0] and not result.accepted_tokens
            # step 2: a chain of the true continuation (cache hit: only the new root is sent) -> all accepted
            tree = TokenTree((greedy[0], greedy[1], greedy[2]), (-1, 0, 1))
            second = internal_pb2.VerifyItem(
                context=wire_jobs.context_to_proto("joined", prompt, len(prompt) - 1),
                tree=wire.draft_to_proto(DraftTree(tree)),
                sampling=wire.sampling_to_proto(SamplingParams()),
            )
            (result,) = stub.Verify(internal_pb2.VerifyRequest(items=[second]), timeout=30).results
            assert not result.cache_miss
            assert [*result.accepted_tokens, result.bonus_token] == greedy[1:4]
        assert svc.stop(30) == 0, svc.log_tail()
        assert rank1.wait(30) == 0
    finally:
        svc.kill()
        if rank1.poll() is None:
            rank1.kill()
        rank1.wait()
        log.close()


def _llm_with(tmp_path: Path, model_pair, **changes) -> Path:
    """The test LLM's config with ``changes`` (no weights are read: settings fail first)."""
    cfg = json.loads((model_pair.llm / "config.json").read_text())
    cfg.update(changes)
    folder = tmp_path / "llm"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize(
    ("argv", "changes", "message"),
    [
        (
            ["--tensor-parallel", "3"],
            {"num_attention_heads": 4, "num_key_value_heads": 2},
            "tensor-parallel: 3 does not divide the model's 4 attention heads",
        ),
        (
            ["--tensor-parallel", "4"],
            {"num_attention_heads": 4, "num_key_value_heads": 2},
            "tensor-parallel: 4 does not divide the model's 2 key/value heads",
        ),
        (
            ["--pipeline-parallel", "7"],
            {"num_hidden_layers": 6},
            "pipeline-parallel: 7 stages but the model has only 6 layers",
        ),
        (["--pipeline-parallel", "0"], {}, "pipeline-parallel: must be >= 1"),
        (
            ["--tensor-parallel", "2", "--backend", "reference"],
            {},
            "backend: tensor and pipeline parallelism need the native backend",
        ),
    ],
)
def test_bad_parallel_settings_exit_2(
    argv, changes, message, model_pair, tmp_path, capsys, restore_logging, monkeypatch
):
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    port_file = tmp_path / "port"
    llm = _llm_with(tmp_path, model_pair, **changes)
    assert llm_verifier_main(["--llm", str(llm), *argv, "--port-file", str(port_file)]) == 2
    assert message in capsys.readouterr().err
    assert not port_file.exists()


def test_joined_launch_checks_world_size(model_pair, tmp_path, capsys, restore_logging, monkeypatch):
    """Under torchrun, WORLD_SIZE must be tensor x pipeline ranks."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert (
        llm_verifier_main(
            ["--llm", str(model_pair.llm), "--tensor-parallel", "2", "--port-file", str(tmp_path / "port")]
        )
        == 2
    )
    assert "WORLD_SIZE is 3, but --tensor-parallel 2 x --pipeline-parallel 1 = 2" in capsys.readouterr().err
