"""End to end with a draft that has another tokenizer: the SSM worker drafts through the token-level
intersection (it is given the LLM's folder, as `specinfer up` does), the request manager reports the
method, and greedy output over gRPC equals transformers' greedy decoding of the LLM alone."""

from __future__ import annotations

import concurrent.futures

import pytest
from cross_vocab_pair import relabelled_ssm  # tests/cross_vocab_pair.py
from oracles import hf_greedy, serving  # tests/oracles.py

from specinfer.client import Client
from specinfer.launcher import StackConfig

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def cross_stack(model_pair, tmp_path_factory):
    ssm = relabelled_ssm(model_pair.llm, model_pair.ssm, tmp_path_factory.mktemp("cross") / "draft")
    cfg = StackConfig(
        llm=model_pair.llm,
        ssms=(ssm,),
        workers=1,
        port=0,
        state_dir=tmp_path_factory.mktemp("state"),
        expansion="auto",
        threads=1,
    )
    with serving(cfg) as s:
        yield s


def test_greedy_streams_with_a_cross_tokenizer_draft_equal_transformers(cross_stack, model_pair):
    prompts = model_pair.prompts[:8]
    expected = hf_greedy(model_pair.llm, prompts, NEW_TOKENS)
    requests = [
        Client.request(ids, NEW_TOKENS, **({"expansion": (1, 1, 3, 1, 1)} if i % 2 else {}))
        for i, ids in enumerate(prompts)
    ]  # auto, static
    with Client(cross_stack.address, timeout=300) as client, concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(client.generate, requests))
        info = client.model_info()
    assert dict(info.draft_vocabulary) == {info.ssms[0]: "token-intersection"}
    assert [r.token_ids for r in results] == expected
    static = [r.finished.usage for i, r in enumerate(results) if i % 2]
    assert sum(u.mean_accepted_tokens for u in static) > 0


def test_sampling_with_a_cross_tokenizer_draft_completes(cross_stack, model_pair):
    with Client(cross_stack.address, timeout=300) as client:
        done = client.generate(
            Client.request(
                model_pair.prompts[0], 24, temperature=0.8, top_p=0.95, seed=3, expansion=(2, 2, 1), ignore_eos=True
            )
        )
    assert len(done.token_ids) == 24 and done.finished.usage.mean_tree_size > 1
