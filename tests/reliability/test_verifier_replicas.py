"""Two LLM verifier replicas behind one request manager (issue 17): requests are placed on both,
every output equals transformers' greedy one, and kill -9 of one replica mid-stream moves its
requests to the other, which rebuilds their caches from the committed tokens: nothing lost or
repeated."""

from __future__ import annotations

import pytest
from services.harness import wait_until  # tests/services/harness.py

from specinfer.core.drafts import PAPER_EXPANSION
from specinfer.launcher import Stack, StackConfig

from .conftest import check_streams, run_streams, verified_by_replica

pytestmark = pytest.mark.reliability

NEW_TOKENS = 48


@pytest.fixture(scope="module")
def stack(model_pair, tmp_path_factory):
    cfg = StackConfig(
        llm=model_pair.llm,
        ssms=(model_pair.ssm,),
        workers=2,
        verifiers=2,
        port=0,
        state_dir=tmp_path_factory.mktemp("state"),
        expansion=PAPER_EXPANSION,
        threads=1,
        rm_args=("--max-batch", "16", "--rpc-timeout-seconds", "30"),
    )
    s = Stack(cfg).start()
    try:
        yield s
    finally:
        s.stop()  # a process killed on purpose exits with -9: no clean-shutdown check here


def by_replica(stack: Stack) -> dict[str, float]:
    return verified_by_replica([stack.process("request-manager").metrics_address])


def test_sixteen_streams_spread_over_both_replicas_equal_transformers(stack, model_pair, greedy):
    prompts = model_pair.prompts[:16]
    check_streams(run_streams(stack.address, prompts, "spread", NEW_TOKENS), prompts, greedy, NEW_TOKENS)
    verified = by_replica(stack)
    replicas = {stack.process(n).address for n in ("llm-verifier", "llm-verifier-1")}
    assert set(verified) == replicas, verified
    total = sum(verified.values())
    # placement by free KV blocks: each replica verified a fair share of the request steps
    assert all(v >= 0.25 * total for v in verified.values()), verified


def test_one_replica_killed_its_requests_finish_on_the_other(stack, model_pair, greedy):
    prompts = model_pair.prompts[16:24]
    killed = stack.process("llm-verifier-1")
    before = by_replica(stack)

    def kill(client):
        killed.popen.kill()
        killed.popen.wait()

    check_streams(run_streams(stack.address, prompts, "replica-kill", NEW_TOKENS, kill), prompts, greedy, NEW_TOKENS)
    log = (stack.workdir / "request-manager.log").read_text(errors="replace")
    assert "LLM verifier taken out" in log
    after = by_replica(stack)
    survivor = stack.process("llm-verifier").address
    assert after[survivor] > before.get(survivor, 0)
    # back on the same port, it is health-probed and placed on again
    stack.respawn("llm-verifier-1")
    wait_until(
        lambda: "LLM verifier back in service" in (stack.workdir / "request-manager.log").read_text(errors="replace"),
        60,
        "the replica back",
    )
    check_streams(
        run_streams(stack.address, model_pair.prompts[24:32], "replica-back", NEW_TOKENS),
        model_pair.prompts[24:32],
        greedy,
        NEW_TOKENS,
    )
    assert by_replica(stack)[killed.address] > after.get(killed.address, 0)
