"""Structured outputs through the services (the real processes on 127.0.0.1, fp32): the gRPC ``constraint`` oneof,
the OpenAI API's ``response_format`` and ``regex``/``grammar`` fields (over HTTP and with the official ``openai``
client, chat and completions, streamed and not) and ``specinfer generate --server --json-schema``. Greedy output
equals constrained incremental decoding token for token (tests/oracles.py); outputs validate; a bad schema, regex or
grammar is INVALID_ARGUMENT / HTTP 400 naming the field, and the server goes on serving."""

from __future__ import annotations

import json
import re

import grpc
import jsonschema
import pytest
from oracles import hf_constrained_greedy  # tests/oracles.py
from test_cli import specinfer  # tests/e2e/test_cli.py
from test_openai_api import (  # tests/e2e/test_openai_api.py
    MESSAGES,
    call,
    chat_prompt,
    client,
    llm_with_template,  # fixtures: the demo LLM's folder with a chat template, and a stack serving it
    stack,
)
from test_structured_engine import SCHEMA  # tests/test_structured_engine.py

from specinfer.client import Client
from specinfer.core.constraints import Constraint, Grammars
from specinfer.models.loading import eos_token_id
from specinfer.v1 import api_pb2

assert llm_with_template and stack  # fixtures of this module too
NEW_TOKENS = 40
PERSON = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}  # OpenAI's form
REGEX = r"(the|a) [a-z]{1,8}( (and|or) [a-z]{1,8}){0,3}\."


@pytest.fixture(scope="module")
def oracle(model_pair):
    grammars = Grammars((model_pair.llm / "tokenizer.json").read_text(), 4096, eos_token_id(model_pair.llm))

    def run(prompt, constraint: Constraint) -> list[int]:
        return hf_constrained_greedy(model_pair.llm, [prompt], NEW_TOKENS, [grammars.state(constraint)])[0]

    return run


@pytest.mark.parametrize("expansion", [(), (1, 1, 3, 1)])  # the server's default (adaptive), a static tree
def test_grpc_constrained_greedy_equals_constrained_incremental_decoding(stack, model_pair, oracle, expansion):
    prompts = [list(p) for p in model_pair.prompts[:2]]
    cases = [
        ({"json_schema": json.dumps(SCHEMA)}, Constraint("json_schema", json.dumps(SCHEMA))),
        ({"regex": REGEX}, Constraint("regex", REGEX)),
        (
            {"grammar": 'root ::= "[" [0-9]+ ("," [0-9]+)* "]"'},
            Constraint("grammar", 'root ::= "[" [0-9]+ ("," [0-9]+)* "]"'),
        ),
    ]
    validated = 0
    with Client(stack.address, timeout=300) as c:
        for kwargs, constraint in cases:
            for prompt in prompts:
                out = c.generate(Client.request(prompt, NEW_TOKENS, expansion=expansion, **kwargs))
                assert list(out.token_ids) == oracle(prompt, constraint), (kwargs, prompt)
                if out.finished.reason != api_pb2.FINISH_REASON_EOS:
                    continue
                validated += 1
                if "json_schema" in kwargs:
                    jsonschema.validate(json.loads(out.text), SCHEMA)
                elif "regex" in kwargs:
                    assert re.fullmatch(REGEX, out.text), out.text
                else:
                    assert re.fullmatch(r"\[[0-9]+(,[0-9]+)*\]", out.text), out.text
    assert validated >= 4  # most outputs end within the budget: the checks above ran


def test_grpc_bad_constraints_are_invalid_argument_naming_the_field(stack, model_pair):
    prompt = list(model_pair.prompts[0])
    with Client(stack.address, timeout=120) as c:
        for kwargs, field in [
            ({"json_schema": '{"type": "nonsense"}'}, "json_schema"),
            ({"json_schema": "{not json"}, "json_schema"),
            ({"regex": "(unclosed"}, "regex"),
            ({"grammar": "start: missing_rule"}, "grammar"),
        ]:
            with pytest.raises(grpc.RpcError) as err:
                c.generate(Client.request(prompt, 4, **kwargs))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            c.generate(Client.request(prompt, 4, json_object=True, ignore_eos=True))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "ignore_eos" in err.value.details()
        assert c.generate(Client.request(prompt, 4)).token_ids  # still serving


def test_http_completions_with_response_format_and_regex(stack, model_pair, oracle):
    prompt = list(model_pair.prompts[1])
    body = {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "response_format": PERSON}
    status, out = call(stack, "/v1/completions", body)
    assert status == 200, out
    expected = oracle(prompt, Constraint("json_schema", json.dumps(SCHEMA)))
    assert out["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(out["choices"][0]["text"]), SCHEMA)
    assert out["usage"]["completion_tokens"] == len(expected)
    status, out = call(
        stack, "/v1/completions", {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "regex": REGEX}
    )
    assert (status == 200 and re.fullmatch(REGEX, out["choices"][0]["text"])) or out["choices"][0][
        "finish_reason"
    ] == "length"
    for bad, param in [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            "response_format",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"regex": "(unclosed"}, "regex"),
        ({"grammar": "start: missing_rule"}, "grammar"),
        ({"regex": "a+", "grammar": 'start: "a"'}, "grammar"),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ]:
        status, out = call(stack, "/v1/completions", {"prompt": prompt, "max_tokens": 4, **bad})
        assert status == 400 and out["error"]["param"] == param, (bad, out)


def test_openai_client_chat_with_a_json_schema(stack, llm_with_template, oracle):
    oa = client(stack)

    def chat(response_format: dict, stream: bool = False):
        return oa.chat.completions.create(
            model=llm_with_template.name,
            messages=MESSAGES,
            max_tokens=NEW_TOKENS,
            temperature=0,
            response_format=response_format,
            stream=stream,
        )

    done = chat(PERSON)
    expected = oracle(chat_prompt(llm_with_template, MESSAGES), Constraint("json_schema", json.dumps(SCHEMA)))
    assert done.usage.completion_tokens == len(expected)
    text = done.choices[0].message.content
    assert done.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    assert "".join(c.choices[0].delta.content or "" for c in chat(PERSON, True) if c.choices) == text
    assert chat({"type": "json_object"}).choices[0].message.content.startswith("{")


def test_generate_with_a_json_schema_in_process_and_through_the_server(stack, model_pair, tmp_path):
    """The same greedy JSON both ways (the server's default speculation, the CLI's default tree)."""
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    flags = ("--max-new-tokens", str(NEW_TOKENS), "--json-schema", str(schema), "Alice is")
    remote = specinfer("generate", "--server", stack.address, *flags)
    assert remote.returncode == 0, remote.stderr
    text = remote.stdout.split("--- generated (streamed)\n", 1)[1].split("\n--- ", 1)[0]
    jsonschema.validate(json.loads(text), SCHEMA)
    local = specinfer(
        "generate", "--llm", str(model_pair.llm), "--ssm", str(model_pair.ssm), "--dtype", "float32", *flags
    )
    assert local.returncode == 0, local.stderr
    assert re.search(r"^--- generated \(\d+ tokens, finish: eos\)\n" + re.escape(text) + "\n", local.stdout, re.M), (
        local.stdout,
        text,
    )
    bad = specinfer("generate", "--server", stack.address, "--regex", "(x", "hi")
    assert bad.returncode == 2 and "regex" in bad.stderr
