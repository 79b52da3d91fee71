"""End to end: Redis, the request manager, 2 SSM workers and the LLM verifier as separate
processes on 127.0.0.1, called over gRPC like any client would."""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from oracles import hf_greedy, hf_logprobs, hf_seeded_sampling, serving  # tests/oracles.py
from prometheus_client.parser import text_string_to_metric_families
from services.harness import wait_until  # tests/services/harness.py
from transformers import AutoModelForCausalLM

from specinfer.client import Client
from specinfer.core import SamplingParams
from specinfer.core.adaptive import KEPT_SHARE_FLOOR
from specinfer.core.drafts import PAPER_EXPANSION
from specinfer.launcher import StackConfig
from specinfer.v1 import api_pb2

REPO = Path(__file__).resolve().parents[2]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def stack(model_pair, tmp_path_factory):
    cfg = StackConfig(
        llm=model_pair.llm,
        ssms=(model_pair.ssm, model_pair.ssm2),  # served as "ssm" and "ssm2": their folders' names
        workers=2,
        port=0,
        state_dir=tmp_path_factory.mktemp("state"),
        expansion=PAPER_EXPANSION,
        threads=1,
        # the drafters' tests below count what their trees accepted: every adaptive step speculates (the gate that
        # may turn speculation off where it measures slower is tested in tests/test_engine_core.py)
        rm_args=("--max-batch", "16", "--max-queue", "32", "--max-new-tokens", "256", "--speculation-gate", "off"),
        head=demo_head(model_pair),  # the verifier drafts with the pair's draft head too
    )
    with serving(cfg) as s:
        yield s


def demo_head(model_pair) -> Path | None:
    """The test pair's draft head (``head/`` beside ``llm/``: the bundled demo pair has one)."""
    head = model_pair.llm.parent / "head"
    return head if (head / "config.json").is_file() else None


@pytest.fixture(scope="module")
def expected(model_pair):
    """transformers' greedy continuation of each prompt."""
    return hf_greedy(model_pair.llm, model_pair.prompts[:16], NEW_TOKENS)


def _run(client: Client, request: api_pb2.GenerateRequest):
    messages = list(client.stream(request))
    return messages


def test_concurrent_streams_mixed_parameters(stack, model_pair, expected):
    prompts = model_pair.prompts[:16]
    requests = []
    for i, ids in enumerate(prompts):
        kind = i % 4
        if kind == 0:
            req = Client.request(ids, NEW_TOKENS)  # server default tree, both SSMs merged
        elif kind == 1:
            req = Client.request(ids, NEW_TOKENS, expansion=(2, 2, 1), ssms=("ssm",))
        elif kind == 2:
            req = Client.request(ids, NEW_TOKENS, speculation=False)
        else:
            req = Client.request(ids, NEW_TOKENS, temperature=1.0, top_p=0.9, seed=i, expansion=(2, 1, 1))
        requests.append(req)
    with Client(stack.address, timeout=300) as client, concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda r: _run(client, r), requests))
    for i, (req, msgs) in enumerate(zip(requests, results, strict=True)):
        final = msgs[-1]
        assert final.HasField("finished"), f"stream {i} did not finish"
        tokens = [t for m in msgs for t in m.token_ids]
        offsets = [m.offset for m in msgs]
        assert offsets == sorted(offsets) and all(
            m.offset == sum(len(x.token_ids) for x in msgs[:k]) for k, m in enumerate(msgs)
        )
        usage = final.finished.usage
        assert usage.completion_tokens == len(tokens)
        assert usage.prompt_tokens == len(prompts[i])
        assert usage.llm_steps >= 1 and abs(usage.tokens_per_step - len(tokens) / usage.llm_steps) < 1e-4
        if req.sampling.temperature == 0:
            assert tokens == expected[i], f"greedy stream {i} differs from transformers"
        else:
            assert 1 <= len(tokens) <= NEW_TOKENS
        if not req.speculation.disabled:
            assert usage.mean_tree_size > 1
        else:
            assert usage.mean_tree_size == 1 and usage.tokens_per_step == 1


