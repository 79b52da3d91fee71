"""Tool calls on the OpenAI chat API: the request's ``tools`` and ``tool_choice`` checked, the tools offered to the chat
template (or, for a template that knows no tools, written into the messages), and the grammar that makes a call
certain: pure functions, which the HTTP handler calls (:mod:`.http_api`). The output is parsed back into ``tool_calls``
by :mod:`.tool_call_parser`.

Terms:

- *call format*: how a call is written in the output, the Hermes/Qwen convention (the one Qwen2.5, Qwen3 and Hermes
  templates teach their models): a block ``<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>``, one per
  call, several separated by newlines. It is the one format this module writes (fallback prompt, history) and parses.
- *tool-aware template*: a chat template that uses the ``tools`` variable (transformers' convention); it gets the tools
  and the messages as transformers passes them (a call's ``arguments`` as an object). Any other template gets the
  *fallback*: :func:`inline_tools` writes the tools into a system message (Qwen2.5's tools block, which teaches the call
  format), earlier calls into their assistant message's content and ``tool`` messages into user messages wrapped in
  ``<tool_response>``, as Qwen2.5's template does, so the template sees only roles and text.
- *constrained choice*: ``tool_choice`` ``"required"`` or a named function. The output is then constrained
  (:func:`tool_grammar`: a Lark grammar whose call bodies are a JSON schema built from the tools' ``parameters``), so it
  is always one or more valid calls in the call format, compact JSON; speculation stays exact as for any grammar.
  ``"auto"`` constrains nothing: the model may write text, calls in the call format, or both, and :class:`CallParser`
  picks the calls out. ``"none"`` offers no tools and parses nothing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from specinfer.core import InvalidArgument
from specinfer.core.constraints import Constraint, Grammars
from specinfer.request_manager.api.tool_call_parser import CLOSE, OPEN, CallParser, arguments_value, new_call_id

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
CHOICES = ("none", "auto", "required")
# the constrained output's JSON: compact, keys in the schema's order (name, then arguments)
COMPACT = {"whitespace_flexible": False}
# Qwen2.5's tools block (its chat template's wording), the fallback's system message
TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>"
)


@dataclass(frozen=True)
class Tool:
    """One function a request offers: its ``name``, ``description`` and ``parameters`` (a JSON schema of an object;
    OpenAI's omitted parameters are the empty object)."""

    name: str
    description: str | None
    parameters: Mapping[str, Any]

    def as_openai(self) -> dict[str, Any]:
        """The tool as OpenAI (and a tool-aware template) spells it."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = dict(self.parameters)
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolRequest:
    """What a chat body asks of tools. ``choice``: ``"none"``, ``"auto"``, ``"required"``, or ``"function"`` for a
    named function (``name``); ``parallel``: whether one output may hold several calls."""

    tools: tuple[Tool, ...] = ()
    choice: str = "none"
    name: str | None = None
    parallel: bool = True

    @property
    def offered(self) -> tuple[Tool, ...]:
        """The tools the prompt shows the model (none under ``"none"``)."""
        return () if self.choice == "none" else self.tools

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "function")

    def constraint(self, grammars: Grammars | None) -> Constraint | None:
        """The constraint of a constrained choice, compiled once to check it (errors name ``tools``), else None."""
        if not self.constrained:
            return None
        if grammars is None:
            raise InvalidArgument("tool_choice", "constrained tool calls need the LLM's tokenizer and its EOS token")
        tools = [t for t in self.tools if self.name in (None, t.name)]
        constraint = Constraint("grammar", tool_grammar(tools, self.parallel))
        grammars.check(constraint, "tools")
        return constraint

    def parser(self, new_id: Callable[[], str] | None = None) -> CallParser | None:
        """A parser of one choice's output (None when nothing is parsed: ``"none"``)."""
        if not self.offered:
            return None
        return CallParser(frozenset(t.name for t in self.tools), None if self.parallel else 1, new_id or new_call_id)


def _tool(value: Any, i: int) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(value, Mapping) or value.get("type") != "function":
        raise InvalidArgument(f"{where}.type", 'must be "function"')
    function = value.get("function")
    if not isinstance(function, Mapping):
        raise InvalidArgument(f"{where}.function", "must be an object with name, description and parameters")
    name = function.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise InvalidArgument(f"{where}.function.name", "must be 1 to 64 letters, digits, underscores or dashes")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidArgument(f"{where}.function.description", "must be a string")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}, "additionalProperties": False}
    if not isinstance(parameters, Mapping) or parameters.get("type") != "object":
        raise InvalidArgument(f"{where}.function.parameters", 'must be the JSON schema of an object ("type": "object")')
    if not isinstance(parameters.get("properties", {}), Mapping):
        raise InvalidArgument(f"{where}.function.parameters", "properties must be an object")
    return Tool(name, description, parameters)


