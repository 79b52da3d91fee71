"""The whole stack with the LLM verifier on a GPU and the SSM worker and request manager on the CPU, called
through the public API like any client: greedy output equals transformers' (fp32), static and adaptive trees
side by side, and a sampled stream finishes. Skipped without CUDA (scripts/gpu_check.sh runs it)."""

from __future__ import annotations

import concurrent.futures

import pytest
from oracles import hf_greedy, serving  # tests/oracles.py

from specinfer.client import Client
from specinfer.core.drafts import PAPER_EXPANSION
from specinfer.launcher import StackConfig

NEW_TOKENS = 24


@pytest.mark.gpu
def test_stack_with_the_verifier_on_cuda_equals_transformers(model_pair, tmp_path):
    prompts = model_pair.prompts[:6]
    expected = hf_greedy(model_pair.llm, prompts, NEW_TOKENS)
    cfg = StackConfig(
        llm=model_pair.llm,
        ssms=(model_pair.ssm,),
        port=0,
        state_dir=tmp_path / "state",
        expansion=PAPER_EXPANSION,
        verifier_args=("--device", "cuda:0"),
        rm_args=("--max-batch", "8", "--max-new-tokens", "64"),
    )
    requests = [Client.request(ids, NEW_TOKENS, adaptive=i % 2 == 1) for i, ids in enumerate(prompts)]
    requests.append(Client.request(prompts[0], NEW_TOKENS, temperature=1.0, top_p=0.9, seed=3))
    with (
        serving(cfg) as stack,
        Client(stack.address, timeout=120) as client,
        concurrent.futures.ThreadPoolExecutor(len(requests)) as pool,
    ):
        results = list(pool.map(lambda r: list(client.stream(r)), requests))
    for i, msgs in enumerate(results[: len(prompts)]):
        assert [t for m in msgs for t in m.token_ids] == expected[i], f"stream {i} differs from transformers"
    assert results[-1][-1].HasField("finished") and 1 <= sum(len(m.token_ids) for m in results[-1]) <= NEW_TOKENS
