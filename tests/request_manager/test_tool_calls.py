"""Tool calls on the chat API, the pure parts (services/request_manager/api/tool_calls.py): the request's tools checked,
the grammar of a required call compiled over the bundled tokenizer and matched against outputs, the prompt (tools given
to a tool-aware template as transformers gives them; the fallback for other templates is Qwen2.5's own rendering), and
the output parsed into calls, streamed in any pieces as whole, in chunks the official ``openai`` client adds up."""

from __future__ import annotations

import itertools
import json

import jsonschema
import pytest
from hypothesis import given
from hypothesis import strategies as st
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from specinfer.core import InvalidArgument
from specinfer.core.constraints import Grammars
from specinfer.models.loading import eos_token_id
from specinfer.request_manager.api import openai_objects as oo
from specinfer.request_manager.api import openai_wire as ow
from specinfer.request_manager.api import tool_call_parser as tp
from specinfer.request_manager.api import tool_calls as tc
from specinfer.request_manager.api.chat_template import ChatTemplate, check_messages

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    },
}
TOOLS = [WEATHER, ADD]
CALL = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris","days":2}}\n</tool_call>'
CALL_2 = '<tool_call>\n{"name":"add","arguments":{"a":1,"b":-2}}\n</tool_call>'

# Qwen2.5-Instruct's chat template (tokenizer_config.json), which knows tools and writes the call format
QWEN = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are \
provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n\
</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or \
(message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# a conversation with calls made, answered, and a question after them
HISTORY = [
    {"role": "system", "content": "You help."},
    {"role": "user", "content": "Weather in Paris and 1 + 2?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "3"},
    {"role": "assistant", "content": "Sunny; 3."},
    {"role": "user", "content": "Thanks"},
]


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def parser(max_calls: int | None = None) -> tp.CallParser:
    return tp.CallParser(frozenset({"get_weather", "add"}), max_calls, ids())


# -- the request --------------------------------------------------------------------------------------------------


def test_defaults_follow_openai():
    assert tc.tool_request({}) == tc.ToolRequest()
    assert tc.tool_request({"tools": []}).choice == "none"
    request = tc.tool_request({"tools": TOOLS})
    assert (request.choice, request.parallel, [t.name for t in request.offered]) == (
        "auto",
        True,
        ["get_weather", "add"],
    )
    assert not request.constrained and request.parser() is not None
    none = tc.tool_request({"tools": TOOLS, "tool_choice": "none"})
    assert none.offered == () and none.parser() is None
    named = tc.tool_request({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}}})
    assert (named.choice, named.name, named.constrained) == ("function", "add", True)
    assert tc.tool_request({"tools": [ADD]}).tools[0].as_openai() == ADD  # as given (no description: none added)
    empty = tc.tool_request({"tools": [{"type": "function", "function": {"name": "now"}}]}).tools[0]
    assert empty.parameters == {"type": "object", "properties": {}, "additionalProperties": False}  # OpenAI's meaning


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"tools": {"a": 1}}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tools": [WEATHER, {"type": "function"}]}, "tools[1].function"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
        ({"tools": [ADD, ADD]}, "tools[1].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "description": 3}}]},
            "tools[0].function.description",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "tools[0].function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
            "tools[0].function.parameters",
        ),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 1}}}
                ]
            },
            "tools[0].function.parameters",
        ),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "regex": "a+"}, "tool_choice"),
    ],
)
def test_bad_tools_name_the_field(body, field):
    with pytest.raises(InvalidArgument) as err:
        tc.tool_request(body)
    assert err.value.field == field
    assert ow.openai_param(err.value.field) == field  # the HTTP error's param