def tool_request(body: Mapping[str, Any]) -> ToolRequest:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat body, checked (InvalidArgument naming the
    field: ``tools[0].function.name``, ``tool_choice`` ...). Without ``tools`` (or with an empty list) the choice is
    ``"none"``; with them it defaults to ``"auto"``, as OpenAI's."""
    raw = body.get("tools")
    if raw is None:
        raw = []
    if not isinstance(raw, list):
        raise InvalidArgument("tools", "must be a list of function tools")
    tools = tuple(_tool(t, i) for i, t in enumerate(raw))
    for i, t in enumerate(tools):
        if any(u.name == t.name for u in tools[:i]):
            raise InvalidArgument(f"tools[{i}].function.name", f"{t.name!r} names two tools")
    parallel = body.get("parallel_tool_calls")
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise InvalidArgument("parallel_tool_calls", "must be true or false")
    choice, name = body.get("tool_choice"), None
    if choice is None:
        choice = "auto" if tools else "none"
    elif isinstance(choice, Mapping):
        function = choice.get("function")
        name = function.get("name") if choice.get("type") == "function" and isinstance(function, Mapping) else None
        if not isinstance(name, str):
            raise InvalidArgument("tool_choice", 'a named choice is {"type": "function", "function": {"name": ...}}')
        if not any(t.name == name for t in tools):
            raise InvalidArgument("tool_choice", f"names {name!r}, which is none of the tools")
        choice = "function"
    elif choice not in CHOICES:
        raise InvalidArgument("tool_choice", 'must be "none", "auto", "required" or {"type": "function", ...}')
    if choice != "none" and not tools:
        raise InvalidArgument("tool_choice", "needs tools")
    request = ToolRequest(tools, choice, name, parallel)
    if request.constrained:
        fmt = body.get("response_format")
        if (isinstance(fmt, Mapping) and fmt.get("type") != "text") or any(body.get(k) for k in ("regex", "grammar")):
            raise InvalidArgument("tool_choice", "a required or named tool call cannot also follow response_format")
    return request


def call_schema(tools: Sequence[Tool]) -> dict[str, Any]:
    """The JSON schema of one call's body: ``{"name": <a tool's name>, "arguments": <that tool's parameters>}``, one
    alternative per tool (name first, so a streamed call names its function before its arguments)."""
    return {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": t.name}, "arguments": dict(t.parameters)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in tools
        ],
        "x-guidance": COMPACT,
    }


def tool_grammar(tools: Sequence[Tool], parallel: bool) -> str:
    """The Lark grammar (llguidance's, with its inline ``%json``) of an output of calls to ``tools`` in the call
    format: one call, or with ``parallel`` one or more separated by newlines."""
    calls = 'call ("\\n" call)*' if parallel else "call"
    return (
        f"start: {calls}\n"
        f'call: "{OPEN}\\n" body "\\n{CLOSE}"\n'
        f"body: %json {json.dumps(call_schema(tools), ensure_ascii=False)}\n"
    )


# -- the prompt --------------------------------------------------------------------------------------------------


def _call_block(name: str, arguments: Any) -> str:
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CLOSE}"


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` as a tool-aware template takes them: earlier calls' ``arguments`` as objects (vLLM does this too;
    Qwen's and Llama 3.1's templates write them with ``tojson``)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            calls = [
                {**c, "function": {**c["function"], "arguments": arguments_value(c["function"]["arguments"])}}
                for c in calls
            ]
            m = {**m, "tool_calls": calls}
        out.append(dict(m))
    return out


def inline_tools(messages: Sequence[Mapping[str, Any]], tools: Sequence[Tool]) -> list[dict[str, Any]]:
    """The fallback (module doc): ``messages`` with ``tools`` described in the first system (or developer) message,
    a new one if there is none; an assistant message's ``tool_calls`` as call blocks after its content; each run of
    ``tool`` messages as one user message of ``<tool_response>`` blocks. Only roles and string contents remain."""
    out: list[dict[str, Any]] = []
    responses = False  # whether out[-1] is a user message made of tool responses
    for m in messages:
        if m["role"] == "tool":
            response = f"<tool_response>\n{m['content']}\n</tool_response>"
            if responses:
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response})
            responses = True
            continue
        responses = False
        calls = m.get("tool_calls") or ()
        blocks = [_call_block(c["function"]["name"], arguments_value(c["function"]["arguments"])) for c in calls]
        plain = {k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")}
        if blocks:
            plain["content"] = "\n".join(([m["content"]] if m["content"] else []) + blocks)
        out.append(plain)
    if not tools:
        return out
    block = TOOLS_HEADER + "".join("\n" + json.dumps(t.as_openai(), ensure_ascii=False) for t in tools) + TOOLS_FOOTER
    if out and out[0]["role"] in ("system", "developer"):
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}"}
    else:
        out.insert(0, {"role": "system", "content": block})
    return out


def check_calls(message: Mapping[str, Any], i: int) -> list[dict[str, Any]] | None:
    """An assistant message's earlier ``tool_calls`` (OpenAI's form: ``id``, ``type``, ``function.name``,
    ``function.arguments`` as a string), checked (errors name ``messages[i].tool_calls[j]...``), or None."""
    calls = message.get("tool_calls")
    if calls is None:
        return None
    where = f"messages[{i}].tool_calls"
    if message.get("role") != "assistant" or not isinstance(calls, list):
        raise InvalidArgument(where, "only an assistant message has tool_calls, a list of calls")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or call.get("type", "function") != "function":
            raise InvalidArgument(f"{where}[{j}]", 'must be {"id", "type": "function", "function": {...}}')
        if not isinstance(call.get("id", ""), str):
            raise InvalidArgument(f"{where}[{j}].id", "must be a string")
        if not isinstance(function.get("name"), str):
            raise InvalidArgument(f"{where}[{j}].function.name", "must be a string")
        if not isinstance(function.get("arguments"), str):
            raise InvalidArgument(f"{where}[{j}].function.arguments", "must be a string (the arguments as JSON)")
        out.append({"id": call.get("id", ""), "type": "function", "function": dict(function)})
    return out