def test_seeded_sampling_equals_plain_decoding_whatever_the_speculation(stack, model_pair, expected):
    """A seed fixes the draw (coupled verification): 8 seeded sampled streams, speculating by the
    server's default, adaptively, with a static tree or not at all, concurrently with greedy ones,
    each equal to transformers' plain decoding with its seed by the same Gumbel-max rule."""
    params = SamplingParams(temperature=1.0, top_p=0.95)
    prompts, seeds = model_pair.prompts[:8], [100 + i for i in range(8)]
    oracle = hf_seeded_sampling(model_pair.llm, prompts, seeds, params, NEW_TOKENS)
    kinds = [{}, {"adaptive": True}, {"expansion": (2, 2, 1)}, {"speculation": False}]
    requests = [
        Client.request(ids, NEW_TOKENS, temperature=1.0, top_p=0.95, seed=s, **kinds[i % 4])
        for i, (ids, s) in enumerate(zip(prompts, seeds, strict=True))
    ]
    requests += [Client.request(ids, NEW_TOKENS) for ids in model_pair.prompts[:4]]  # greedy, in the same batches
    with Client(stack.address, timeout=300) as client, concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        results = list(pool.map(client.generate, requests))
    assert [r.token_ids for r in results[:8]] == oracle
    assert [r.token_ids for r in results[8:]] == expected[:4]


def test_logprobs_through_the_services_are_the_llms_own(stack, model_pair, expected):
    """Logprobs asked over gRPC come with every token, streamed, resumed from an offset and read back from
    GetRequest, equal to transformers' log-softmax at each position (fp32), whatever the speculation and sampling;
    a request that asks none gets none, and the outputs stay exact."""
    prompts = model_pair.prompts[:4]
    requests = [
        Client.request(prompts[0], NEW_TOKENS, adaptive=True, logprobs=3, request_id="lp-adaptive"),
        Client.request(prompts[1], NEW_TOKENS, expansion=(2, 2, 1), logprobs=0, request_id="lp-static"),
        Client.request(prompts[2], NEW_TOKENS, temperature=0.9, seed=5, logprobs=2, request_id="lp-seeded"),
        Client.request(prompts[3], NEW_TOKENS, request_id="lp-none"),
    ]
    with Client(stack.address, timeout=300) as client, concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        results = list(pool.map(client.generate, requests))
        resumed = [m for m in client.resume("lp-adaptive", 5)]
        state = client.get_request("lp-seeded")
    assert [r.token_ids for r in (results[0], results[1], results[3])] == [expected[0], expected[1], expected[3]]
    assert results[3].logprobs == []
    for request, result in zip(requests[:3], results[:3], strict=True):
        assert [lp.token_id for lp in result.logprobs] == list(result.token_ids)
        oracle = hf_logprobs(model_pair.llm, request.token_ids.ids, result.token_ids)
        for k, lp in enumerate(result.logprobs):
            assert lp.logprob == pytest.approx(oracle[k, lp.token_id].item(), abs=2e-4)
            assert len(lp.top_token_ids) == len(lp.top_logprobs) == request.logprobs
            assert list(lp.top_logprobs) == pytest.approx(oracle[k].topk(request.logprobs).values.tolist(), abs=2e-4)
    assert [lp for m in resumed for lp in m.logprobs] == list(results[0].logprobs[5:])
    assert list(state.output_logprobs) == list(results[2].logprobs)
    with Client(stack.address, timeout=60) as client, pytest.raises(grpc.RpcError) as err:
        client.generate(Client.request(prompts[0], 4, logprobs=21))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("logprobs")