def test_tool_fields_leave_the_completions_body():
    body = {"messages": [], "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 3}
    assert ow.chat_as_completion(body, [1, 2], "start: x") == {"max_tokens": 3, "prompt": [1, 2], "grammar": "start: x"}
    assert ow.chat_as_completion({"tools": TOOLS}, [1]) == {"prompt": [1]}


# -- the grammar of a constrained choice ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def grammar(model_pair):
    """Whether a text, as the bundled LLM's tokenizer encodes it, is a whole match of a tool request's constraint."""
    grammars = Grammars((model_pair.llm / "tokenizer.json").read_text(), 4096, eos_token_id(model_pair.llm))
    tokenizer = Tokenizer.from_file(str(model_pair.llm / "tokenizer.json"))

    def matches(request: tc.ToolRequest, text: str) -> bool:
        constraint = request.constraint(grammars)
        assert constraint is not None
        state = grammars.state(constraint)
        try:
            state.advance(tokenizer.encode(text, add_special_tokens=False).ids)
        except RuntimeError:  # a token the grammar refuses
            return False
        return state.complete

    return matches


def test_call_schema_is_a_call_to_one_tool():
    schema = tc.call_schema(tc.tool_request({"tools": TOOLS}).tools)
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, schema)
    jsonschema.validate({"name": "add", "arguments": {"a": 1, "z": "add's schema allows more"}}, schema)
    for bad in (
        {"name": "get_weather", "arguments": {"city": "Paris"}},  # days missing
        {"name": "get_weather", "arguments": {"city": "Paris", "days": 2, "x": 1}},  # no additional properties
        {"name": "sub", "arguments": {}},
        {"arguments": {"a": 1}},
        {"name": "add", "arguments": {"a": 1}, "extra": 1},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_required_and_named_grammars_admit_exactly_calls(grammar):
    required = tc.tool_request({"tools": TOOLS, "tool_choice": "required"})
    single = tc.tool_request({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False})
    named = tc.tool_request({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}}})
    assert grammar(required, CALL) and grammar(required, CALL_2) and grammar(required, f"{CALL}\n{CALL_2}")
    assert grammar(single, CALL) and not grammar(single, f"{CALL}\n{CALL_2}")
    assert grammar(named, CALL_2) and grammar(named, f"{CALL_2}\n{CALL_2}") and not grammar(named, CALL)
    for bad in (
        "",
        "Sure.",
        CALL.replace("Paris", "Paris is a city in France"),  # maxLength 12
        CALL.replace('"days":2', '"days":0'),  # minimum 1
        CALL.replace('"name":"get_weather","arguments"', '"arguments"'),
        CALL.replace("get_weather", "get_time"),
        CALL.replace('{"name"', '{ "name"'),  # compact JSON only
        f"{CALL}\n",
    ):
        assert not grammar(required, bad), bad
    for call in (CALL, CALL_2):  # what the grammar admits is what the parser reads
        message = tp.parse(call, parser())
        assert message.content is None and len(message.calls) == 1
        jsonschema.validate(
            {"name": message.calls[0].name, "arguments": json.loads(message.calls[0].arguments)},
            tc.call_schema(required.tools),
        )


def test_a_schema_the_grammar_library_refuses_names_tools(grammar):
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "minProperties": "x"}}}
    with pytest.raises(InvalidArgument) as err:
        grammar(tc.tool_request({"tools": [bad], "tool_choice": "required"}), "")
    assert err.value.field == "tools"
    with pytest.raises(InvalidArgument) as err:
        tc.tool_request({"tools": TOOLS, "tool_choice": "required"}).constraint(None)  # no tokenizer: refused
    assert err.value.field == "tool_choice"
    assert tc.tool_request({"tools": [bad]}).constraint(None) is None  # auto constrains nothing


# -- the prompt ----------------------------------------------------------------------------------------------------


@pytest.fixture
def checkpoint(model_pair, tmp_path):
    """A folder with the LLM's tokenizer and ``template`` as its chat template (for transformers)."""

    def make(template: str):
        config = json.loads((model_pair.llm / "tokenizer_config.json").read_text())
        (tmp_path / "tokenizer.json").write_bytes((model_pair.llm / "tokenizer.json").read_bytes())
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
        return tmp_path

    return make


def hf_messages(messages: list[dict]) -> list[dict]:
    """``messages`` as transformers' templates take them: a call's arguments as an object."""
    out = json.loads(json.dumps(messages))
    for m in out:
        for call in m.get("tool_calls") or ():
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return out


