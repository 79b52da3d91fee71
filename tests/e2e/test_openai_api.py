"""The OpenAI-compatible HTTP API of the request manager, end to end: the real services as
processes on 127.0.0.1, called over plain HTTP (urllib) and with the official ``openai`` client."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
import torch
from oracles import hf_logprobs, hf_plain_decoding, hf_seeded_sampling, serving  # tests/oracles.py
from services.harness import wait_until  # tests/services/harness.py
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from specinfer.checkpoint import load_tokenizer
from specinfer.client import Client
from specinfer.core import SamplingParams
from specinfer.launcher import Stack, StackConfig
from specinfer.request_manager.state.redis_server import free_tcp_port
from specinfer.v1 import api_pb2

NEW_TOKENS = 12


# ChatML, refusing developer messages (a template's raise_exception must reach the client as a 400); it knows no
# tools, so tool messages reach it as user messages (services/request_manager/api/tool_calls.py, "fallback")
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'developer' %}"
    "{{ raise_exception('developer messages are not supported') }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def llm_with_template(model_pair, tmp_path_factory) -> Path:
    """The shared LLM with a chat template: its files linked, tokenizer_config.json with the template."""
    folder = tmp_path_factory.mktemp("templated") / model_pair.llm.name
    folder.mkdir()
    for f in model_pair.llm.iterdir():
        if f.name != "tokenizer_config.json":
            (folder / f.name).symlink_to(f)
    config = json.loads((model_pair.llm / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return folder


def http_stack_config(ssm: Path, llm: Path, state_dir: Path, model_args: tuple[str, ...] = ()) -> StackConfig:
    """One SSM worker, the verifier and the request manager with its HTTP API on a free port."""
    return StackConfig(
        llm=llm,
        ssms=(ssm,),
        workers=1,
        port=0,
        state_dir=state_dir,
        threads=1,
        http_port=free_tcp_port(),
        rm_args=("--max-queue", "8", "--max-new-tokens", "4096"),
        model_args=model_args,
    )


@pytest.fixture(scope="module")
def stack(model_pair, llm_with_template, tmp_path_factory):
    with serving(http_stack_config(model_pair.ssm, llm_with_template, tmp_path_factory.mktemp("state"))) as s:
        yield s


@pytest.fixture(scope="module")
def greedy_text(model_pair):
    hf = AutoModelForCausalLM.from_pretrained(str(model_pair.llm), dtype=torch.float32)
    tok = load_tokenizer(model_pair.llm)

    def run(prompt: list[int], n: int) -> tuple[list[int], str]:
        with torch.inference_mode():
            out = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        ids = out[0, len(prompt) :].tolist()
        return ids, tok.decode(ids, skip_special_tokens=True)  # the servers' default: no special tokens in the text

    return run


@pytest.fixture(scope="module")
def eos_first(
    stack, model_pair, llm_with_template, greedy_text, tmp_path_factory
) -> tuple[str, str, list[int], int, str]:
    """A request manager on the stack whose checkpoint folder makes EOS the token the LLM emits first after
    ``prompt``, a special token of its tokenizer (the reported bug: a greedy completion that is EOS at once
    came back as the text "</s>"), whatever the model: (gRPC address, HTTP base URL, prompt, that token,
    its text)."""
    from tokenizers import AddedToken, Tokenizer

    prompt = list(model_pair.prompts[6])
    (first,), _ = greedy_text(prompt, 1)
    folder = tmp_path_factory.mktemp("eos-first") / llm_with_template.name
    folder.mkdir()
    edited = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
    for f in llm_with_template.iterdir():
        if f.name not in edited:
            (folder / f.name).symlink_to(f.resolve())
    tok = Tokenizer.from_file(str(llm_with_template / "tokenizer.json"))
    content = tok.id_to_token(first)
    tok.add_special_tokens([AddedToken(content, special=True, normalized=False)])  # an existing token: its ID is kept
    assert tok.token_to_id(content) == first
    tok.save(str(folder / "tokenizer.json"))
    for name in edited[:2]:
        if (llm_with_template / name).is_file():
            config = json.loads((llm_with_template / name).read_text())
            (folder / name).write_text(json.dumps({**config, "eos_token_id": first}))
    config = json.loads((llm_with_template / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": content}))
    port = free_tcp_port()
    proc = stack.spawn_request_manager("rm-eos-first", ["--http-port", str(port), "--model-dir", str(folder)])
    return proc.address, f"http://127.0.0.1:{port}/v1", prompt, first, tok.decode([first], skip_special_tokens=False)


def test_eos_is_not_in_the_text_unless_asked(eos_first):
    address, base_url, prompt, eos, eos_text = eos_first
    assert eos_text  # the token has a spelling, which the text must leave out
    with Client(address, timeout=120) as grpc_client:
        for skip, text in ((None, ""), (True, ""), (False, eos_text)):
            request = Client.request(prompt, max_new_tokens=4)
            if skip is not None:
                request.skip_special_tokens = skip
            msgs = list(grpc_client.stream(request))
            assert [t for m in msgs for t in m.token_ids] == [eos]  # token IDs keep it
            assert "".join(m.text for m in msgs) == text and msgs[-1].finished.reason == api_pb2.FINISH_REASON_EOS
            assert grpc_client.get_request(msgs[0].request_id).text == text
    oa = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    model = oa.models.list().data[0].id
    for extra, text in (({}, ""), ({"skip_special_tokens": False}, eos_text)):
        done = oa.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0, extra_body=extra)
        assert (
            done.choices[0].text == text
            and done.choices[0].finish_reason == "stop"
            and done.usage.completion_tokens == 1
        )
        chunks = list(
            oa.completions.create(
                model=model, prompt=prompt, max_tokens=4, temperature=0, stream=True, extra_body=extra
            )
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    # chat completions take the field too (they become the same generate requests), and check its type
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert oa.chat.completions.create(**chat, extra_body={"skip_special_tokens": False}).choices
    for create, body in (
        (oa.chat.completions.create, chat),
        (oa.completions.create, {"model": model, "prompt": prompt}),
    ):
        with pytest.raises(openai.BadRequestError) as err:
            create(**body, extra_body={"skip_special_tokens": "no"})
        assert err.value.body["param"] == "skip_special_tokens"


def url(stack: Stack, path: str) -> str:
    return f"http://127.0.0.1:{stack.config.http_port}{path}"


def call(stack: Stack, path: str, body: dict | bytes | None = None, headers: dict | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        url(stack, path), data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def events(stack: Stack, body: dict, path: str = "/v1/completions") -> list[dict | str]:
    """The server-sent events of a streaming call: each ``data:`` payload, parsed (``[DONE]`` as is)."""
    req = urllib.request.Request(
        url(stack, path), data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    out: list[dict | str] = []
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        for line in resp:
            line = line.decode().strip()
            if line.startswith("data: "):
                payload = line.removeprefix("data: ")
                out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def test_health_and_models(stack, model_pair):
    status, body = call(stack, "/health")
    assert status == 200 and body == {"status": "ok"}
    status, body = call(stack, "/v1/models")
    assert status == 200 and body["object"] == "list"
    assert [m["id"] for m in body["data"]] == [model_pair.llm.name]


def test_completion_equals_transformers_greedy(stack, model_pair, greedy_text):
    prompt = list(model_pair.prompts[0])
    body = {
        "model": model_pair.llm.name,
        "prompt": prompt,
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    status, out = call(stack, "/v1/completions", body)
    assert status == 200, out
    _, text = greedy_text(prompt, NEW_TOKENS)
    assert out["object"] == "text_completion" and out["model"] == model_pair.llm.name
    assert out["choices"] == [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}]
    usage = {k: v for k, v in out["usage"].items() if k != "prompt_tokens_details"}
    assert usage == {
        "prompt_tokens": len(prompt),
        "completion_tokens": NEW_TOKENS,
        "total_tokens": len(prompt) + NEW_TOKENS,
    }
    assert 0 <= out["usage"]["prompt_tokens_details"]["cached_tokens"] < len(prompt)
    spec = out["speculation"]
    assert spec["num_drafts"] >= 1 and spec["num_accepted_tokens"] <= spec["num_draft_tokens"]
    assert spec["mean_accepted_length"] == pytest.approx(NEW_TOKENS / spec["num_drafts"], rel=1e-3)
    # the same request with speculation turned off: the same text, one LLM step per token
    status, plain = call(stack, "/v1/completions", {**body, "speculation": "disabled"})
    assert status == 200 and plain["choices"][0]["text"] == text and plain["speculation"]["num_drafts"] == NEW_TOKENS


def test_several_prompts_and_samples(stack, model_pair, greedy_text):
    prompts = [list(model_pair.prompts[1]), list(model_pair.prompts[2])]
    body = {"prompt": prompts, "n": 2, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "echo": True}
    status, out = call(stack, "/v1/completions", body)
    assert status == 200, out
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    tok = load_tokenizer(model_pair.llm)
    for i, c in enumerate(out["choices"]):
        prompt = prompts[i // 2]
        assert (
            c["text"] == tok.decode(prompt, skip_special_tokens=False) + greedy_text(prompt, 6)[1]
        )  # echo: prompt first
    assert out["usage"]["prompt_tokens"] == sum(len(p) for p in prompts) and out["usage"]["completion_tokens"] == 24
    # seeded sampling on a static tree: the same seed gives the same samples, sample i uses seed + i
    # (adaptive trees depend on measured timings, so under "auto" a seed fixes the distribution, not the draw)
    sampled = {
        "prompt": prompts[0],
        "n": 2,
        "max_tokens": 8,
        "temperature": 1.0,
        "seed": 7,
        "ignore_eos": True,
        "speculation": {"expansion": [1, 1, 3, 1]},
    }
    first, second = call(stack, "/v1/completions", sampled)[1], call(stack, "/v1/completions", sampled)[1]
    assert [c["text"] for c in first["choices"]] == [c["text"] for c in second["choices"]]
    one = call(stack, "/v1/completions", {**sampled, "n": 1, "seed": 8})[1]
    assert one["choices"][0]["text"] == first["choices"][1]["text"]


def test_streaming_with_usage(stack, model_pair, greedy_text):
    prompt = list(model_pair.prompts[3])
    body = {
        "prompt": prompt,
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    got = events(stack, body)
    assert got[-1] == "[DONE]"
    chunks, usage = got[:-2], got[-2]
    assert all(c["object"] == "text_completion" and len(c["choices"]) == 1 for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == greedy_text(prompt, NEW_TOKENS)[1]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == NEW_TOKENS
    assert len({c["id"] for c in got[:-1]}) == 1
    # without include_usage: no usage chunk
    plain = events(stack, {**body, "stream_options": None})
    assert plain[-1] == "[DONE]" and all(c["choices"] for c in plain[:-1])


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": "x", "temperature": 3}, 400, "temperature"),
        ({"prompt": "x", "top_p": 0}, 400, "top_p"),
        ({"prompt": "x", "n": 100}, 400, "n"),
        ({"prompt": []}, 400, "prompt"),
        ({"max_tokens": 4}, 400, "prompt"),
        ({"prompt": [1, 2, 10**9]}, 400, "prompt"),
        ({"prompt": "x", "stop": 5}, 400, "stop"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ({"prompt": "x", "speculation": {"expansion": [2, 0]}}, 400, "speculation"),
        ({"prompt": "x", "speculation": {"ssms": ["nope"]}}, 400, "speculation"),
        ({"prompt": "x", "speculation": {"adaptive": True, "suffix": "yes"}}, 400, "speculation"),
        ({"prompt": "x", "logprobs": 30}, 400, "logprobs"),
        ({"prompt": "x", "logprobs": 3, "echo": True}, 400, "logprobs"),
        ({"prompt": "x", "max_tokens": 5000}, 400, "max_tokens"),
        ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ],
)
def test_bad_requests_are_openai_errors_naming_the_param(stack, body, status, param):
    got, out = call(stack, "/v1/completions", body)
    assert got == status, out
    assert out["error"]["param"] == param and out["error"]["message"]
    assert out["error"]["type"] == "invalid_request_error"


def test_malformed_body_and_the_service_stays_up(stack):
    assert call(stack, "/v1/completions", b"{not json")[0] == 400
    assert call(stack, "/v1/completions", b"[1, 2]")[0] == 400
    assert call(stack, "/v1/completions", b"\xff\xfe")[0] == 400
    status, out = call(stack, "/v1/completions", json.dumps({"prompt": "x" * (5 << 20)}).encode())
    assert status == 413 and out["error"]["code"] == "request_too_large"
    assert (
        call(stack, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "2"})[0]
        == 400
    )
    assert call(stack, "/v1/completions", {"prompt": "def f():", "max_tokens": 2})[0] == 200


def test_client_disconnect_cancels_the_request(stack, model_pair):
    prompt = list(model_pair.prompts[4])
    positions = json.loads((model_pair.llm / "config.json").read_text())["max_position_embeddings"]
    max_tokens = positions - len(prompt)  # as long as the model allows: still running when the client leaves
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    conn = http.client.HTTPConnection("127.0.0.1", stack.config.http_port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()[:500]
    deadline = time.monotonic() + 60
    line = resp.readline()
    while not line.startswith(b"data: "):
        assert line and time.monotonic() < deadline, f"no data line in the stream within 60 s (last line: {line!r})"
        line = resp.readline()
    first = json.loads(line.decode().removeprefix("data: "))
    request_id = first["id"] + "-0"  # the choice's request (see openai_wire.generate_requests)
    conn.close()  # the client goes away mid-stream
    with Client(stack.address, timeout=30) as client:

        def finished() -> bool:
            return client.get_request(request_id).status == api_pb2.REQUEST_STATUS_FINISHED

        wait_until(finished, 30, "the abandoned request cancelled")
        state = client.get_request(request_id)
    assert state.finished.reason == api_pb2.FINISH_REASON_CANCELLED and len(state.output_token_ids) < max_tokens


def test_api_key(stack, model_pair, tmp_path):
    key = tmp_path / "key"
    key.write_text("sk-local\n")
    port = free_tcp_port()
    stack.spawn_request_manager("rm-keyed", ["--http-port", str(port), "--auth-token-file", str(key)])
    base = f"http://127.0.0.1:{port}"

    def get(headers: dict) -> int:
        try:
            with urllib.request.urlopen(
                urllib.request.Request(base + "/v1/models", headers=headers), timeout=30
            ) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            body = json.loads(exc.read())
            assert body["error"]["type"] == "authentication_error"
            return exc.code

    assert get({}) == 401
    assert get({"Authorization": "Bearer sk-wrong"}) == 401
    assert get({"Authorization": "Bearer sk-local"}) == 200
    with urllib.request.urlopen(base + "/health", timeout=30) as resp:  # probes need no key
        assert resp.status == 200


MESSAGES = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def fibonacci(n):"}]


def chat_prompt(llm_with_template: Path, messages: list[dict]) -> list[int]:
    """transformers' own rendering and tokenization of ``messages`` (the oracle)."""
    hf = PreTrainedTokenizerFast.from_pretrained(str(llm_with_template))
    return list(hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False))


