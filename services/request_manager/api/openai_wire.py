"""OpenAI-compatible request bodies -> the public API's messages: the one place that converts them.

The HTTP front door (:mod:`.http_api`) turns an OpenAI ``/v1/completions`` body (a chat body through
:func:`chat_as_completion`) into one :class:`api_pb2.GenerateRequest` per choice (prompts x ``n``), which
go through the same admission (:func:`.admission.build_live`) and :class:`.state.lifecycle.Requests` as
gRPC calls; it turns the events back into ``text_completion`` objects with :mod:`.openai_objects`. Terms:

- *choice*: one generated sequence of a response (OpenAI's ``choices[i]``); prompt ``p`` with
  ``n`` samples gives choices ``p * n .. p * n + n - 1``.
- *param*: the name of an OpenAI request field, which error objects name (``max_tokens``, not
  the gRPC field ``max_new_tokens``).

Defaults follow OpenAI's: ``max_tokens`` 16, ``temperature`` 1, ``top_p`` 1, ``n`` 1, ``presence_penalty`` and
``frequency_penalty`` 0, no ``logit_bias``. Extra fields, as vLLM takes them: ``top_k``, ``min_p``,
``repetition_penalty`` (1: off),
``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens`` (default true: EOS and the other special tokens are
left out of the text), ``speculation`` (``"auto"``,
``"disabled"``, or ``{"expansion": [widths], "ssms": [names], "adaptive": bool, "suffix": bool, "head": bool}``) and
``verification`` (``"auto"``, ``"coupled"`` or ``"mss"``: the public API's ``SamplingParams.verification``). With
``n > 1`` and a ``seed``, sample ``i`` uses ``seed + i`` (the same seed would draw the same sequence ``n`` times).
``logprobs`` (completions: a count, 0-20; chat: ``logprobs: true`` with ``top_logprobs`` 0-20) reports the output
tokens' log-probabilities under the LLM's raw distribution (``GenerateRequest.logprobs``); not with ``echo``.

Structured outputs (``GenerateRequest.constraint``), on chat and completions alike: OpenAI's ``response_format``
(``{"type": "text"}``, ``{"type": "json_object"}``, or ``{"type": "json_schema", "json_schema": {"name": ...,
"schema": {...}, "strict": ...}}``; the output always follows the schema, whatever ``strict`` says), and two extra
fields: ``regex`` (a regular expression the whole output matches; vLLM's ``guided_regex``) and ``grammar`` (a Lark
or GBNF grammar; vLLM's ``guided_grammar``). At most one of them per request.

Tool calls (chat only): ``tools``, ``tool_choice`` and ``parallel_tool_calls`` are read by :mod:`.tool_calls`; a
required or named call's constraint takes the ``grammar`` field (:func:`chat_as_completion`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from specinfer.core import InvalidArgument
from specinfer.core.requests import MAX_LOGPROBS
from specinfer.v1 import api_pb2

MAX_N = 16  # most choices per prompt
MAX_PROMPTS = 64  # most prompts in one request's list
DEFAULT_MAX_TOKENS = 16

# gRPC admission fields -> the OpenAI params they come from (for error objects)
PARAMS = {
    "prompt": "prompt",
    "prompt.text": "prompt",
    "prompt.token_ids": "prompt",
    "max_new_tokens": "max_tokens",
    "sampling": "temperature",
    "sampling.temperature": "temperature",
    "sampling.top_p": "top_p",
    "sampling.top_k": "top_k",
    "sampling.seed": "seed",
    "sampling.verification": "verification",
    "sampling.presence_penalty": "presence_penalty",
    "sampling.frequency_penalty": "frequency_penalty",
    "sampling.repetition_penalty": "repetition_penalty",
    "sampling.min_p": "min_p",
    "sampling.logit_bias": "logit_bias",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "request_id": "user",
    "json_schema": "response_format",
    "json_object": "response_format",
}


def openai_param(field: str) -> str:
    """The OpenAI param an admission error's field stands for."""
    if field.startswith("speculation"):
        return "speculation"
    return PARAMS.get(field, field)


