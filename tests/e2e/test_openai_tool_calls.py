"""Tool calls through the services (the real processes on 127.0.0.1, fp32) with the official ``openai`` client: the
demo LLM's template knows no tools, so they reach it through the fallback (Qwen2.5's tools block); ``tool_choice``
``required`` and a named function give calls whose arguments validate against the tool's parameters, token for token
what constrained incremental decoding gives (tests/oracles.py) under the server's default speculation and a static
tree, streamed (the client's own accumulation) as not; a follow-up with the tool's answer is accepted and rendered; bad
tools are 400 naming the field."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from oracles import hf_constrained_greedy, serving  # tests/oracles.py
from test_openai_api import (  # tests/e2e/test_openai_api.py
    call,
    chat_prompt,
    client,
    greedy_text,  # fixture: transformers' greedy decoding
    http_stack_config,
    llm_with_template,  # fixture: the demo LLM's folder with a chat template (ChatML, no tools)
)

from specinfer.checkpoint import load_tokenizer
from specinfer.core.constraints import Grammars
from specinfer.models.loading import eos_token_id
from specinfer.request_manager.api import tool_call_parser as tp
from specinfer.request_manager.api import tool_calls as tc
from specinfer.request_manager.api.chat_template import check_messages

assert llm_with_template and greedy_text  # fixtures of this module too
NEW_TOKENS = 96
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city over the next days",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
        "strict": True,  # the openai client then parses the arguments of streamed calls too
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "a + b",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}
TOOLS = [WEATHER, ADD]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "system", "content": "You help."}, {"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def stack(model_pair, llm_with_template, tmp_path_factory):
    state = tmp_path_factory.mktemp("state")
    with serving(http_stack_config(model_pair.ssm, llm_with_template, state, ("--dtype", "float32"))) as s:
        yield s


@pytest.fixture(scope="module")
def oracle(model_pair, llm_with_template):
    """The prompt (transformers' rendering of the messages as the fallback writes them) and constrained incremental
    decoding of a tool request's grammar from it: (prompt, output tokens, output text)."""
    grammars = Grammars((model_pair.llm / "tokenizer.json").read_text(), 4096, eos_token_id(model_pair.llm))
    tokenizer = load_tokenizer(model_pair.llm)

    def run(body: dict, new_tokens: int = NEW_TOKENS) -> tuple[list[int], list[int], str]:
        request = tc.tool_request(body)
        prompt = chat_prompt(llm_with_template, tc.inline_tools(check_messages(body["messages"]), request.offered))
        constraint = request.constraint(grammars)
        if constraint is None:
            return prompt, [], ""
        tokens = hf_constrained_greedy(model_pair.llm, [prompt], new_tokens, [grammars.state(constraint)])[0]
        return prompt, tokens, tokenizer.decode(tokens, skip_special_tokens=True)

    return run


def calls_of(message) -> list[tuple[str, str]]:
    """An openai client's message's calls: (name, arguments)."""
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]


def parsed(text: str, body: dict) -> list[tuple[str, str]]:
    """The calls :mod:`tool_calls` reads in ``text``: (name, arguments)."""
    return [(c.name, c.arguments) for c in tp.parse(text, tc.tool_request(body).parser()).calls]


def validate(calls: list[tuple[str, str]]) -> None:
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), PARAMETERS[name])


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_a_required_or_named_call_is_constrained_decoding_token_for_token(
    stack, llm_with_template, oracle, tool_choice
):
    oa = client(stack)
    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": tool_choice, "parallel_tool_calls": False}
    kwargs = {**body, "model": llm_with_template.name, "max_tokens": NEW_TOKENS, "temperature": 0}
    done = oa.chat.completions.create(**kwargs)
    prompt, tokens, text = oracle(body)
    choice = done.choices[0]
    assert done.usage.prompt_tokens == len(prompt) and done.usage.completion_tokens == len(tokens)
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    expected = parsed(text, body)
    assert calls_of(choice.message) == expected and len(expected) == 1
    validate(expected)
    if tool_choice == NAMED:
        assert expected[0][0] == "get_weather"
    made = choice.message.tool_calls[0]
    assert made.id.startswith("call_") and made.type == "function"
    static = oa.chat.completions.create(**kwargs, extra_body={"speculation": {"expansion": [1, 1, 3, 1]}})
    assert static.usage.completion_tokens == len(tokens) and calls_of(static.choices[0].message) == expected
    # streamed: the client's own accumulation of the deltas, which parses the strict tools' arguments
    with oa.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and calls_of(final.message) == expected
    assert final.message.tool_calls[0].function.parsed_arguments == json.loads(expected[0][1])


