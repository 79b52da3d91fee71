"""End to end: the request manager admits and preempts by the KV blocks the verifier and the SSM
worker report. Both run paged KV pools of about 1.5 requests at their longest, so 8 concurrent
requests must take turns (preemption), and still every output is transformers' greedy output.
Prefix caching is on (the default): requests sharing a prompt prefix take its cached KV blocks,
report them in ``finished.usage``, and their output does not change either."""

from __future__ import annotations

import concurrent.futures
import json

import grpc
import pytest
from oracles import hf_greedy, serving  # tests/oracles.py
from services.harness import wait_until  # tests/services/harness.py
from test_stack import scrape, total  # tests/e2e/test_stack.py (pytest puts tests/e2e on the path)

from specinfer.client import Client
from specinfer.launcher import StackConfig
from specinfer.v1 import api_pb2, internal_pb2, internal_pb2_grpc

BLOCK = 4
MAX_SEQ_LEN = 160
TREE_ROWS = 256  # the native pool's rows per request beyond its positions (NativeOptions.max_tree_nodes)
NEW_TOKENS = 60


def kv_cache_bytes(llm_dir) -> int:
    """About 1.5 requests at their longest (positions and tree rows) of the LLM's KV, in fp32."""
    cfg = json.loads((llm_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head_dim * 4
    return int((MAX_SEQ_LEN + TREE_ROWS) * per_token * 1.5)


@pytest.fixture(scope="module")
def prompts(model_pair):
    """8 prompts of 30 to 50 tokens."""
    chosen = [ids[:50] for ids in model_pair.prompts if len(ids) >= 30][:8]
    assert len(chosen) == 8
    return chosen


@pytest.fixture(scope="module")
def stack(model_pair, tmp_path_factory):
    model = (
        "--kv-block-size",
        str(BLOCK),
        "--max-seq-len",
        str(MAX_SEQ_LEN),
        "--kv-cache-bytes",
        str(kv_cache_bytes(model_pair.llm)),
    )
    cfg = StackConfig(
        llm=model_pair.llm,
        ssms=(model_pair.ssm,),
        port=0,
        state_dir=tmp_path_factory.mktemp("state"),
        expansion="auto",
        threads=1,
        model_args=model,
        rm_args=("--max-batch", "8", "--max-new-tokens", "256"),
    )
    with serving(cfg) as s:
        yield s


@pytest.fixture(scope="module")
def expected(model_pair, prompts):
    """transformers' greedy continuation of each prompt."""
    return hf_greedy(model_pair.llm, prompts, NEW_TOKENS)


def test_services_report_their_kv_budgets(stack):
    with grpc.insecure_channel(stack.process("llm-verifier").address) as channel:
        info = internal_pb2_grpc.LlmVerifierStub(channel).GetInfo(internal_pb2.LlmInfoRequest(), timeout=30)
    assert (info.kv_block_size, info.max_positions) == (BLOCK, MAX_SEQ_LEN)
    request_blocks = (MAX_SEQ_LEN + TREE_ROWS) // BLOCK
    assert request_blocks <= info.kv_blocks < 2 * request_blocks and info.max_requests == 1
    assert 0 < info.kv_blocks_free <= info.kv_blocks
    worker = next(p for p in stack.processes if p.name.startswith("ssm-worker"))
    with grpc.insecure_channel(worker.address) as channel:
        models = internal_pb2_grpc.SsmWorkerStub(channel).ListModels(internal_pb2.ListModelsRequest(), timeout=30)
    (profile,) = models.profiles
    assert (
        profile.kv_block_size == BLOCK and profile.kv_blocks >= request_blocks
    )  # the SSM has fewer layers: more blocks in the same bytes


def test_concurrent_requests_preempt_and_match_transformers(stack, prompts, expected):
    rm = stack.process("request-manager").metrics_address
    before = scrape(rm)
    # odd requests adaptive, even ones a static tree
    requests = [
        Client.request(ids, NEW_TOKENS, adaptive=bool(i % 2), expansion=() if i % 2 else (1, 1, 3))
        for i, ids in enumerate(prompts)
    ]
    with Client(stack.address, timeout=600) as client, concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        streams = list(pool.map(lambda r: list(client.stream(r)), requests))
    for i, messages in enumerate(streams):
        tokens = [t for m in messages for t in m.token_ids]
        assert messages[-1].HasField("finished"), f"request {i} did not finish"
        assert messages[-1].finished.reason in (api_pb2.FINISH_REASON_LENGTH, api_pb2.FINISH_REASON_EOS)
        assert tokens == expected[i], f"request {i} differs from transformers"
    after = scrape(rm)
    assert total(after, "specinfer_preemptions_total") - total(before, "specinfer_preemptions_total") > 0
    verifier = scrape(stack.process("llm-verifier").metrics_address)
    assert total(verifier, "specinfer_kv_blocks", role="llm") > 0
    assert total(verifier, "specinfer_kv_blocks_free", role="llm") == total(
        verifier, "specinfer_kv_blocks", role="llm"
    )  # all released


@pytest.fixture(scope="module")
def shared_prompts(model_pair, prompts):
    """8 prompts of 60 tokens: a 48-token prefix in common, then 12 of their own."""
    prefix = list(prompts[0][:48])
    return [prefix + list(ids[:12]) for ids in prompts]


def test_shared_prefixes_are_cached_and_output_matches_transformers(stack, model_pair, shared_prompts):
    expected = hf_greedy(model_pair.llm, shared_prompts, NEW_TOKENS)
    verifier_address, rm = (
        stack.process("llm-verifier").metrics_address,
        stack.process("request-manager").metrics_address,
    )
    before, preemptions = scrape(verifier_address), total(scrape(rm), "specinfer_preemptions_total")
    requests = [
        Client.request(ids, NEW_TOKENS, adaptive=bool(i % 2), expansion=() if i % 2 else (1, 1, 3))
        for i, ids in enumerate(shared_prompts)
    ]
    with Client(stack.address, timeout=600) as client:
        first = list(client.stream(requests[0]))  # alone: its blocks are cached once it ran
        with concurrent.futures.ThreadPoolExecutor(len(requests) - 1) as pool:
            streams = [first, *pool.map(lambda r: list(client.stream(r)), requests[1:])]
    for i, messages in enumerate(streams):
        assert messages[-1].HasField("finished"), f"request {i} did not finish"
        assert [t for m in messages for t in m.token_ids] == expected[i], f"request {i} differs from transformers"
    cached = [messages[-1].finished.usage.cached_prompt_tokens for messages in streams]
    assert all(
        c % BLOCK == 0 and c < len(shared_prompts[0]) for c in cached
    )  # whole blocks; the root is always computed
    assert all(c >= 48 for c in cached[1:]), f"later requests should reuse the 48-token prefix: {cached}"
    assert total(scrape(rm), "specinfer_preemptions_total") > preemptions, (
        "the pools were meant to be too small for the batch"
    )
    after = scrape(verifier_address)
    hits = total(after, "specinfer_prefix_cache_hits_total", role="llm") - total(
        before, "specinfer_prefix_cache_hits_total", role="llm"
    )
    queries = total(after, "specinfer_prefix_cache_queries_total", role="llm") - total(
        before, "specinfer_prefix_cache_queries_total", role="llm"
    )
    assert sum(cached) <= hits <= queries  # resumed requests may hit more than their prompts
    assert total(after, "specinfer_kv_blocks_free", role="llm") == total(
        after, "specinfer_kv_blocks", role="llm"
    )  # idle cached blocks count as free


def test_two_request_managers_share_the_verifiers_kv_blocks(stack, model_pair, prompts, expected):
    """A second request manager (its own Redis) on the same verifier and worker: each sees the blocks
    the other's requests hold (``VerifyResponse.kv_blocks_free``) and admits into what is left, so
    8 requests split over both still all finish, exactly, and every block is released afterwards."""
    second = stack.spawn_request_manager("request-manager-b", ["--max-batch", "8", "--max-new-tokens", "256"])
    requests = [
        (stack.address if i % 2 else second.address, Client.request(ids, NEW_TOKENS)) for i, ids in enumerate(prompts)
    ]

    def run(address, request):
        with Client(address, timeout=600) as client:
            return list(client.stream(request))

    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        streams = list(pool.map(lambda ar: run(*ar), requests))
    for i, messages in enumerate(streams):
        assert messages[-1].HasField("finished"), f"request {i} did not finish"
        assert [t for m in messages for t in m.token_ids] == expected[i], f"request {i} differs from transformers"

    def all_free() -> bool:  # releases follow the last step
        verifier = scrape(stack.process("llm-verifier").metrics_address)
        return total(verifier, "specinfer_kv_blocks_free", role="llm") == total(
            verifier, "specinfer_kv_blocks", role="llm"
        )

    wait_until(all_free, 30, "every KV block released")