def _number(body: Mapping[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not lo <= value <= hi
    ):
        raise InvalidArgument(name, f"must be a number in [{lo}, {hi}]")
    return float(value)


def _integer(body: Mapping[str, Any], name: str, default: int | None, lo: int, hi: int) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise InvalidArgument(name, f"must be an integer in [{lo}, {hi}]")
    return value


def _flag(body: Mapping[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidArgument(name, "must be true or false")
    return value


def _token_list(value: Any) -> bool:
    return (
        isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def prompts(body: Mapping[str, Any]) -> list[str | list[int]]:
    """``prompt`` as a list of prompts: a string, a token list, or a list of either."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if _token_list(prompt):
        return [list(prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or _token_list(p) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise InvalidArgument("prompt", f"{len(prompt)} prompts; at most {MAX_PROMPTS}")
        return [p if isinstance(p, str) else list(p) for p in prompt]
    raise InvalidArgument("prompt", "must be a string, a list of token IDs, or a non-empty list of either")


def _stops(body: Mapping[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return list(stop)
    raise InvalidArgument("stop", "must be a string or a list of strings")


def _speculation(body: Mapping[str, Any]) -> api_pb2.SpeculationParams:
    spec = body.get("speculation")
    if spec is None:
        return api_pb2.SpeculationParams()
    if spec == "auto":
        return api_pb2.SpeculationParams(adaptive=True)
    if spec in ("disabled", "none", False):
        return api_pb2.SpeculationParams(disabled=True)
    if isinstance(spec, Mapping) and set(spec) <= {"expansion", "ssms", "adaptive", "suffix", "head"}:
        expansion, ssms, suffix, head = (spec.get(k) for k in ("expansion", "ssms", "suffix", "head"))
        expansion, ssms = expansion or [], ssms or []
        if not (
            isinstance(expansion, list)
            and all(isinstance(w, int) and not isinstance(w, bool) and w > 0 for w in expansion)
        ):
            raise InvalidArgument("speculation", "expansion must be a list of positive widths per depth")
        if not (isinstance(ssms, list) and all(isinstance(s, str) for s in ssms)):
            raise InvalidArgument("speculation", "ssms must be a list of SSM names")
        for name, flag in (("suffix", suffix), ("head", head)):
            if flag is not None and not isinstance(flag, bool):
                raise InvalidArgument("speculation", f"{name} must be true or false")
        return api_pb2.SpeculationParams(
            expansion=expansion, ssms=ssms, adaptive=bool(spec.get("adaptive", False)), suffix=suffix, head=head
        )
    raise InvalidArgument(
        "speculation",
        'must be "auto", "disabled" or '
        '{"expansion": [...], "ssms": [...], "adaptive": bool, "suffix": bool, "head": bool}',
    )


def _constraint(body: Mapping[str, Any]) -> dict[str, Any]:
    """``response_format``, ``regex`` and ``grammar`` as the GenerateRequest's ``constraint`` field (none: {})."""
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, Mapping) and fmt.get("type") in ("text", "json_object", "json_schema")):
        raise InvalidArgument("response_format", 'must be {"type": "text" | "json_object" | "json_schema", ...}')
    out: dict[str, Any] = {}
    if fmt is not None and fmt["type"] == "json_object":
        out["json_object"] = True
    elif fmt is not None and fmt["type"] == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, Mapping) else None
        if not isinstance(schema, Mapping) or not isinstance(spec.get("name", ""), str):
            raise InvalidArgument("response_format", 'json_schema must be {"name": ..., "schema": {...}}')
        out["json_schema"] = json.dumps(schema)
    for name in ("regex", "grammar"):
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, str) or not value:
            raise InvalidArgument(name, "must be a non-empty string")
        if out:
            raise InvalidArgument(name, "only one of response_format (JSON), regex and grammar may constrain an output")
        out[name] = value
    return out


@dataclass(frozen=True)
class CompletionParams:
    """What a ``/v1/completions`` body asks for besides its generate requests."""

    prompts: tuple[str | tuple[int, ...], ...]
    n: int
    stream: bool
    include_usage: bool
    echo: bool
    model: str | None
    logprobs: int | None = None  # alternatives reported at each token (None: no logprobs)