@pytest.mark.parametrize("with_tools", [True, False])
def test_a_tool_aware_template_gets_the_tools_and_calls_as_transformers_gives_them(checkpoint, with_tools):
    ours = ChatTemplate(QWEN, {})
    assert ours.knows_tools and not ChatTemplate(CHATML, {}).knows_tools
    tools = tc.tool_request({"tools": TOOLS}).offered if with_tools else ()
    hf = PreTrainedTokenizerFast.from_pretrained(str(checkpoint(QWEN)))
    theirs = hf.apply_chat_template(
        hf_messages(HISTORY), tools=TOOLS if with_tools else None, tokenize=False, add_generation_prompt=True
    )
    assert ours.render(check_messages(HISTORY), True, tools) == theirs


def test_the_fallback_renders_as_qwen_does(checkpoint):
    """A template that knows no tools (ChatML) gets them and the calls in its messages, so that it writes what
    Qwen2.5's template writes with the tools."""
    hf = PreTrainedTokenizerFast.from_pretrained(str(checkpoint(QWEN)))
    theirs = hf.apply_chat_template(hf_messages(HISTORY), tools=TOOLS, tokenize=False, add_generation_prompt=True)
    tools = tc.tool_request({"tools": TOOLS}).offered
    assert ChatTemplate(CHATML, {}).render(check_messages(HISTORY), True, tools) == theirs
    plain = tc.inline_tools(check_messages(HISTORY), tools)
    assert [m["role"] for m in plain] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert all(set(m) == {"role", "content"} and isinstance(m["content"], str) for m in plain)
    # no system message: the tools get their own
    first = tc.inline_tools([{"role": "user", "content": "hi"}], tools)[0]
    assert first["role"] == "system" and first["content"].startswith(tc.TOOLS_HEADER)


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        ([{"role": "tool", "content": "x"}], "messages[0].tool_call_id"),
        ([{"role": "user", "content": "x", "tool_calls": []}], "messages[0].tool_calls"),
        ([{"role": "assistant", "content": None, "tool_calls": "x"}], "messages[0].tool_calls"),
        ([{"role": "assistant", "content": None, "tool_calls": [{"type": "code"}]}], "messages[0].tool_calls[0]"),
        (
            [{"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "{}"}}]}],
            "messages[0].tool_calls[0].function.name",
        ),
        (
            [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}],
            "messages[0].tool_calls[0].function.arguments",
        ),
    ],
)
def test_bad_tool_messages_name_the_field(messages, field):
    with pytest.raises(InvalidArgument) as err:
        check_messages(messages)
    assert err.value.field == field


# -- the output ----------------------------------------------------------------------------------------------------

SPACED = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"}ris", "days": [1, {"a": "]"}]}}\n</tool_call>'
)
OUTPUTS = {
    "text": ("def f():\n    return 1 < 2\n", "def f():\n    return 1 < 2\n", []),
    "a call": (CALL, None, [("get_weather", '{"city":"Paris","days":2}')]),
    "text, two calls": (
        f"Let me see.\n{CALL}\n{CALL_2}\n",
        "Let me see.",
        [("get_weather", '{"city":"Paris","days":2}'), ("add", '{"a":1,"b":-2}')],
    ),
    "strings with brackets": (SPACED, None, [("get_weather", '{"city": "Pa\\"}ris", "days": [1, {"a": "]"}]}')]),
    "keys the other way": (
        '<tool_call>{"arguments": {"a": 1}, "name": "add"}</tool_call> done',
        "done",
        [("add", '{"a": 1}')],
    ),
    "arguments as a string": (
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>',
        None,
        [("add", '{"a": 1}')],
    ),
    "no call of these tools": (
        'a \n<tool_call>{"name": "sub", "arguments": {}}</tool_call> b',
        'a \n<tool_call>{"name": "sub", "arguments": {}}</tool_call> b',
        [],
    ),
    "not JSON": ("<tool_call>\nhello\n</tool_call>", "<tool_call>\nhello\n</tool_call>", []),
    "an unfinished block": ('x <tool_call>\n{"na', 'x <tool_call>\n{"na', []),
    "an unfinished call": ('<tool_call>\n{"name": "add", "arguments": {"a": 1', None, [("add", '{"a": 1')]),
    "a tag's beginning at the end": ("1 <tool_c", "1 <tool_c", []),
}