def test_adaptive_speculation_equals_transformers_greedy(stack, model_pair, expected):
    """Adaptive requests (the planner sizes each step's tree and picks its SSM) stream transformers'
    greedy output token for token, side by side with static ones; the planner's metrics move."""
    rm = stack.process("request-manager").metrics_address
    before = scrape(rm)
    prompts = model_pair.prompts[:8]
    requests = [
        Client.request(ids, NEW_TOKENS, adaptive=True, ssms=("ssm", "ssm2")[: 1 + i % 2])
        for i, ids in enumerate(prompts)
    ]
    requests.append(Client.request(prompts[0], NEW_TOKENS, expansion=(2, 1)))
    requests.append(Client.request(prompts[1], NEW_TOKENS, adaptive=True, temperature=1.0, seed=5))
    with Client(stack.address, timeout=300) as client, concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        info = client.model_info()
        results = list(pool.map(lambda r: _run(client, r), requests))
    assert info.default_speculation == PAPER_EXPANSION and list(info.default_expansion) == [
        int(w) for w in PAPER_EXPANSION.split(",")
    ]
    for i, msgs in enumerate(results[: len(prompts)]):
        assert [t for m in msgs for t in m.token_ids] == expected[i], f"adaptive stream {i} differs from transformers"
    assert [t for m in results[-2] for t in m.token_ids] == expected[0]
    sampled = [t for m in results[-1] for t in m.token_ids]
    assert results[-1][-1].HasField("finished") and 1 <= len(sampled) <= NEW_TOKENS
    after = scrape(rm)
    adaptive_steps = sum(msgs[-1].finished.usage.llm_steps for msgs in (*results[: len(prompts)], results[-1]))
    planned = total(after, "specinfer_planned_tree_nodes_count") - total(before, "specinfer_planned_tree_nodes_count")
    assert planned == adaptive_steps  # one plan per adaptive request and step
    # the cost model's error on the verify calls it predicted (each adaptive step's, prompts' prefills aside)
    errors = total(after, "specinfer_cost_model_verify_error_ratio_count") - total(
        before, "specinfer_cost_model_verify_error_ratio_count"
    )
    assert 0 < errors <= adaptive_steps
    # and on the whole iterations (verify, draft passes, the manager's own work): one per iteration it predicted
    step_errors = total(after, "specinfer_cost_model_step_error_ratio_count") - total(
        before, "specinfer_cost_model_step_error_ratio_count"
    )
    assert 0 < step_errors <= errors
    predicted = total(after, "specinfer_predicted_accepted_tokens_total") - total(
        before, "specinfer_predicted_accepted_tokens_total"
    )
    realised = total(after, "specinfer_realised_accepted_tokens_total") - total(
        before, "specinfer_realised_accepted_tokens_total"
    )
    assert predicted >= 0 and realised >= 0
    assert total(after, "specinfer_cut_draft_nodes_total") >= 0
    assert KEPT_SHARE_FLOOR <= total(after, "specinfer_draft_kept_share", ssm="ssm") <= 1.0
    # the cost model: the verifier's and workers' start-up calibration, refined since
    assert total(after, "specinfer_cost_model_verify_seconds", tokens="1") > 0
    assert total(after, "specinfer_cost_model_draft_seconds", ssm="ssm", tokens="1") > 0