def completion_params(body: Mapping[str, Any]) -> CompletionParams:
    stream = _flag(body, "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, Mapping):
        raise InvalidArgument("stream_options", "must be an object")
    if options and not stream:
        raise InvalidArgument("stream_options", "only allowed with stream: true")
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise InvalidArgument("stream_options", "include_usage must be true or false")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidArgument("model", "must be a string")
    n = _integer(body, "n", 1, 1, MAX_N)
    assert n is not None
    logprobs = _integer(body, "logprobs", None, 0, MAX_LOGPROBS)
    echo = _flag(body, "echo")
    if echo and logprobs is not None:
        # the prompt's logprobs would need the LLM's logits at every prompt position, which its prefill keeps none of
        raise InvalidArgument("logprobs", "is not supported with echo (the prompt's logprobs are not computed)")
    return CompletionParams(
        tuple(p if isinstance(p, str) else tuple(p) for p in prompts(body)),
        n,
        stream,
        include_usage,
        echo,
        model,
        logprobs,
    )


def generate_requests(
    body: Mapping[str, Any], params: CompletionParams, id_prefix: str
) -> list[api_pb2.GenerateRequest]:
    """One GenerateRequest per choice (see the module doc); types and ranges checked here, the
    rest (vocabulary, lengths, stop limits, SSM names) by admission, as for gRPC."""
    if body.get("best_of") not in (None, 1) or body.get("suffix") is not None:
        unsupported = next(k for k in ("best_of", "suffix") if body.get(k) not in (None, 1))
        raise InvalidArgument(unsupported, "is not supported by this server")
    presence = _number(body, "presence_penalty", 0.0, -2.0, 2.0)
    frequency = _number(body, "frequency_penalty", 0.0, -2.0, 2.0)
    repetition = _number(body, "repetition_penalty", 1.0, 0.0, math.inf)
    if repetition == 0.0:
        raise InvalidArgument("repetition_penalty", "must be > 0")
    min_p = _number(body, "min_p", 0.0, 0.0, 1.0)
    logit_bias = _logit_bias(body)
    max_tokens = _integer(body, "max_tokens", DEFAULT_MAX_TOKENS, 1, 1 << 30)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise InvalidArgument("top_p", "must be > 0")
    top_k = _integer(body, "top_k", 0, -1, 1 << 20)
    seed = _integer(body, "seed", None, 0, (1 << 63) - 1)
    verification = body.get("verification") or ""
    if not isinstance(verification, str):
        raise InvalidArgument("verification", 'must be "auto", "coupled" or "mss"')
    stop_token_ids = body.get("stop_token_ids") or []
    if not (
        isinstance(stop_token_ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in stop_token_ids)
    ):
        raise InvalidArgument("stop_token_ids", "must be a list of token IDs")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise InvalidArgument("user", "must be a string")
    stops, speculation, ignore_eos = _stops(body), _speculation(body), _flag(body, "ignore_eos")
    skip_special_tokens = _flag(body, "skip_special_tokens", True)
    constraint = _constraint(body)
    out = []
    for p, prompt in enumerate(params.prompts):
        for i in range(params.n):
            msg = api_pb2.GenerateRequest(
                request_id=f"{id_prefix}-{p * params.n + i}",
                max_new_tokens=max_tokens,
                sampling=api_pb2.SamplingParams(
                    temperature=temperature,
                    top_p=top_p,
                    top_k=max(0, top_k or 0),
                    verification=verification,
                    presence_penalty=presence,
                    frequency_penalty=frequency,
                    repetition_penalty=repetition,
                    min_p=min_p,
                    logit_bias=logit_bias,
                ),
                stop=stops,
                stop_token_ids=stop_token_ids,
                speculation=speculation,
                ignore_eos=ignore_eos,
                skip_special_tokens=skip_special_tokens,
                **constraint,
            )
            if seed is not None:
                msg.sampling.seed = seed + i
            if params.logprobs is not None:
                msg.logprobs = params.logprobs
            if isinstance(prompt, str):
                msg.text = prompt
            else:
                msg.token_ids.ids.extend(prompt)
            out.append(msg)
    return out


def _logit_bias(body: Mapping[str, Any]) -> dict[int, float]:
    """OpenAI's ``logit_bias``: token IDs (as JSON object keys, strings) to biases in [-100, 100]."""
    value = body.get("logit_bias")
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidArgument("logit_bias", "must be an object of token IDs to biases")
    out = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except ValueError:
            raise InvalidArgument("logit_bias", f"keys must be token IDs, got {key!r}") from None
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not (-100 <= bias <= 100):
            raise InvalidArgument("logit_bias", f"the bias of token {key} must be a number in [-100, 100]")
        out[token] = float(bias)
    return out


def chat_as_completion(body: Mapping[str, Any], prompt: Sequence[int], grammar: str | None = None) -> dict[str, Any]:
    """A chat body as the completions body it stands for, the rendered and tokenized ``prompt`` in
    place of ``messages`` (``max_completion_tokens`` is the newer name of ``max_tokens``); ``grammar``: the
    constraint of a required or named tool call (:mod:`.tool_calls`), which takes the ``grammar`` field."""
    if body.get("echo"):
        raise InvalidArgument("echo", "is not a chat completions field")
    dropped = (
        "messages",
        "max_completion_tokens",
        "add_generation_prompt",
        "logprobs",
        "top_logprobs",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
    )
    out = {k: v for k, v in body.items() if k not in dropped}
    if grammar is not None:
        out["grammar"] = grammar
    if body.get("max_completion_tokens") is not None:
        out["max_tokens"] = body["max_completion_tokens"]
    # chat's logprobs (a flag) and top_logprobs (a count) as the completions' logprobs count
    top = _integer(body, "top_logprobs", None, 0, MAX_LOGPROBS)
    if _flag(body, "logprobs"):
        out["logprobs"] = top or 0
    elif top is not None:
        raise InvalidArgument("top_logprobs", "needs logprobs: true")
    out["prompt"] = list(prompt)
    return out
