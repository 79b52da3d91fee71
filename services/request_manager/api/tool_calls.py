"""Tool calls on the OpenAI chat API: the request's ``tools`` and ``tool_choice`` checked, the tools offered to the chat
template (or, for a template that knows no tools, written into the messages), the grammar that makes a call certain,
and the model's output parsed back into ``tool_calls``, streamed or not. Pure functions and one incremental parser; the
HTTP handler calls them (:mod:`.http_api`).

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
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from specinfer.core import InvalidArgument
from specinfer.core.constraints import Constraint, Grammars

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
CHOICES = ("none", "auto", "required")
# a call's head as models write it, up to the opening brace of its arguments (which then stream as they come)
HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"arguments"\s*:\s*(?=\{)')
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


def _arguments(text: str) -> Any:
    """A call's ``arguments`` string as the object it spells (as transformers' templates expect), or the string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` as a tool-aware template takes them: earlier calls' ``arguments`` as objects (vLLM does this too;
    Qwen's and Llama 3.1's templates write them with ``tojson``)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            calls = [
                {**c, "function": {**c["function"], "arguments": _arguments(c["function"]["arguments"])}} for c in calls
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
        blocks = [_call_block(c["function"]["name"], _arguments(c["function"]["arguments"])) for c in calls]
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


# -- the output --------------------------------------------------------------------------------------------------


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class CallDelta:
    """A piece of a call as it streams: the first one of call ``index`` carries its ``id`` and ``name`` (and no
    arguments), the later ones pieces of its ``arguments`` (which concatenate to the arguments' JSON)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


Piece = str | CallDelta  # what the parser gives: content text, or a piece of a call


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON


@dataclass(frozen=True)
class Message:
    """An output as an assistant message: its ``content`` (None when it is only calls) and ``calls``."""

    content: str | None
    calls: tuple[ToolCall, ...]


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (text that may yet become the tag)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _whole_call(block: str, names: frozenset[str]) -> tuple[str, str] | None:
    """A call block's name and arguments (JSON) when it is a call to one of ``names``, however its keys are ordered."""
    try:
        call = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or call.get("name") not in names:
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        arguments = _arguments(arguments)
    if not isinstance(arguments, dict):
        return None
    return call["name"], json.dumps(arguments, ensure_ascii=False)


class CallParser:
    """One output's calls in the call format (module doc), picked out as its text comes (:meth:`feed`, then
    :meth:`finish`): content text streams through, except whitespace next to a call and text that may be the start of
    ``<tool_call>``, which wait until it is clear; a call streams as soon as its head (``{"name": "...",
    "arguments": {``) names one of ``names``, its arguments as they come, up to the brace that closes them. A block
    written otherwise (keys in another order, arguments as a string) is parsed whole at ``</tool_call>``; one that is
    no call to these tools stays content, tags and all. After ``max_calls`` calls (None: no limit) further blocks are
    dropped. A call cut short by the end of the output keeps the arguments it got."""

    def __init__(self, names: frozenset[str], max_calls: int | None, new_id: Callable[[], str]) -> None:
        self.names = names
        self.max_calls = max_calls
        self.new_id = new_id
        self.calls = 0  # calls begun so far
        self._text = ""  # text received and not yet given out or settled
        self._block = False  # inside a <tool_call> block
        self._streaming = False  # inside a call's arguments
        self._depth = 0  # of the arguments' JSON brackets so far
        self._in_string = self._escape = False  # inside a string of the arguments (after a backslash)
        self._done = False  # the block's call is complete (or over the limit): the rest of the block is skipped
        self._after_call = False  # whitespace that follows is no content
        self._gap = ""  # the whitespace before the current block

    def feed(self, text: str) -> list[Piece]:
        self._text += text
        return self._drain(final=False)

    def finish(self) -> list[Piece]:
        return self._drain(final=True)

    def _content(self, text: str, out: list[Piece]) -> None:
        if self._after_call:
            text = text.lstrip()
        if text:
            out.append(text)
            self._after_call = False

    def _close(self, rest: str, call: bool) -> None:
        self._text, self._block = rest, False
        self._after_call = self._after_call or call

    def _drain(self, final: bool) -> list[Piece]:
        out: list[Piece] = []
        while self._text:
            if not self._block:
                k = self._text.find(OPEN)
                if k >= 0:  # whitespace before a call is no content (unless the block turns out to be none)
                    before = self._text[:k].rstrip()
                    self._content(before, out)
                    self._gap = self._text[len(before) : k]
                    self._text, self._block, self._streaming = self._text[k + len(OPEN) :], True, False
                    self._done = self.max_calls is not None and self.calls >= self.max_calls
                    continue
                cut = len(self._text)
                if not final:  # text that may begin the tag, and whitespace (a call may follow it), wait
                    cut = len(self._text[: cut - _partial_suffix(self._text, OPEN)].rstrip())
                self._content(self._text[:cut], out)
                self._text = self._text[cut:]
                break
            if self._streaming:
                self._scan_arguments(out)
                if self._streaming:
                    break
            elif self._done:
                k = self._text.find(CLOSE)
                if k < 0:
                    self._text = self._text[len(self._text) - _partial_suffix(self._text, CLOSE) :]
                    break
                self._close(self._text[k + len(CLOSE) :], True)
            else:
                head = HEAD.match(self._text)
                if head and head.group(1) in self.names:
                    out.append(CallDelta(self.calls, self.new_id(), head.group(1)))
                    self.calls += 1
                    self._text, self._streaming = self._text[head.end() :], True
                    self._depth, self._in_string, self._escape = 0, False, False
                    continue
                k = self._text.find(CLOSE)
                if k < 0:
                    if final:  # an unfinished block that began no call is content
                        self._content(self._gap + OPEN + self._text, out)
                    break
                call = _whole_call(self._text[:k], self.names)
                if call is None:
                    self._content(self._gap + OPEN + self._text[: k + len(CLOSE)], out)
                else:
                    name, arguments = call
                    out += [CallDelta(self.calls, self.new_id(), name), CallDelta(self.calls, arguments=arguments)]
                    self.calls += 1
                self._close(self._text[k + len(CLOSE) :], call is not None)
        if final:
            self._text = ""
        return out

    def _scan_arguments(self, out: list[Piece]) -> None:
        """Give out the arguments' JSON received so far, up to the bracket that closes it (then the call is done)."""
        end = len(self._text)
        for pos, ch in enumerate(self._text):
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    end = pos + 1
                    self._streaming, self._done = False, True
                    break
        if end:
            out.append(CallDelta(self.calls - 1, arguments=self._text[:end]))
        self._text = self._text[end:]


def message(pieces: Sequence[Piece]) -> Message:
    """The assistant message that ``pieces`` (a whole output's, in order) add up to."""
    content = "".join(p for p in pieces if isinstance(p, str))
    calls: dict[int, list[str]] = {}
    for p in pieces:
        if isinstance(p, CallDelta):
            calls.setdefault(p.index, [p.id or "", p.name or "", ""])
            calls[p.index][2] += p.arguments
    return Message(content if content or not calls else None, tuple(ToolCall(*c) for _, c in sorted(calls.items())))


def parse(text: str, parser: CallParser) -> Message:
    """A whole output as an assistant message (what its stream adds up to)."""
    return message(parser.feed(text) + parser.finish())