def test_chat_completion_equals_transformers(stack, llm_with_template, greedy_text):
    body = {
        "model": llm_with_template.name,
        "messages": MESSAGES,
        "max_completion_tokens": NEW_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    status, out = call(stack, "/v1/chat/completions", body)
    assert status == 200, out
    prompt = chat_prompt(llm_with_template, MESSAGES)
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    message = {"role": "assistant", "content": greedy_text(prompt, NEW_TOKENS)[1]}
    assert out["choices"] == [{"index": 0, "message": message, "logprobs": None, "finish_reason": "length"}]
    assert out["usage"]["prompt_tokens"] == len(prompt) and out["usage"]["completion_tokens"] == NEW_TOKENS
    assert out["speculation"]["num_drafts"] >= 1


def test_chat_streaming(stack, llm_with_template, greedy_text):
    body = {
        "messages": MESSAGES,
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "n": 2,
        "stream": True,
    }
    body["stream_options"] = {"include_usage": True}
    got = events(stack, body, "/v1/chat/completions")
    assert got[-1] == "[DONE]" and got[-2]["choices"] == [] and got[-2]["usage"]["completion_tokens"] == 2 * NEW_TOKENS
    chunks = got[:-2]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    expected = greedy_text(chat_prompt(llm_with_template, MESSAGES), NEW_TOKENS)[1]
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content", "") for c in mine) == expected
        assert mine[-1]["delta"] == {} and mine[-1]["finish_reason"] == "length"
        assert all(c["finish_reason"] is None for c in mine[:-1])


def test_chat_errors(stack, model_pair):
    status, out = call(stack, "/v1/chat/completions", {"messages": [{"role": "developer", "content": "x"}]})
    assert (
        status == 400
        and out["error"]["param"] == "messages"
        and "developer messages are not supported" in out["error"]["message"]
    )
    status, out = call(stack, "/v1/chat/completions", {"messages": "hi"})
    assert status == 400 and out["error"]["param"] == "messages"
    status, out = call(stack, "/v1/chat/completions", {"messages": MESSAGES, "echo": True})
    assert status == 400 and out["error"]["param"] == "echo"
    # a model without a chat template: a clear 400
    port = free_tcp_port()
    stack.spawn_request_manager("rm-no-template", ["--http-port", str(port), "--model-dir", str(model_pair.llm)])
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps({"messages": MESSAGES}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=60)
    body = json.loads(err.value.read())
    assert (
        err.value.code == 400
        and body["error"]["param"] == "messages"
        and "no chat template" in body["error"]["message"]
    )


def client(stack: Stack, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=url(stack, "/v1"), api_key=key, max_retries=0, timeout=120)


def test_openai_client_completions(stack, model_pair, greedy_text):
    oa = client(stack)
    model = oa.models.list().data[0].id
    assert model == stack.config.llm.name
    prompt = list(model_pair.prompts[5])
    extra = {"ignore_eos": True}
    done = oa.completions.create(model=model, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, extra_body=extra)
    expected = greedy_text(prompt, NEW_TOKENS)[1]
    assert done.choices[0].text == expected and done.choices[0].finish_reason == "length"
    assert (done.usage.prompt_tokens, done.usage.completion_tokens, done.usage.total_tokens) == (
        len(prompt),
        NEW_TOKENS,
        len(prompt) + NEW_TOKENS,
    )
    stream = oa.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=NEW_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected  # streamed == not streamed
    assert chunks[-1].usage.completion_tokens == NEW_TOKENS
    # a stop string: the text ends before it, finish_reason "stop"
    cut = expected[len(expected) // 2 :][:3]
    assert cut and cut in expected
    stopped = oa.completions.create(
        model=model, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, stop=[cut], extra_body=extra
    )
    assert stopped.choices[0].text == expected[: expected.index(cut)] and stopped.choices[0].finish_reason == "stop"
    # n and seeds: reproducible samples on a static tree
    sampled = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0.9, "n": 3, "seed": 123}
    body = {**extra, "speculation": {"expansion": [1, 1, 3]}}
    a, b = oa.completions.create(**sampled, extra_body=body), oa.completions.create(**sampled, extra_body=body)
    assert [c.text for c in a.choices] == [c.text for c in b.choices] and [c.index for c in a.choices] == [0, 1, 2]


def test_a_seed_fixes_the_text_whatever_the_speculation(stack, model_pair):
    """OpenAI's ``seed`` (coupled verification): the default speculation, a static tree and none give
    the same text, equal to transformers' plain decoding with that seed; with ``n`` = 2, choice i is the
    request seeded ``seed + i``; ``verification: "mss"`` is accepted."""
    oa = client(stack)
    model = oa.models.list().data[0].id
    prompt = list(model_pair.prompts[6])
    sampled = {"model": model, "prompt": prompt, "max_tokens": 24, "temperature": 1.0, "top_p": 0.95}
    texts = []
    for speculation in ("auto", {"expansion": [2, 2, 1]}, "disabled"):
        done = oa.completions.create(**sampled, n=2, seed=40, extra_body={"speculation": speculation})
        texts.append([c.text for c in done.choices])
    assert texts[0] == texts[1] == texts[2]
    tok = load_tokenizer(model_pair.llm)
    oracle = hf_seeded_sampling(
        model_pair.llm, [prompt, prompt], [40, 41], SamplingParams(temperature=1.0, top_p=0.95), 24
    )
    assert texts[0] == [tok.decode(ids, skip_special_tokens=True) for ids in oracle]
    assert oa.completions.create(**sampled, seed=40, extra_body={"verification": "mss"}).choices[0].text


def test_openai_client_chat(stack, llm_with_template, greedy_text):
    oa = client(stack)
    expected = greedy_text(chat_prompt(llm_with_template, MESSAGES), NEW_TOKENS)[1]
    done = oa.chat.completions.create(
        model=llm_with_template.name,
        messages=MESSAGES,
        max_tokens=NEW_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert done.choices[0].message.role == "assistant" and done.choices[0].message.content == expected
    stream = oa.chat.completions.create(
        model=llm_with_template.name,
        messages=MESSAGES,
        max_tokens=NEW_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length"


def test_logprobs_with_the_openai_client(stack, model_pair, llm_with_template, greedy_text):
    """Completions' ``logprobs`` and chat's ``logprobs``/``top_logprobs``, whole and streamed, as OpenAI lays them
    out: the tokens' texts spell the output, the values are transformers' log-softmax at each position (fp32)."""
    oa = client(stack)
    tok = load_tokenizer(model_pair.llm)
    prompt = list(model_pair.prompts[7])
    ids, expected = greedy_text(prompt, NEW_TOKENS)
    oracle = hf_logprobs(model_pair.llm, prompt, ids)
    common = {"model": stack.config.llm.name, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0}
    done = oa.completions.create(**common, logprobs=3, extra_body={"ignore_eos": True})
    lp = done.choices[0].logprobs
    assert done.choices[0].text == expected and len(lp.tokens) == NEW_TOKENS
    assert lp.tokens == [tok.decode([t], skip_special_tokens=False) for t in ids]
    assert lp.token_logprobs == pytest.approx([oracle[k, t].item() for k, t in enumerate(ids)], abs=2e-4)
    assert lp.text_offset == [len("".join(lp.tokens[:k])) for k in range(NEW_TOKENS)]
    for k, top in enumerate(lp.top_logprobs):
        assert 3 <= len(top) <= 4 and top[lp.tokens[k]] == pytest.approx(lp.token_logprobs[k])
        assert sorted(top.values(), reverse=True)[:3] == pytest.approx(oracle[k].topk(3).values.tolist(), abs=2e-4)
    chunks = list(oa.completions.create(**common, logprobs=3, stream=True, extra_body={"ignore_eos": True}))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    # the same up to rounding: a step's tree, hence its batch shape, may differ between the two runs
    assert [v for s in streamed for v in s.token_logprobs] == pytest.approx(lp.token_logprobs, abs=2e-4)
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset
    assert oa.completions.create(**common).choices[0].logprobs is None  # not asked: none

    chat_ids, chat_text = greedy_text(chat_prompt(llm_with_template, MESSAGES), NEW_TOKENS)
    chat_oracle = hf_logprobs(model_pair.llm, chat_prompt(llm_with_template, MESSAGES), chat_ids)
    asked = {"model": llm_with_template.name, "messages": MESSAGES, "max_tokens": NEW_TOKENS, "temperature": 0}
    chat = oa.chat.completions.create(**asked, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert chat.choices[0].message.content == chat_text and len(content) == NEW_TOKENS
    for k, (entry, token) in enumerate(zip(content, chat_ids, strict=True)):
        assert entry.token == tok.decode([token], skip_special_tokens=False)
        assert bytes(entry.bytes) == entry.token.encode()
        assert entry.logprob == pytest.approx(chat_oracle[k, token].item(), abs=2e-4)
        top = chat_oracle[k].topk(2).values.tolist()
        assert [a.logprob for a in entry.top_logprobs] == pytest.approx(top, abs=2e-4)
    chunks = list(oa.chat.completions.create(**asked, logprobs=True, stream=True, extra_body={"ignore_eos": True}))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content] and all(e.top_logprobs == [] for e in streamed)
    with pytest.raises(openai.BadRequestError) as err:
        oa.chat.completions.create(**asked, top_logprobs=2)
    assert err.value.body["param"] == "top_logprobs"


def test_penalties_bias_and_min_p_with_the_openai_client(stack, model_pair):
    """``presence_penalty``, ``frequency_penalty``, ``logit_bias``, and vLLM's ``repetition_penalty`` and ``min_p``,
    greedy and seeded, through the server's default speculation: the text of decoding without speculation under
    the same settings."""
    oa = client(stack)
    tok = load_tokenizer(model_pair.llm)
    hf = AutoModelForCausalLM.from_pretrained(str(model_pair.llm), dtype=torch.float32)
    prompt = list(model_pair.prompts[8])
    penalties = {"presence_penalty": 1.0, "frequency_penalty": 0.5}
    plain = hf_plain_decoding(hf, prompt, SamplingParams(), None, NEW_TOKENS)
    banned = plain[0]  # the token the LLM would start with
    body = {"model": stack.config.llm.name, "prompt": prompt, "max_tokens": NEW_TOKENS, **penalties}
    body["logit_bias"] = {str(banned): -100}
    extra = {"ignore_eos": True, "repetition_penalty": 1.2, "min_p": 0.05}
    for temperature, seed in ((0.0, None), (0.8, 3)):
        params = SamplingParams(
            temperature=temperature,
            seed=seed,
            repetition_penalty=1.2,
            min_p=0.05,
            logit_bias=((banned, -100.0),),
            **penalties,
        )
        want = hf_plain_decoding(hf, prompt, params, seed, NEW_TOKENS)
        assert banned not in want and want != plain
        done = oa.completions.create(**body, temperature=temperature, seed=seed, extra_body=extra)
        assert done.choices[0].text == tok.decode(want, skip_special_tokens=True), (temperature, seed)
    with pytest.raises(openai.BadRequestError) as err:
        oa.completions.create(**{**body, "logit_bias": {"99999999": 1}}, extra_body=extra)
    assert err.value.body["param"] == "logit_bias"


def test_openai_client_errors(stack):
    oa = client(stack)
    with pytest.raises(openai.BadRequestError) as err:
        oa.completions.create(model=stack.config.llm.name, prompt="x", max_tokens=-1)
    assert err.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        oa.completions.create(model="gpt-4", prompt="x")
    assert oa.completions.create(
        model=stack.config.llm.name, prompt="x", max_tokens=2
    ).choices  # a good request still completes


def test_the_readme_openai_example_runs(stack):
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    (block,) = [b.split("```", 1)[0] for b in readme.split("```python\n")[1:] if "from openai import OpenAI" in b]
    code = block.replace("http://localhost:8000/v1", url(stack, "/v1"))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "num_drafts" in proc.stdout and len(proc.stdout) > 100