def test_suffix_drafts_through_the_services_equal_transformers_greedy(stack, model_pair):
    """Adaptive requests on text that repeats (each prompt twice over) draft from their own text in the
    request manager (model-free, merged with the SSMs' trees) and stream transformers' greedy output;
    a request may turn it off (``suffix=False``) and is unchanged."""
    prompts = [list(p[:24]) * 2 for p in model_pair.prompts[:3]]
    want = hf_greedy(model_pair.llm, prompts, NEW_TOKENS, ignore_eos=True)
    requests = [Client.request(p, NEW_TOKENS, adaptive=True, ignore_eos=True) for p in prompts]
    requests += [Client.request(p, NEW_TOKENS, adaptive=True, ignore_eos=True, suffix=False) for p in prompts]
    with Client(stack.address, timeout=300) as client, concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        results = list(pool.map(lambda r: _run(client, r), requests))
    for i, msgs in enumerate(results):
        assert [t for m in msgs for t in m.token_ids] == want[i % len(prompts)], f"stream {i} differs from transformers"
    with_suffix = sum(msgs[-1].finished.usage.llm_steps for msgs in results[: len(prompts)])
    assert with_suffix < len(prompts) * NEW_TOKENS * 0.8, (
        f"{with_suffix} steps for {len(prompts) * NEW_TOKENS} tokens: trees accepted too little"
    )
    after = scrape(stack.process("request-manager").metrics_address)
    assert total(after, "specinfer_drafter_accepted_tokens_total", drafter="suffix") > 0
    assert total(after, "specinfer_drafter_steps_total", drafter="suffix") > 0
    proposed = total(after, "specinfer_drafter_proposed_tokens_total", drafter="suffix")
    assert proposed >= total(after, "specinfer_drafter_accepted_tokens_total", drafter="suffix")


def test_head_drafts_through_the_services_equal_transformers_greedy(stack, model_pair):
    """The verifier drafts each adaptive request's next tree with its draft head as it verifies (no SSM pass,
    no extra call); head trees alone, merged with the SSMs', or turned off, the streams are transformers'
    greedy output."""
    if demo_head(model_pair) is None:
        pytest.skip("the test pair has no draft head (head/ beside llm/)")
    prompts = model_pair.prompts[4:7]
    want = hf_greedy(model_pair.llm, prompts, NEW_TOKENS, ignore_eos=True)
    requests = [Client.request(p, NEW_TOKENS, adaptive=True, ignore_eos=True) for p in prompts]
    requests += [Client.request(p, NEW_TOKENS, adaptive=True, ignore_eos=True, head=False) for p in prompts]
    before = scrape(stack.process("request-manager").metrics_address)
    with Client(stack.address, timeout=300) as client, concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        results = list(pool.map(lambda r: _run(client, r), requests))
    for i, msgs in enumerate(results):
        assert [t for m in msgs for t in m.token_ids] == want[i % len(prompts)], f"stream {i} differs from transformers"
    after = scrape(stack.process("request-manager").metrics_address)
    steps = total(after, "specinfer_drafter_steps_total", drafter="head")
    assert steps > total(before, "specinfer_drafter_steps_total", drafter="head"), "head trees were verified"
    proposed = total(after, "specinfer_drafter_proposed_tokens_total", drafter="head")
    assert proposed >= total(after, "specinfer_drafter_accepted_tokens_total", drafter="head") > 0


def test_health_and_reflection(stack):
    for proc in stack.processes:
        with grpc.insecure_channel(proc.address) as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVING, proc.name
            reply = next(
                reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")])
                )
            )
            names = {s.name for s in reply.list_services_response.service}
            assert "grpc.health.v1.Health" in names
            want = {"request-manager": "specinfer.v1.SpecInfer", "llm-verifier": "specinfer.v1.LlmVerifier"}.get(
                proc.name, "specinfer.v1.SsmWorker"
            )
            assert want in names, (proc.name, names)


