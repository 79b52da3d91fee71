"""A request whose verification fails on its own ends with that error; the others in its batch go on. A request
whose drafting fails on its own verifies without that SSM's tree; the others' trees come.

The model services run as separate processes (the ``services`` fixture); the request manager's parts are the real
ones (its gRPC clients of the verifiers and the SSM workers, its scheduler over a real Redis). The faulty request
carries a context token outside the vocabulary: the verifier refuses the whole call that holds it (INVALID_ARGUMENT,
naming the item), as it would any job that fails there, a bug its inputs meet included (INTERNAL). Before the
request manager asked for such a call's requests one by one, every request of the batch failed the round and retried
it, forever.
"""

from __future__ import annotations

import asyncio
import os

from prometheus_client import CollectorRegistry

from services.test_llm_verifier import GREEDY, greedy_continuation
from specinfer.core import DraftTree, ExpansionConfig, TokenTree
from specinfer.core.iteration import DraftSpec, VerifySpec, draft_stream
from specinfer.core.requests import GenerationRequest
from specinfer.request_manager.cluster.remote import Verifiers
from specinfer.request_manager.cluster.ssm_workers import SsmWorkers
from specinfer.request_manager.scheduling.live import Live
from specinfer.request_manager.scheduling.scheduler import Scheduler, SchedulerConfig
from specinfer.request_manager.state.live_records import live_record
from specinfer.request_manager.state.redis_client import connect
from specinfer.request_manager.state.redis_server import EmbeddedRedis
from specinfer.request_manager.state.store import RequestStore
from specinfer.serving.scheduler_metrics import SchedulerMetrics

OUT_OF_VOCAB = 1 << 20


def root_job(request_id: str, tokens) -> VerifySpec:
    """Verify the root alone (greedy: its verdict is the LLM's next token after ``tokens``)."""
    return VerifySpec(request_id, list(tokens[:-1]), DraftTree(TokenTree.root_only(tokens[-1])), GREEDY, 7, 0)


def test_a_job_that_fails_alone_is_rejected_and_the_others_are_verified(services, model_pair):
    a, b = model_pair.prompts[0], model_pair.prompts[1]
    jobs = [root_job("fault-a", a), root_job("fault-bad", [*b[:-2], OUT_OF_VOCAB, b[-1]]), root_job("fault-b", b)]
    bad = jobs[1]
    twins = [root_job("alone-a", a), root_job("alone-b", b)]

    async def scenario() -> None:
        verifier = Verifiers([services.llm_verifier.address], 60)
        try:
            await verifier.discover()
            await verifier.wait_ready(1.0)
            mixed = await verifier.verify([jobs[0], bad, jobs[2]])
            alone = await verifier.verify(twins)
            assert list(mixed.rejected) == [bad.request_id] and not mixed.failed
            why = mixed.rejected[bad.request_id]
            assert "INVALID_ARGUMENT" in why and "context.tokens" in why and str(OUT_OF_VOCAB) in why
            verdicts = [(v.accepted_tokens, v.bonus_token) for v in mixed.verdicts.values()]
            assert sorted(mixed.verdicts) == ["fault-a", "fault-b"]
            assert verdicts == [(v.accepted_tokens, v.bonus_token) for v in alone.verdicts.values()]
            assert verifier.live_count() == 1  # the replica answered: not taken out
            again = await verifier.verify([jobs[0], jobs[2]])  # the next round is one call again, and answers
            assert sorted(again.verdicts) == sorted(mixed.verdicts) and not again.rejected
        finally:
            await verifier.release([j.request_id for j in (*jobs, *twins)])
            await verifier.close()

    asyncio.run(scenario())


def test_the_scheduler_ends_the_faulty_request_with_its_error_and_finishes_the_others(services, model_pair, tmp_path):
    """A record whose prompt the verifier refuses (as one written by another, older manager could be: adopted
    records are not admitted again) in a batch with a good request: the good one decodes to its end, token-exact,
    the faulty one ends with reason ``error`` and the verifier's message, in memory and in Redis."""
    from transformers import AutoModelForCausalLM

    prompt = tuple(model_pair.prompts[0])
    good = Live(GenerationRequest("good", prompt, 12, GREEDY), seed=1)
    bad = Live(GenerationRequest("bad", (*prompt[:-2], OUT_OF_VOCAB, prompt[-1]), 12, GREEDY), seed=2)

    async def scenario() -> None:
        with EmbeddedRedis(tmp_path / "redis") as redis_server:
            client = connect(redis_server.url, redis_server.password)
            verifier = Verifiers([services.llm_verifier.address], 60)
            try:
                store = RequestStore(client, prefix=f"faults-{os.getpid()}")
                await verifier.discover()
                await verifier.wait_ready(1.0)
                config = SchedulerConfig(4, 8, (), None, "rm-faults")
                scheduler = Scheduler(config, store, None, verifier, SchedulerMetrics(CollectorRegistry()))
                for live in (good, bad):
                    await store.create(live_record(live, (), "rm-faults"))
                    await scheduler.submit(live)
                for _ in range(40):
                    if good.final is not None and bad.final is not None:
                        break
                    await scheduler.iteration()
                await scheduler.appends.drain()
                assert bad.final is not None and bad.final.finished.reason == "error"
                assert "INVALID_ARGUMENT" in bad.final.finished.error and str(OUT_OF_VOCAB) in bad.final.finished.error
                assert good.final is not None and good.final.finished.reason == "length"
                stored_bad, stored_good = await store.get("bad"), await store.get("good")
                assert stored_bad.is_finished and "INVALID_ARGUMENT" in (stored_bad.error or "")
                assert stored_good.is_finished and len(stored_good.output_tokens) == 12
                assert scheduler.load == (0, 0)
            finally:
                await verifier.close()
                await client.aclose()

    asyncio.run(scenario())
    llm = AutoModelForCausalLM.from_pretrained(str(model_pair.llm), dtype="float32").eval()
    assert good.output == greedy_continuation(llm, list(prompt), 12)


def test_a_draft_job_that_fails_alone_is_left_out_and_the_others_are_drafted(services, model_pair):
    """An SSM worker that refuses a Speculate call for one of its jobs: before, the whole call failed (every request
    of the batch lost its tree) and an INTERNAL one took the worker out, for everyone, step after step."""
    a, b = model_pair.prompts[0], model_pair.prompts[1]

    def job(rid: str, tokens) -> DraftSpec:
        return DraftSpec(rid, list(tokens[:-1]), tokens[-1], ExpansionConfig((2, 1)), GREEDY, 32, 7, 0, draft_stream(0))

    jobs = [job("draft-a", a), job("draft-bad", [*b[:-2], OUT_OF_VOCAB, b[-1]]), job("draft-b", b)]

    async def scenario() -> None:
        workers = SsmWorkers([services.ssm_worker.address], 60)
        try:
            await workers.discover()
            drafted = await workers.speculate("ssm", jobs)
            alone = await workers.speculate("ssm", [job("alone-a", a), job("alone-b", b)])
            assert sorted(drafted.trees) == ["draft-a", "draft-b"]
            assert drafted.trees["draft-a"].tree == alone.trees["alone-a"].tree
            assert drafted.trees["draft-b"].tree == alone.trees["alone-b"].tree
            assert workers.live_count() == 1  # the worker answered: not taken out
        finally:
            await workers.close()

    asyncio.run(scenario())