def test_parallel_calls_stream_as_openai_deltas(stack, llm_with_template, oracle):
    """``parallel_tool_calls`` (default true): one or more calls, streamed as OpenAI streams them: a call's first
    delta has its index, id and name, the later ones pieces of its arguments."""
    oa = client(stack)
    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required"}
    kwargs = {**body, "model": llm_with_template.name, "max_tokens": NEW_TOKENS, "temperature": 0}
    done = oa.chat.completions.create(**kwargs).choices[0]
    _, _, text = oracle(body)
    expected = parsed(text, body)
    assert calls_of(done.message) == expected and len(expected) >= 2  # the demo LLM calls again and again
    complete = expected if done.finish_reason == "tool_calls" else expected[:-1]  # the last may be cut by length
    assert done.finish_reason in ("tool_calls", "length") and len(complete) >= 1
    validate(complete)
    chunks = list(oa.chat.completions.create(**kwargs, stream=True))
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or ()]
    heads = [d for d in deltas if d.id is not None]
    assert [(d.index, d.function.name, d.function.arguments) for d in heads] == [
        (i, name, "") for i, (name, _) in enumerate(expected)
    ]
    assert all(d.type == "function" and d.id.startswith("call_") for d in heads)
    assert len({d.id for d in heads}) == len(heads)
    streamed = ["".join(d.function.arguments for d in deltas if d.index == i) for i in range(len(expected))]
    assert streamed == [arguments for _, arguments in expected]
    assert chunks[-1].choices[0].finish_reason == done.finish_reason


def test_a_follow_up_with_the_tool_answer(stack, llm_with_template, oracle, greedy_text):
    """The call and its answer go back in ``messages``: rendered (the prompt is transformers' rendering of what the
    fallback writes), and under ``auto`` the output is the LLM's own, parsed (it is text: the demo LLM makes no
    calls unconstrained)."""
    oa = client(stack)
    first = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": NAMED, "parallel_tool_calls": False}
    made = oa.chat.completions.create(
        **first, model=llm_with_template.name, max_tokens=NEW_TOKENS, temperature=0
    ).choices[0]
    messages = [
        *MESSAGES,
        made.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": made.message.tool_calls[0].id, "content": '{"sky": "clear", "high": 21}'},
    ]
    for tool_choice in ("auto", "none"):
        body = {"messages": messages, "tools": TOOLS, "tool_choice": tool_choice}
        prompt, _, _ = oracle(body)
        done = oa.chat.completions.create(
            **body, model=llm_with_template.name, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
        )
        assert done.usage.prompt_tokens == len(prompt)
        text, parser = greedy_text(prompt, 16)[1], tc.tool_request(body).parser()
        expected = text if parser is None else tp.parse(text, parser).content
        assert done.choices[0].message.content == expected and calls_of(done.choices[0].message) == []
        streamed = oa.chat.completions.create(
            **body,
            model=llm_with_template.name,
            max_tokens=16,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected


def test_bad_tools_are_400_naming_the_field(stack):
    nameless = {"type": "function", "function": {"parameters": {"type": "object"}}}
    stringly = {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
    for extra, param in [
        ({"tools": [WEATHER, nameless]}, "tools[1].function.name"),
        ({"tools": [stringly]}, "tools[0].function.parameters"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"messages": [*MESSAGES, {"role": "tool", "content": "x"}]}, "messages[2].tool_call_id"),
    ]:
        status, out = call(stack, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, **extra})
        assert status == 400 and out["error"]["param"] == param, (extra, out)
    with pytest.raises(openai.BadRequestError) as err:
        client(stack).chat.completions.create(
            model=stack.config.llm.name, messages=MESSAGES, tools=[stringly], max_tokens=4
        )
    assert err.value.body["param"] == "tools[0].function.parameters"
    status, out = call(stack, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})
    assert status == 200 and out["choices"][0]["message"]["content"] is not None  # still serving
