"""Tool calls read back from an output (:mod:`.tool_calls` defines the *call format* and when outputs are parsed): an
incremental parser that picks the calls out of the text as it streams, in the pieces OpenAI streams them in, and the
assistant message a whole output adds up to (the same whether it came in one piece or many)."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# a call's head as models write it, up to the opening brace of its arguments (which then stream as they come)
HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"arguments"\s*:\s*(?=\{)')


def arguments_value(text: str) -> Any:
    """A call's ``arguments`` string as the object it spells (as transformers' templates expect), or the string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


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
        arguments = arguments_value(arguments)
    if not isinstance(arguments, dict):
        return None
    return call["name"], json.dumps(arguments, ensure_ascii=False)


class CallParser:
    """One output's calls in the call format (:mod:`.tool_calls`), picked out as its text comes (:meth:`feed`, then
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
