"""Chat templates: a checkpoint's Jinja template renders ``messages`` into the prompt text, with the
semantics of transformers' ``apply_chat_template`` but without importing transformers or torch (the
request manager is torch-free).

Where the template comes from: ``chat_template.jinja`` beside the tokenizer, else
``tokenizer_config.json``'s ``chat_template`` (a string, or a list of ``{"name", "template"}`` from
which ``default`` is taken). The environment is transformers': a sandbox with ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter that does not escape HTML,
and the globals ``raise_exception`` and ``strftime_now``; the template sees ``messages``,
``add_generation_prompt`` and the tokenizer's special tokens (``bos_token``, ``eos_token`` ...).
The rendered text is tokenized without adding special tokens (the template writes them), as
``apply_chat_template(tokenize=True)`` does. A template that uses ``tools`` gets a request's tools and its
messages' tool calls as transformers passes them; any other gets them written into the messages
(:mod:`.tool_calls`, "fallback").
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from specinfer.core import InvalidArgument
from specinfer.request_manager.api.tool_calls import Tool, check_calls, inline_tools, template_messages

ROLES = ("system", "developer", "user", "assistant", "tool")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    """``bos_token``, ``eos_token`` ... of a tokenizer_config.json (plain strings or serialized AddedTokens)."""
    out = {}
    for key, value in config.items():
        if not key.endswith("_token"):
            continue
        if isinstance(value, Mapping) and isinstance(value.get("content"), str):
            value = value["content"]
        if isinstance(value, str):
            out[key] = value
    return out


class ChatTemplate:
    """A compiled chat template and the special tokens it may use."""

    def __init__(self, source: str, special_tokens: Mapping[str, str]) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self.template = env.from_string(source)
        self.special_tokens = dict(special_tokens)
        self.knows_tools = "tools" in jinja2.meta.find_undeclared_variables(env.parse(source))

    @staticmethod
    def load(model_dir: str | Path) -> ChatTemplate | None:
        """The checkpoint's template, or None when it has none."""
        folder = Path(model_dir)
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        jinja_file = folder / "chat_template.jinja"
        source = jinja_file.read_text() if jinja_file.is_file() else config.get("chat_template")
        if isinstance(source, list):  # named templates: the default one
            source = next(
                (t.get("template") for t in source if isinstance(t, Mapping) and t.get("name") == "default"), None
            )
        if not isinstance(source, str) or not source:
            return None
        return ChatTemplate(source, _special_tokens(config))

    def render(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, tools: Sequence[Tool] = ()
    ) -> str:
        """The prompt text of ``messages`` offering ``tools``; InvalidArgument("messages") when the template refuses
        them (its ``raise_exception``) or fails on them."""
        if self.knows_tools:
            messages, offered = template_messages(messages), [t.as_openai() for t in tools] or None
        else:
            messages, offered = inline_tools(messages, tools), None
        try:
            return self.template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                tools=offered,
                documents=None,
                **self.special_tokens,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise InvalidArgument("messages", f"the chat template refused them: {exc}") from None


def check_messages(value: Any) -> list[dict[str, Any]]:
    """``messages`` as plain dicts (role, content as a string); a content given as a list of parts
    keeps its text parts, joined by newlines (as vLLM does for templates that expect strings). An assistant
    message may carry earlier ``tool_calls`` (its content then may be null), a ``tool`` message answers one
    (its ``tool_call_id``)."""
    if not isinstance(value, list) or not value:
        raise InvalidArgument("messages", "must be a non-empty list of {role, content} objects")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, Mapping) or message.get("role") not in ROLES:
            raise InvalidArgument("messages", f"messages[{i}] needs a role, one of {', '.join(ROLES)}")
        content = message.get("content")
        if isinstance(content, list):
            if not all(
                isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                raise InvalidArgument("messages", f"messages[{i}].content: only text parts are supported")
            content = "\n".join(p["text"] for p in content)
        if content is None and message.get("role") == "assistant":
            content = ""
        if not isinstance(content, str):
            raise InvalidArgument("messages", f"messages[{i}].content must be a string or a list of text parts")
        if message.get("role") == "tool" and not isinstance(message.get("tool_call_id"), str):
            raise InvalidArgument(f"messages[{i}].tool_call_id", "a tool message needs the ID of the call it answers")
        plain = {**{k: v for k, v in message.items() if isinstance(k, str)}, "content": content}
        calls = check_calls(message, i)
        if calls is not None:
            plain["tool_calls"] = calls
        out.append(plain)
    return out
