"""The mapping between a :class:`Live` request and its Redis record (:mod:`specinfer.request_manager.state.records`).

``live_params`` writes what a record keeps besides the prompt, ``live_from_snapshot`` reads an unfinished
record back into a request to resume, ``snapshot_finish`` reads a record's final state, ``snapshot_text`` its text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer

from specinfer.core import ExpansionConfig, SamplingParams
from specinfer.core.constraints import Constraint
from specinfer.core.requests import GenerationRequest, SpeculationConfig
from specinfer.request_manager.api.admission import ApiLimits, check_kv_fit
from specinfer.request_manager.api.text import TextStream, output_text
from specinfer.request_manager.scheduling.live import Finish, Live, Usage
from specinfer.request_manager.state.records import RequestRecord, RequestSnapshot


def live_params(live: Live, ssm_names: tuple[str, ...]) -> dict[str, Any]:
    """Everything but the prompt, as JSON for the store (enough to resume the request)."""
    req = live.request
    spec = req.speculation
    widths = None if spec is None or spec.adaptive else list(spec.expansion.widths)  # None: adaptive speculation
    return {
        "sampling": {
            "temperature": req.sampling.temperature,
            "top_p": req.sampling.top_p,
            "top_k": req.sampling.top_k,
            "seed": req.sampling.seed,
            "verification": req.sampling.verification,
            "presence_penalty": req.sampling.presence_penalty,
            "frequency_penalty": req.sampling.frequency_penalty,
            "repetition_penalty": req.sampling.repetition_penalty,
            "min_p": req.sampling.min_p,
            "logit_bias": [list(pair) for pair in req.sampling.logit_bias],
        },
        "seed": live.seed,
        "max_new_tokens": req.max_new_tokens,
        "stop_token_ids": list(req.stop_token_ids),
        "stop": list(live.stop_strings),
        "ignore_eos": req.ignore_eos,
        "skip_special_tokens": live.text.skip_special_tokens if live.text is not None else True,
        "logprobs": req.logprobs,
        "constraint": None if req.constraint is None else {"kind": req.constraint.kind, "text": req.constraint.text},
        "speculation": None
        if spec is None
        else {
            "expansion": widths,
            "ssms": [ssm_names[i] for i in spec.ssms],
            "suffix": spec.suffix,
            "head": spec.head,
        },
    }


def live_record(live: Live, ssm_names: tuple[str, ...], owner: str, lease_token: str = "") -> RequestRecord:
    """The record a new request is stored as, owned by replica ``owner`` (its incarnation ``lease_token``)."""
    return RequestRecord(live.request_id, live.request.prompt_tokens, live_params(live, ssm_names), owner, lease_token)


def live_from_snapshot(snapshot: RequestSnapshot, limits: ApiLimits, tokenizer: Tokenizer | None) -> Live:
    """The inverse of :func:`live_params`: an unfinished request found in Redis, ready to resume
    where its committed tokens end. SSMs the workers no longer serve are dropped from its tree."""
    params = snapshot.params
    spec = None
    if params.get("speculation"):
        names = [n for n in params["speculation"]["ssms"] if n in limits.ssm_names]
        # records written before draft heads: on, the default
        head = bool(params["speculation"].get("head", True))
        if names or (params["speculation"]["expansion"] is None and head and limits.draft_head):
            widths = params["speculation"]["expansion"]
            expansion = None if widths is None else ExpansionConfig(tuple(widths))
            suffix = bool(
                params["speculation"].get("suffix", True)
            )  # records written before suffix drafts: on, the default
            spec = SpeculationConfig(
                expansion, tuple(limits.ssm_names.index(n) for n in names), limits.draft_support, suffix, head
            )
    request = GenerationRequest(
        request_id=snapshot.request_id,
        prompt_tokens=tuple(snapshot.prompt_tokens),
        max_new_tokens=int(params["max_new_tokens"]),
        sampling=SamplingParams(
            **{**params["sampling"], "logit_bias": tuple(map(tuple, params["sampling"].get("logit_bias", ())))}
        ),
        speculation=spec,
        stop_token_ids=tuple(params["stop_token_ids"]),
        ignore_eos=bool(params["ignore_eos"]),
        logprobs=params.get("logprobs"),  # records written before logprobs: none
        constraint=Constraint(**params["constraint"]) if params.get("constraint") else None,
    )
    check_kv_fit(request, limits)  # the KV caches may be smaller than before the restart
    stop = tuple(params["stop"])
    text = snapshot_text_stream(snapshot, tokenizer) if tokenizer is not None else None
    live = Live(request, int(params["seed"]), stop, text)
    live.output = list(snapshot.output_tokens)
    live.logprobs = list(snapshot.output_logprobs)
    if text is not None:
        text.update(live.output)  # already streamed before the restart
    live.stats = snapshot.stats
    return live


def skip_special_tokens(params: dict[str, Any]) -> bool:
    """The record's special-token rule (:mod:`.api.text`); records written before it was kept skip them, the default."""
    return bool(params.get("skip_special_tokens", True))


def snapshot_text_stream(snapshot: RequestSnapshot, tokenizer: Tokenizer) -> TextStream:
    """A text stream with a stored request's rules (stop strings, special tokens) that has released nothing."""
    return TextStream(tokenizer, tuple(snapshot.params.get("stop", ())), skip_special_tokens(snapshot.params))


def resumed_text(text: TextStream | None, output: Sequence[int], offset: int, finish: Finish | None) -> str:
    """The text of ``output[offset:]`` as the request's stream releases it after its first ``offset`` tokens;
    ``text``: a stream of its rules that has released nothing (left at the end of ``output``; None: no text)."""
    if text is None:
        return ""
    text.update(output[:offset])
    delta = text.update(output)[0]
    return delta + (text.flush(output) if finish is not None and finish.reason != "stop" else "")


def snapshot_text(snapshot: RequestSnapshot, tokenizer: Tokenizer) -> str:
    """A stored request's text as its stream releases it: special tokens left out as it asked, cut before a stop
    string."""
    params = snapshot.params
    return output_text(
        tokenizer, snapshot.output_tokens, params.get("stop", ()), skip_special_tokens(params), snapshot.is_finished
    )


def snapshot_finish(snapshot: RequestSnapshot) -> Finish | None:
    """The final state of a stored request, or None while it runs."""
    if snapshot.finish_reason is None:
        return None
    usage = Usage.of(len(snapshot.prompt_tokens), len(snapshot.output_tokens), snapshot.stats)
    return Finish(snapshot.finish_reason.value, usage, snapshot.error or "")
