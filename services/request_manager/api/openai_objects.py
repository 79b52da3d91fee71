"""OpenAI-compatible response bodies built from a request's choices: ``text_completion`` and
``chat.completion`` objects, their stream chunks, ``usage`` and ``speculation`` statistics, the model
list and error bodies (the request side is :mod:`.openai_wire`; its module doc defines *choice*)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

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


def _envelope(response_id: str, model: str, created: int) -> dict[str, Any]:
    return {"id": response_id, "object": "text_completion", "created": created, "model": model}


def completion_object(
    response_id: str, model: str, created: int, choices: Sequence[Choice], prompt_tokens: Sequence[int]
) -> dict[str, Any]:
    return {
        **_envelope(response_id, model, created),
        "choices": [
            {"index": c.index, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason} for c in choices
        ],
        "usage": usage_object(choices, prompt_tokens),
        "speculation": speculation_object(choices),
    }


def completion_chunk(
    response_id: str, model: str, created: int, index: int, text: str, finish_reason: str | None
) -> dict[str, Any]:
    return {
        **_envelope(response_id, model, created),
        "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}],
    }


def usage_chunk(
    response_id: str, model: str, created: int, choices: Sequence[Choice], prompt_tokens: Sequence[int]
) -> dict[str, Any]:
    """The last chunk of a stream with ``stream_options.include_usage``: no choices, the usage."""
    return {**completion_object(response_id, model, created, choices, prompt_tokens), "choices": []}


def chat_object(
    response_id: str, model: str, created: int, choices: Sequence[Choice], prompt_tokens: Sequence[int]
) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": None,
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ],
        "usage": usage_object(choices, prompt_tokens),
        "speculation": speculation_object(choices),
    }


def chat_chunk(
    response_id: str, model: str, created: int, index: int, delta: dict[str, str], finish_reason: str | None
) -> dict[str, Any]:
    """A ``chat.completion.chunk``: ``delta`` is ``{"role": "assistant"}`` first, then ``{"content": ...}``."""
    return {
        "id": response_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }


def chat_usage_chunk(
    response_id: str, model: str, created: int, choices: Sequence[Choice], prompt_tokens: Sequence[int]
) -> dict[str, Any]:
    return {
        **chat_object(response_id, model, created, choices, prompt_tokens),
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
