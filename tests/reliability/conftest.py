"""Shared pieces of the fault, load and security tests: transformers' greedy outputs and stream helpers."""

from __future__ import annotations

import concurrent.futures
import urllib.request

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from services.harness import wait_until  # tests/services/harness.py
from transformers import AutoModelForCausalLM

from specinfer.client import Client
from specinfer.v1 import api_pb2


@pytest.fixture(scope="session")
def greedy(model_pair):
    """``greedy(prompt, n)``: transformers' greedy continuation of ``n`` tokens, EOS ignored (as
    the requests of these tests ask: their length then does not depend on the model)."""
    hf = AutoModelForCausalLM.from_pretrained(str(model_pair.llm), dtype=torch.float32)
    cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def run(prompt, n: int) -> list[int]:
        key = (tuple(prompt), n)
        if key not in cache:
            with torch.inference_mode():
                out = hf.generate(
                    torch.tensor([list(prompt)]),
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=0,
                )
            cache[key] = out[0, len(prompt) :].tolist()
        return cache[key]

    return run


def tokens_of(messages: list[api_pb2.GenerateResponse]) -> list[int]:
    """The stream's tokens, checking that offsets leave no gap and repeat nothing."""
    out: list[int] = []
    for m in messages:
        assert m.offset == len(out), f"offset {m.offset} after {len(out)} tokens"
        out.extend(m.token_ids)
    return out


def progress(client: Client, request_id: str) -> int:
    """Committed output tokens of a request (0 while unknown)."""
    try:
        return len(client.get_request(request_id).output_token_ids)
    except grpc.RpcError:
        return 0


def verified_by_replica(metrics_addresses: list[str]) -> dict[str, float]:
    """``specinfer_verifier_requests_total`` by verifier replica address, summed over the request
    managers whose metrics endpoints are ``metrics_addresses``."""
    out: dict[str, float] = {}
    for address in metrics_addresses:
        text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "specinfer_verifier_requests_total":
                    out[sample.labels["replica"]] = out.get(sample.labels["replica"], 0.0) + sample.value
    return out


def run_streams(
    address: str, prompts, prefix: str, new_tokens: int, fault=None
) -> list[list[api_pb2.GenerateResponse]]:
    """One stream of ``new_tokens`` (EOS ignored) per prompt through ``address``, all at once; with
    ``fault``, ``fault(client)`` runs once every stream has committed tokens and none has finished.
    Returns each stream's messages."""
    ids = [f"{prefix}-{i}" for i in range(len(prompts))]
    with Client(address, timeout=600) as client, concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [
            pool.submit(
                lambda p, r: list(client.stream(Client.request(p, new_tokens, request_id=r, ignore_eos=True))), p, r
            )
            for p, r in zip(prompts, ids, strict=True)
        ]
        if fault is not None:
            wait_until(lambda: all(progress(client, r) > 0 for r in ids), 120, "every stream committing")
            assert all(progress(client, r) < new_tokens for r in ids), (
                "a stream finished before the fault: ask for more tokens"
            )
            fault(client)
        return [f.result(timeout=600) for f in futures]


def check_streams(results, prompts, greedy, new_tokens: int) -> None:
    """Every stream finished by length with exactly transformers' greedy continuation (no gap, no repeat)."""
    for i, (messages, prompt) in enumerate(zip(results, prompts, strict=True)):
        assert messages[-1].finished.reason == api_pb2.FINISH_REASON_LENGTH, f"stream {i}: {messages[-1].finished}"
        assert tokens_of(messages) == greedy(prompt, new_tokens), f"stream {i} differs from transformers"
