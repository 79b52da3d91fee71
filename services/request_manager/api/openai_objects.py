"""OpenAI-compatible response bodies built from a request's choices: ``text_completion`` and
``chat.completion`` objects, their stream chunks, ``usage`` and ``speculation`` statistics, the model
list and error bodies (the request side is :mod:`.openai_wire`; its module doc defines *choice*)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from specinfer.core.requests import TokenLogprob
from specinfer.request_manager.api import tool_call_parser as tp
from specinfer.request_manager.api import tool_calls as tc
from specinfer.v1 import api_pb2

# finish reasons of the core -> OpenAI's (a cancelled request ends as vLLM's "abort")
FINISH_REASONS = {"length": "length", "eos": "stop", "stop": "stop", "cancelled": "abort", "error": "error"}


@dataclass
class Choice:
    """One choice as it builds up from its events."""

    index: int
    prompt_tokens: int = 0
    text: str = ""
    token_ids: int = 0
    finish_reason: str | None = None
    usage: api_pb2.Usage | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # the tokens', when the request asked
    error: str = ""  # why generation failed, where it finished with reason "error"


LOGPROB_FLOOR = -9999.0  # what a logprob of -inf is reported as (JSON has no infinity; vLLM's floor too)


@dataclass(frozen=True)
class Logprobs:
    """How a response spells its tokens' logprobs (None: the request asked none): each token as its text
    (``token_text``: the tokenizer's decoding of that token alone, or ``token_id:N`` without a tokenizer)."""

    token_text: Callable[[int], str]

    def completion(self, logprobs: Sequence[TokenLogprob], start: int) -> dict[str, Any]:
        """A ``text_completion`` choice's ``logprobs``: ``tokens``, ``token_logprobs``, ``top_logprobs`` (the
        alternatives and the chosen token, by text) and ``text_offset`` (each token's, from ``start``, the length
        of the choice's text before these tokens)."""
        tokens = [self.token_text(lp.token) for lp in logprobs]
        return {
            "tokens": tokens,
            "token_logprobs": [_finite(lp.logprob) for lp in logprobs],
            "top_logprobs": [
                {self.token_text(t): _finite(v) for t, v in (*lp.top, (lp.token, lp.logprob))} for lp in logprobs
            ],
            "text_offset": list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=start)) if tokens else [],
        }

    def chat(self, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
        """A ``chat.completion`` choice's ``logprobs``: ``content``, one entry per token with its text, logprob,
        UTF-8 bytes and ``top_logprobs``."""

        def entry(token: int, logprob: float) -> dict[str, Any]:
            text = self.token_text(token)
            return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}

        return {
            "content": [
                {**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in logprobs
            ]
        }


def _finite(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def usage_object(choices: Sequence[Choice], prompt_tokens: Sequence[int]) -> dict[str, Any]:
    """``usage`` of a response (prompts counted once per prompt, not per sample; choice i samples
    prompt ``i // n``). ``prompt_tokens_details.cached_tokens``: per prompt, the most prompt tokens
    one of its samples took from the LLM's prefix cache (``Usage.cached_prompt_tokens``)."""
    completion = sum(c.token_ids for c in choices)
    prompt = sum(prompt_tokens)
    n = max(1, len(choices) // max(1, len(prompt_tokens)))
    cached = [0] * len(prompt_tokens)
    for c in choices:
        if c.usage is not None and c.index // n < len(cached):
            cached[c.index // n] = max(cached[c.index // n], c.usage.cached_prompt_tokens)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(cached)},
    }


def speculation_object(choices: Sequence[Choice]) -> dict[str, Any]:
    """Speculation statistics of a response, summed over its choices: LLM verify steps, tree tokens
    drafted (tree nodes beyond each step's root) and accepted, and the means per step, named after
    vLLM's speculative-decoding counters (``num_drafts``, ``num_draft_tokens``, ``num_accepted_tokens``)."""
    steps = drafted = accepted = 0
    for c in choices:
        if c.usage is None:
            continue
        steps += c.usage.llm_steps
        drafted += round((c.usage.mean_tree_size - 1.0) * c.usage.llm_steps)
        accepted += round(c.usage.mean_accepted_tokens * c.usage.llm_steps)
    completion = sum(c.token_ids for c in choices)
    return {
        "num_drafts": steps,
        "num_draft_tokens": drafted,
        "num_accepted_tokens": accepted,
        "mean_accepted_length": round(completion / steps, 4) if steps else 0.0,
        "mean_tree_size": round(1.0 + drafted / steps, 4) if steps else 0.0,
    }


@dataclass(frozen=True)
class Envelope:
    """What every object of one response carries: its ``id``, the ``model`` and when it was ``created``."""

    response_id: str
    model: str
    created: int

    def of(self, kind: str) -> dict[str, Any]:
        """The object's envelope fields, for its ``kind`` (``text_completion``, ``chat.completion`` ...)."""
        return {"id": self.response_id, "object": kind, "created": self.created, "model": self.model}


def completion_object(
    env: Envelope,
    choices: Sequence[Choice],
    prompt_tokens: Sequence[int],
    logprobs: Logprobs | None = None,
) -> dict[str, Any]:
    return {
        **env.of("text_completion"),
        "choices": [
            {
                "index": c.index,
                "text": c.text,
                "logprobs": logprobs.completion(c.logprobs, 0) if logprobs is not None else None,  # no echo with them
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ],
        "usage": usage_object(choices, prompt_tokens),
        "speculation": speculation_object(choices),
    }


def completion_chunk(
    env: Envelope,
    index: int,
    text: str,
    finish_reason: str | None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        **env.of("text_completion"),
        "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}],
    }


def usage_chunk(env: Envelope, choices: Sequence[Choice], prompt_tokens: Sequence[int]) -> dict[str, Any]:
    """The last chunk of a stream with ``stream_options.include_usage``: no choices, the usage."""
    return {**completion_object(env, choices, prompt_tokens), "choices": []}


def chat_object(
    env: Envelope,
    choices: Sequence[Choice],
    prompt_tokens: Sequence[int],
    logprobs: Logprobs | None = None,
    tools: tc.ToolRequest | None = None,
) -> dict[str, Any]:
    """A ``chat.completion``; with ``tools`` (the request's), each choice's text parsed into its message's
    ``tool_calls`` (:mod:`.tool_calls`)."""
    out = []
    for c in choices:
        parser = tools.parser() if tools is not None else None
        message = tp.parse(c.text, parser) if parser is not None else tp.Message(c.text, ())
        body: dict[str, Any] = {"role": "assistant", "content": message.content}
        if message.calls:
            body["tool_calls"] = [_call_object(call) for call in message.calls]
        out.append(
            {
                "index": c.index,
                "message": body,
                "logprobs": logprobs.chat(c.logprobs) if logprobs is not None else None,
                "finish_reason": chat_finish_reason(c.finish_reason, len(message.calls)),
            }
        )
    return {
        **env.of("chat.completion"),
        "choices": out,
        "usage": usage_object(choices, prompt_tokens),
        "speculation": speculation_object(choices),
    }


def chat_finish_reason(reason: str | None, calls: int) -> str | None:
    """OpenAI's ``tool_calls`` for an output that made calls and ended as it meant to (not cut by ``length``)."""
    return "tool_calls" if calls and reason == "stop" else reason


def _call_object(call: tp.ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def chat_deltas(pieces: Sequence[tp.Piece]) -> list[dict[str, Any]]:
    """The ``delta`` objects of a chat stream for what :class:`.tool_call_parser.CallParser` gave: content text
    (adjacent pieces in one delta), and ``tool_calls`` deltas: a call's first with its ``index``, ``id``, ``type`` and
    ``function.name`` (arguments ``""``), then ``function.arguments`` pieces, as OpenAI streams them."""
    out: list[dict[str, Any]] = []
    for p in pieces:
        if isinstance(p, str):
            if out and "content" in out[-1]:
                out[-1]["content"] += p
            elif p:
                out.append({"content": p})
        elif p.id is not None:
            function = {"name": p.name, "arguments": p.arguments}
            out.append({"tool_calls": [{"index": p.index, "id": p.id, "type": "function", "function": function}]})
        elif p.arguments:
            out.append({"tool_calls": [{"index": p.index, "function": {"arguments": p.arguments}}]})
    return out


def chat_event_chunks(
    env: Envelope,
    index: int,
    pieces: Sequence[tp.Piece],
    finish_reason: str | None,
    calls: int,
    logprobs: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """The chunks of one event of choice ``index`` in a chat stream: a chunk per delta of ``pieces`` (the event's
    text, or what the call parser made of it), the first with the event's ``logprobs`` (alone in an empty content
    delta while the parser holds the text back), then, at the end, an empty delta with the finish reason
    (``tool_calls`` when the output made ``calls``)."""
    deltas = chat_deltas(pieces)
    if not deltas and logprobs is not None and logprobs["content"]:
        deltas = [{"content": ""}]
    out = [chat_chunk(env, index, d, None, logprobs if n == 0 else None) for n, d in enumerate(deltas)]
    if finish_reason is not None:
        out.append(chat_chunk(env, index, {}, chat_finish_reason(finish_reason, calls)))
    return out


def chat_chunk(
    env: Envelope,
    index: int,
    delta: dict[str, Any],
    finish_reason: str | None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A ``chat.completion.chunk``: ``delta`` is ``{"role": "assistant"}`` first, then ``{"content": ...}`` or
    ``{"tool_calls": [...]}`` (:func:`chat_deltas`)."""
    return {
        **env.of("chat.completion.chunk"),
        "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
    }


def chat_usage_chunk(env: Envelope, choices: Sequence[Choice], prompt_tokens: Sequence[int]) -> dict[str, Any]:
    return {
        **chat_object(env, choices, prompt_tokens),
        "object": "chat.completion.chunk",
        "choices": [],
    }


def models_object(model: str, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "specinfer"}]}


def error_object(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """An OpenAI error body (``kind``: ``invalid_request_error``, ``authentication_error`` ...)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def now() -> int:
    return int(time.time())