@pytest.mark.parametrize("name", OUTPUTS)
def test_outputs_parse_the_same_in_any_pieces(name):
    text, content, calls = OUTPUTS[name]
    whole = tp.parse(text, parser())
    assert whole.content == content and [(c.name, c.arguments) for c in whole.calls] == calls
    assert [c.id for c in whole.calls] == [f"call_{i}" for i in range(len(calls))]
    for size in (1, 2, 3, 5, 8):
        p = parser()
        pieces = [piece for i in range(0, len(text), size) for piece in p.feed(text[i : i + size])] + p.finish()
        assert tp.message(pieces) == whole, size
        if calls:  # a call's first piece names it, the rest are arguments
            heads = [x for x in pieces if isinstance(x, tp.CallDelta) and x.id is not None]
            assert [(h.index, h.name, h.arguments) for h in heads] == [(i, n, "") for i, (n, _) in enumerate(calls)]


def test_parallel_tool_calls_false_keeps_the_first_call():
    message = tp.parse(f"{CALL}\n{CALL_2}\nbye", parser(max_calls=1))
    assert [c.name for c in message.calls] == ["get_weather"] and message.content == "bye"


@given(st.text(alphabet=st.sampled_from(list('ab <>/_toolcal\n {}"')), max_size=60))
def test_text_without_calls_is_its_own_content(text):
    if tp.OPEN in text:
        return
    p = tp.CallParser(frozenset({"a"}), None, ids())
    pieces = [x for ch in text for x in p.feed(ch)] + p.finish()
    assert all(isinstance(x, str) for x in pieces) and "".join(pieces) == text


def chunks(text: str, size: int, finish: str = "stop") -> list[dict]:
    """A chat stream's chunks for ``text`` arriving ``size`` characters at a time, as the HTTP handler makes them."""
    env, p = oo.Envelope("chatcmpl-x", "llm", 0), parser()
    out = [oo.chat_chunk(env, 0, {"role": "assistant", "content": ""}, None)]
    parts = [text[i : i + size] for i in range(0, len(text), size)]
    for n, part in enumerate(parts):
        last = n == len(parts) - 1
        pieces = p.feed(part) + (p.finish() if last else [])
        out += oo.chat_event_chunks(env, 0, pieces, finish if last else None, p.calls)
    return out


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_the_openai_client_adds_up_the_streamed_calls(size):
    text = f"Let me see.\n{CALL}\n{SPACED}"
    state = ChatCompletionStreamState()
    for chunk in chunks(text, size):
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    done = state.get_final_completion().choices[0]
    env = oo.Envelope("chatcmpl-x", "llm", 0)
    whole = oo.chat_object(
        env, [oo.Choice(0, text=text, finish_reason="stop")], [1], None, tc.tool_request({"tools": TOOLS})
    )
    message = whole["choices"][0]["message"]
    assert done.finish_reason == whole["choices"][0]["finish_reason"] == "tool_calls"
    assert done.message.content == message["content"] == "Let me see."
    assert [(c.function.name, c.function.arguments) for c in done.message.tool_calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]
    ]
    assert all(c.id.startswith("call_") and c.type == "function" for c in done.message.tool_calls)
    assert json.loads(done.message.tool_calls[0].function.arguments) == {"city": "Paris", "days": 2}


def test_finish_reasons_and_plain_messages():
    env, choice = oo.Envelope("chatcmpl-x", "llm", 0), oo.Choice(0, text=CALL, finish_reason="length")
    out = oo.chat_object(env, [choice], [1], None, tc.tool_request({"tools": TOOLS}))["choices"][0]
    assert out["finish_reason"] == "length" and out["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    for tools in (None, tc.tool_request({"tools": TOOLS, "tool_choice": "none"})):
        out = oo.chat_object(env, [oo.Choice(0, text=CALL, finish_reason="stop")], [1], None, tools)["choices"][0]
        assert out["message"] == {"role": "assistant", "content": CALL} and out["finish_reason"] == "stop"