def scrape(address: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a /metrics page, parsed as Prometheus text: (name, labels) -> value."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        assert reply.headers.get_content_type() == "text/plain"
        text = reply.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(samples: dict, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= set(lab))


def test_metrics_move_as_requests_complete(stack, model_pair):
    rm = stack.process("request-manager").metrics_address
    verifier = stack.process("llm-verifier").metrics_address
    workers = [p.metrics_address for p in stack.processes if p.name.startswith("ssm-worker")]
    before = scrape(rm), scrape(verifier), [scrape(w) for w in workers]
    prompts = model_pair.prompts[:3]
    with Client(stack.address, timeout=300) as client:
        finals = [_run(client, Client.request(ids, 8, ignore_eos=True))[-1] for ids in prompts]
        with pytest.raises(grpc.RpcError):
            _run(client, Client.request([], 8))  # INVALID_ARGUMENT
    # context.abort sends the status before the handler unwinds through the timing interceptor, so
    # the client can see the error a moment before the server counts the call: wait for the count
    invalid = ("specinfer_grpc_server_handling_seconds_count", {"method": "Generate", "code": "INVALID_ARGUMENT"})
    deadline = time.monotonic() + 10
    while (
        total(scrape(rm), invalid[0], **invalid[1]) == total(before[0], invalid[0], **invalid[1])
        and time.monotonic() < deadline
    ):
        time.sleep(0.05)
    after = scrape(rm), scrape(verifier), [scrape(w) for w in workers]

    def delta(i: int, name: str, **labels: str) -> float:
        return total(after[i], name, **labels) - total(before[i], name, **labels)

    steps = sum(f.finished.usage.llm_steps for f in finals)
    assert delta(0, "specinfer_requests_total", outcome="length") == len(prompts)
    assert delta(0, "specinfer_generated_tokens_total") == 8 * len(prompts)
    assert delta(0, "specinfer_llm_steps_total") == steps
    assert delta(0, "specinfer_accepted_tokens_per_step_count") == steps
    assert delta(0, "specinfer_accepted_tokens_per_step_sum") == sum(
        round(f.finished.usage.mean_accepted_tokens * f.finished.usage.llm_steps) for f in finals
    )
    assert (
        delta(0, "specinfer_tree_size_count") == steps and delta(0, "specinfer_tree_size_sum") > steps
    )  # trees beyond the root
    assert delta(0, "specinfer_iterations_total") >= steps / len(prompts)
    assert delta(0, "specinfer_grpc_server_handling_seconds_count", method="Generate", code="OK") == len(prompts)
    assert delta(0, "specinfer_grpc_server_handling_seconds_count", method="Generate", code="INVALID_ARGUMENT") == 1
    assert total(after[0], "specinfer_queue_depth") == 0
    assert (
        total(after[0], "specinfer_ssm_workers_live", ssm="ssm")
        == total(after[0], "specinfer_ssm_workers_live", ssm="ssm2")
        == len(workers)
    )
    assert delta(1, "specinfer_model_calls_total", role="llm") >= steps / len(prompts)
    verify_calls = sum(  # the manager sends its Verify calls over the socket or a stream, each exchange a call
        delta(1, "specinfer_grpc_server_handling_seconds_count", method=m, code="OK")
        for m in ("Verify", "VerifyStream", "VerifySocket")
    )
    assert verify_calls >= steps / len(prompts)
    nodes = "specinfer_model_tree_nodes_total"
    drafted = sum(
        total(a, nodes, role="ssm") - total(b, nodes, role="ssm") for a, b in zip(after[2], before[2], strict=True)
    )
    assert drafted >= steps  # every step drafted at least the root's children


def test_client_from_proto_files_alone(stack, model_pair, expected, tmp_path):
    """Stubs generated from protos/ in a temp dir; the client process imports none of our code."""
    script = textwrap.dedent(
        f"""
        import json, sys
        from grpc_tools import protoc
        out = {str(tmp_path)!r}
        assert protoc.main(["protoc", "-I{REPO / "protos"}", "--python_out=" + out, "--grpc_python_out=" + out,
                            "specinfer/v1/api.proto"]) == 0
        sys.path.insert(0, out)
        import grpc
        from specinfer.v1 import api_pb2, api_pb2_grpc
        import specinfer
        assert specinfer.__file__ is None or specinfer.__file__.startswith(out), specinfer.__file__
        stub = api_pb2_grpc.SpecInferStub(grpc.insecure_channel({stack.address!r}))
        req = api_pb2.GenerateRequest(max_new_tokens={NEW_TOKENS}, \
token_ids=api_pb2.TokenIds(ids={model_pair.prompts[0]!r}))
        tokens = [t for m in stub.Generate(req, timeout=300) for t in m.token_ids]
        print(json.dumps(tokens))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-I", "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == expected[0]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"prompt": []}, "prompt.token_ids"),
        ({"prompt": [10**6]}, "prompt.token_ids"),
        ({"prompt": [5], "max_new_tokens": 0}, "max_new_tokens"),
        ({"prompt": [5], "max_new_tokens": 100000}, "max_new_tokens"),
        ({"prompt": [5], "temperature": -1.0}, "sampling.temperature"),
        ({"prompt": [5], "top_p": 1.5}, "sampling.top_p"),
        ({"prompt": [5], "expansion": (1, 0, 2)}, "speculation.expansion"),
        ({"prompt": [5], "ssms": ("nope",)}, "speculation.ssms"),
        ({"prompt": [5], "expansion": (1, 1), "adaptive": True}, "speculation.adaptive"),
        ({"prompt": [5], "stop_token_ids": (-3,)}, "stop_token_ids"),
        ({"prompt": [5], "request_id": "a\x0cb"}, "request_id"),  # IDs go into Redis keys: no control characters
        ({"prompt": [5], "request_id": "x{y}"}, "request_id"),  # nor braces (they would move the key's hash tag)
    ],
)
def test_bad_input_names_the_field(stack, kwargs, field):
    prompt = kwargs.pop("prompt")
    max_new = kwargs.pop("max_new_tokens", 8)
    with Client(stack.address, timeout=60) as client, pytest.raises(grpc.RpcError) as err:
        client.generate(Client.request(prompt, max_new, **kwargs))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field), err.value.details()


def _status(client: Client, request_id: str) -> int | None:
    try:
        return client.get_request(request_id).status
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.NOT_FOUND:
            return None
        raise


def test_bad_requests_do_not_disturb_good_ones(stack, model_pair, expected):
    """Good streams running while a stream of bad requests is refused still match transformers."""
    bad = [
        Client.request([], 8),
        Client.request([10**6], 8),
        Client.request([5], 0),
        Client.request([5], 8, expansion=(0,)),
    ]
    with Client(stack.address, timeout=300) as client, concurrent.futures.ThreadPoolExecutor(4) as pool:
        good = [pool.submit(client.generate, Client.request(model_pair.prompts[i], NEW_TOKENS)) for i in range(4)]
        for _ in range(5):
            for req in bad:
                with pytest.raises(grpc.RpcError) as err:
                    client.generate(req)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        for i, fut in enumerate(good):
            assert fut.result(timeout=300).token_ids == expected[i]


def test_full_queue_and_cancellation(stack, model_pair):
    """A request manager with one batch slot and one queue place: a third request is refused
    with RESOURCE_EXHAUSTED while the others go on, and a cancelled stream frees its slot
    within one iteration (it commits at most one more step)."""
    rm = stack.spawn_request_manager("rm-small", ["--max-batch", "1", "--max-queue", "1", "--max-new-tokens", "4000"])
    prompt = model_pair.prompts[1]
    max_step_tokens = 1 + 8  # deepest default tree (8) + the bonus token
    with Client(rm.address, timeout=300) as client, concurrent.futures.ThreadPoolExecutor(2) as pool:
        long_tokens = client.model_info().max_positions - len(prompt)  # runs far longer than this test
        stream_a = client.stream(Client.request(prompt, long_tokens, ignore_eos=True, request_id="long-a"))
        assert next(stream_a).request_id == "long-a"  # A holds the only batch slot
        fut_b = pool.submit(client.generate, Client.request(prompt, 4, request_id="short-b"))
        wait_until(lambda: _status(client, "short-b") == api_pb2.REQUEST_STATUS_QUEUED)
        with pytest.raises(grpc.RpcError) as err:
            client.generate(Client.request(prompt, 4, request_id="refused-c"))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        before = len(client.get_request("long-a").output_token_ids)
        assert client.cancel("long-a")
        rest = list(stream_a)
        assert rest[-1].finished.reason == api_pb2.FINISH_REASON_CANCELLED
        after = client.get_request("long-a")
        assert after.status == api_pb2.REQUEST_STATUS_FINISHED
        # one step may land between reading `before` and the cancel, one is in flight when it lands
        assert len(after.output_token_ids) <= before + 2 * max_step_tokens
        b = fut_b.result(timeout=120)
        assert b.finished.reason in (api_pb2.FINISH_REASON_LENGTH, api_pb2.FINISH_REASON_EOS)
        assert len(b.token_ids) >= 1


def test_deadline_is_honoured(stack, model_pair):
    """A client deadline ends the stream with DEADLINE_EXCEEDED and the request stops server-side."""
    prompt = model_pair.prompts[2]
    with Client(stack.address, timeout=30) as client:
        info = client.model_info()
        long_tokens = min(
            info.max_new_tokens_limit, info.max_positions - len(prompt)
        )  # takes far longer than the deadline
    with Client(stack.address, timeout=0.3) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.generate(Client.request(prompt, long_tokens, ignore_eos=True, request_id="deadline-a"))
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    with Client(stack.address, timeout=30) as client:
        wait_until(lambda: client.get_request("deadline-a").status == api_pb2.REQUEST_STATUS_FINISHED, timeout=30)
        state = client.get_request("deadline-a")
        assert state.finished.reason == api_pb2.FINISH_REASON_CANCELLED
        assert len(state.output_token_ids) < long_tokens


def test_request_manager_restart_resumes_from_redis(stack, model_pair, tmp_path):
    """kill -9 the request manager mid-request, start it again on the same Redis: the request
    continues from its committed tokens, and a client reattaching from offset 0 gets exactly the
    transformers output (no gap, no duplicate)."""
    from specinfer.request_manager.state.redis_server import EmbeddedRedis

    prompt, new_tokens = model_pair.prompts[5], 200  # long enough to be mid-way at the kill
    hf = AutoModelForCausalLM.from_pretrained(str(model_pair.llm), dtype=torch.float32)
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    want = out[0, len(prompt) :].tolist()
    with EmbeddedRedis(tmp_path / "redis", appendonly=True, appendfsync="always") as redis:
        # the restart under the same owner takes the killed process's lease at once (docs/request-managers.md)
        args = ["--redis-url", redis.url, "--owner", "rm-restart", "--max-batch", "4", "--lease-seconds", "2"]
        args += [
            "--redis-cluster",
            "off",
            "--redis-min-replica-acks",
            "0",
        ]  # this Redis, whatever the environment says (conftest)
        first = stack.spawn_request_manager("rm-restart-1", args)
        with Client(first.address, timeout=120, failover_seconds=0) as client:  # the error, not a reattachment
            stream = client.stream(Client.request(prompt, new_tokens, request_id="survivor", ignore_eos=True))
            seen = next(stream)
            assert seen.request_id == "survivor" and not seen.HasField("finished")
            first.popen.kill()  # SIGKILL: no shutdown, no cleanup
            first.popen.wait()
            stack.processes.remove(first)  # killed on purpose: not part of the clean-shutdown check
            with pytest.raises(grpc.RpcError):
                list(stream)
        second = stack.spawn_request_manager("rm-restart-2", args)
        with Client(second.address, timeout=120) as client:
            request = api_pb2.GenerateRequest(request_id="survivor", resume_from=0)
            messages = list(client.stub.Generate(request, timeout=120))
            tokens = [t for m in messages for t in m.token_ids]
            assert messages[-1].finished.reason == api_pb2.FINISH_REASON_LENGTH
            # transformers stops at EOS where the request ignores it: compare what both produced
            assert len(tokens) == new_tokens and tokens[: len(want)] == want
            assert list(client.get_request("survivor").output_token_ids) == tokens
        log = (stack.workdir / "rm-restart-2.log").read_text()
        assert '"resumed requests from Redis", "count": 1' in log, (
            "the second request manager did not resume the request"
        )
