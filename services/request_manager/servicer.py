"""The public ``specinfer.v1.SpecInfer`` servicer: translates messages, nothing else.

Validation errors become INVALID_ARGUMENT naming the field, a full queue RESOURCE_EXHAUSTED,
a running request ID reused ALREADY_EXISTS, an unknown one NOT_FOUND.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from dataclasses import dataclass

import grpc
from tokenizers import Tokenizer

from specinfer import wire
from specinfer.core import ExpansionConfig, InvalidArgument, SamplingParams
from specinfer.core.requests import GenerationRequest, SpeculationConfig
from specinfer.request_manager.records import RequestRecord, RequestSnapshot, validate_id
from specinfer.request_manager.scheduler import Finish, Live, QueueFull, Scheduler, StreamEvent, Usage
from specinfer.request_manager.store import RequestExistsError, RequestStore
from specinfer.request_manager.text import TextStream
from specinfer.v1 import api_pb2, api_pb2_grpc

log = logging.getLogger("specinfer.request_manager")

# Bounds of the fields not tied to a setting: enough for any real use, small enough that a
# hostile message cannot make validation, Redis records or stop-string matching expensive.
MAX_REQUEST_ID_CHARS = 128
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
CHARS_PER_PROMPT_TOKEN = 32  # a text prompt longer than max_prompt_tokens * this is refused before tokenizing

FINISH_REASONS = {
    "length": api_pb2.FINISH_REASON_LENGTH,
    "eos": api_pb2.FINISH_REASON_EOS,
    "stop": api_pb2.FINISH_REASON_STOP,
    "cancelled": api_pb2.FINISH_REASON_CANCELLED,
    "error": api_pb2.FINISH_REASON_ERROR,
}


@dataclass(frozen=True)
class ApiLimits:
    """What the public API accepts and defaults to."""

    vocab_size: int
    max_positions: int
    max_new_tokens: int
    default_expansion: tuple[int, ...]  # empty: no speculation by default
    default_ssms: tuple[str, ...]
    ssm_names: tuple[str, ...]
    draft_support: int
    llm_name: str
    eos_token_id: int | None
    max_prompt_tokens: int = 8192
    max_tree_nodes: int = 64  # of the merged tree, root included


def finish_to_proto(finish: Finish) -> api_pb2.Finished:
    u = finish.usage
    usage = api_pb2.Usage(
        prompt_tokens=u.prompt_tokens,
        completion_tokens=u.completion_tokens,
        llm_steps=u.llm_steps,
        mean_accepted_tokens=u.mean_accepted,
        tokens_per_step=u.tokens_per_step,
        mean_tree_size=u.mean_tree_size,
    )
    return api_pb2.Finished(reason=FINISH_REASONS[finish.reason], usage=usage, error=finish.error)


def snapshot_finish(snapshot: RequestSnapshot) -> Finish | None:
    """The final state of a stored request, or None while it runs."""
    if snapshot.finish_reason is None:
        return None
    usage = Usage.of(len(snapshot.prompt_tokens), len(snapshot.output_tokens), snapshot.stats)
    return Finish(snapshot.finish_reason.value, usage, snapshot.error or "")


def live_params(live: Live, ssm_names: tuple[str, ...]) -> dict:
    """Everything but the prompt, as JSON for the store (enough to resume the request)."""
    req = live.request
    spec = req.speculation
    return {
        "sampling": {"temperature": req.sampling.temperature, "top_p": req.sampling.top_p, "top_k": req.sampling.top_k, "seed": req.sampling.seed},
        "seed": live.seed,
        "max_new_tokens": req.max_new_tokens,
        "stop_token_ids": list(req.stop_token_ids),
        "stop": list(live.stop_strings),
        "ignore_eos": req.ignore_eos,
        "speculation": None if spec is None else {"expansion": list(spec.expansion.widths), "ssms": [ssm_names[i] for i in spec.ssms]},
    }


def live_from_snapshot(snapshot: RequestSnapshot, limits: ApiLimits, tokenizer: Tokenizer | None) -> Live:
    """The inverse of :func:`live_params`: an unfinished request found in Redis, ready to resume
    where its committed tokens end. SSMs the workers no longer serve are dropped from its tree."""
    params = snapshot.params
    spec = None
    if params.get("speculation"):
        names = [n for n in params["speculation"]["ssms"] if n in limits.ssm_names]
        if names:
            spec = SpeculationConfig(
                ExpansionConfig(tuple(params["speculation"]["expansion"])), tuple(limits.ssm_names.index(n) for n in names), limits.draft_support
            )
    request = GenerationRequest(
        request_id=snapshot.request_id,
        prompt_tokens=tuple(snapshot.prompt_tokens),
        max_new_tokens=int(params["max_new_tokens"]),
        sampling=SamplingParams(**params["sampling"]),
        speculation=spec,
        stop_token_ids=tuple(params["stop_token_ids"]),
        ignore_eos=bool(params["ignore_eos"]),
    )
    stop = tuple(params["stop"])
    text = TextStream(tokenizer, stop) if tokenizer is not None else None
    live = Live(request, int(params["seed"]), stop, text)
    live.output = list(snapshot.output_tokens)
    if text is not None:
        text.update(live.output)  # already streamed before the restart
    live.stats = snapshot.stats
    return live


def event_to_proto(request_id: str, event: StreamEvent) -> api_pb2.GenerateResponse:
    msg = api_pb2.GenerateResponse(request_id=request_id, offset=event.offset, token_ids=event.tokens, text=event.text)
    if event.finished is not None:
        msg.finished.CopyFrom(finish_to_proto(event.finished))
    return msg


async def _check_request_id(request_id: str, context: grpc.aio.ServicerContext) -> None:
    """A request ID longer than any the server gives or accepts names no request: refuse it before Redis sees it."""
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request_id: must be at most {MAX_REQUEST_ID_CHARS} characters")
    if request_id:
        try:
            validate_id(request_id, "request_id")  # the store's rule for IDs inside Redis keys
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request_id: {exc}")


class SpecInferServicer(api_pb2_grpc.SpecInferServicer):
    def __init__(self, scheduler: Scheduler, store: RequestStore, limits: ApiLimits, tokenizer: Tokenizer | None, owner: str) -> None:
        self.scheduler = scheduler
        self.store = store
        self.limits = limits
        self.tokenizer = tokenizer
        self.owner = owner

    # -- validation ---------------------------------------------------------------------

    def _prompt(self, msg: api_pb2.GenerateRequest) -> tuple[int, ...]:
        which = msg.WhichOneof("prompt")
        most = self.limits.max_prompt_tokens
        if which == "text":
            if not msg.text:
                raise InvalidArgument("prompt.text", "must not be empty")
            if self.tokenizer is None:
                raise InvalidArgument("prompt.text", "this server has no tokenizer; send prompt.token_ids")
            if len(msg.text) > most * CHARS_PER_PROMPT_TOKEN:
                raise InvalidArgument("prompt.text", f"{len(msg.text)} characters is too long (the limit is {most} tokens)")
            ids = tuple(self.tokenizer.encode(msg.text).ids)
            if len(ids) > most:
                raise InvalidArgument("prompt.text", f"{len(ids)} tokens; at most {most}")
            return ids
        if which == "token_ids":
            ids = tuple(msg.token_ids.ids)
            if not ids:
                raise InvalidArgument("prompt.token_ids", "must not be empty")
            if len(ids) > most:
                raise InvalidArgument("prompt.token_ids", f"{len(ids)} tokens; at most {most}")
            bad = [t for t in ids if not 0 <= t < self.limits.vocab_size]
            if bad:
                raise InvalidArgument("prompt.token_ids", f"token IDs must be in [0, {self.limits.vocab_size}), got {bad[:5]}")
            return ids
        raise InvalidArgument("prompt", "set prompt.text or prompt.token_ids")

    def _speculation(self, msg: api_pb2.SpeculationParams) -> SpeculationConfig | None:
        if msg.disabled:
            return None
        widths = tuple(msg.expansion) or self.limits.default_expansion
        if not widths:
            return None
        most = self.limits.max_tree_nodes
        if len(widths) >= most:  # checked first: the node count of a deep tree is a huge number
            raise InvalidArgument("speculation.expansion", f"{len(widths)} depths; a tree of at most {most} nodes has fewer")
        expansion = wire.expansion_from_proto(widths)
        if len(msg.ssms) > len(self.limits.ssm_names):
            raise InvalidArgument("speculation.ssms", f"lists {len(msg.ssms)} SSMs; the server has {len(self.limits.ssm_names)}")
        names = tuple(msg.ssms) or self.limits.default_ssms
        unknown = [n for n in names if n not in self.limits.ssm_names]
        if unknown:
            raise InvalidArgument("speculation.ssms", f"unknown SSM {unknown[0]!r} (have: {', '.join(self.limits.ssm_names) or 'none'})")
        if len(set(names)) != len(names):
            raise InvalidArgument("speculation.ssms", "lists an SSM twice")
        if not names:
            raise InvalidArgument("speculation.ssms", "no SSM is available; set speculation.disabled")
        nodes = 1 + len(names) * (expansion.max_nodes - 1)  # merged trees share at least the root
        if nodes > most:
            raise InvalidArgument("speculation.expansion", f"up to {nodes} tree nodes with {len(names)} SSM(s); at most {most}")
        return SpeculationConfig(expansion, tuple(self.limits.ssm_names.index(n) for n in names), self.limits.draft_support)

    def build(self, msg: api_pb2.GenerateRequest, deadline: float | None) -> Live:
        """A validated :class:`Live` request from the wire message."""
        if len(msg.request_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidArgument("request_id", f"must be at most {MAX_REQUEST_ID_CHARS} characters")
        if len(msg.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidArgument("stop_token_ids", f"{len(msg.stop_token_ids)} IDs; at most {MAX_STOP_TOKEN_IDS}")
        if len(msg.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_CHARS for s in msg.stop):
            raise InvalidArgument("stop", f"at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_STRING_CHARS} characters")
        if any(not s for s in msg.stop):
            raise InvalidArgument("stop", "an empty stop string would stop at once")
        prompt = self._prompt(msg)
        if msg.max_new_tokens <= 0:
            raise InvalidArgument("max_new_tokens", "must be > 0")
        if msg.max_new_tokens > self.limits.max_new_tokens:
            raise InvalidArgument("max_new_tokens", f"must be at most {self.limits.max_new_tokens}, got {msg.max_new_tokens}")
        if len(prompt) + msg.max_new_tokens > self.limits.max_positions:
            raise InvalidArgument("max_new_tokens", f"prompt ({len(prompt)} tokens) + max_new_tokens exceeds the model's {self.limits.max_positions} positions")
        bad_stop = [t for t in msg.stop_token_ids if not 0 <= t < self.limits.vocab_size]
        if bad_stop:
            raise InvalidArgument("stop_token_ids", f"token IDs must be in [0, {self.limits.vocab_size}), got {bad_stop[:5]}")
        if msg.stop and self.tokenizer is None:
            raise InvalidArgument("stop", "stop strings need a tokenizer, which this server lacks; use stop_token_ids")
        sampling = wire.sampling_from_proto(msg.sampling)
        request_id = msg.request_id or uuid.uuid4().hex
        try:
            validate_id(request_id, "request_id")  # the store's rule for IDs inside Redis keys
        except ValueError as exc:
            raise InvalidArgument("request_id", str(exc)) from None
        request = GenerationRequest(
            request_id=request_id,
            prompt_tokens=prompt,
            max_new_tokens=int(msg.max_new_tokens),
            sampling=sampling,
            speculation=self._speculation(msg.speculation),
            stop_token_ids=tuple(msg.stop_token_ids),
            ignore_eos=msg.ignore_eos,
        )
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
        text = TextStream(self.tokenizer, tuple(msg.stop)) if self.tokenizer is not None else None
        return Live(request, seed, tuple(msg.stop), text, deadline)

    async def recover(self) -> list[str]:
        """Resume the unfinished requests this replica owns in Redis (after a restart)."""
        resumed = []
        for rid in await self.store.active(self.owner):
            snapshot = await self.store.get(rid)
            if snapshot is None or snapshot.is_finished:
                continue
            try:
                live = live_from_snapshot(snapshot, self.limits, self.tokenizer)
            except (KeyError, TypeError, ValueError) as exc:  # a record this version cannot read
                log.error("cannot resume request", extra={"request_id": rid, "error": repr(exc)})
                await self.store.finish(rid, "error", f"cannot resume: {exc}", owner=self.owner)
                continue
            self.scheduler.resume(live)
            resumed.append(rid)
        if resumed:
            log.info("resumed requests from Redis", extra={"count": len(resumed)})
        return resumed

    # -- RPCs ----------------------------------------------------------------------------

    async def Generate(self, request: api_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        if request.HasField("resume_from"):
            async for msg in self._resume(request, context):
                yield msg
            return
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None else None
        try:
            live = self.build(request, deadline)
        except InvalidArgument as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if self.scheduler.get(live.request_id) is not None:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {live.request_id!r} is already running")
        queue: asyncio.Queue = asyncio.Queue()
        live.subscribers.append(queue)
        try:
            self.scheduler.check_room()
            record = RequestRecord(live.request_id, live.request.prompt_tokens, live_params(live, self.limits.ssm_names), self.owner)
            await self.store.create(record)
            await self.scheduler.submit(live)
        except QueueFull as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except RequestExistsError as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {exc}")
        try:
            while True:
                event = await queue.get()
                yield event_to_proto(live.request_id, event)
                if event.finished is not None:
                    return
        finally:
            if live.finished is None:
                # the client went away (or the deadline passed): free the batch slot
                self.scheduler.cancel(live.request_id)

    async def _resume(self, request: api_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        """Reattach to a request: stored tokens from ``resume_from``, then live ones."""
        rid = request.request_id
        if not rid:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: required with resume_from")
        await _check_request_id(rid, context)
        live = self.scheduler.get(rid)
        offset = request.resume_from
        if live is not None and live.finished is None:
            queue: asyncio.Queue = asyncio.Queue()
            live.subscribers.append(queue)  # subscribe first, then send the backlog: nothing is lost in between
            backlog = tuple(live.output[offset:])
            yield api_pb2.GenerateResponse(request_id=rid, offset=offset, token_ids=backlog)
            sent = offset + len(backlog)
            try:
                while True:
                    event = await queue.get()
                    tokens = event.tokens[max(0, sent - event.offset) :]
                    msg = event_to_proto(rid, StreamEvent(max(sent, event.offset), tokens, event.text, event.finished))
                    sent = max(sent, event.offset + len(event.tokens))
                    yield msg
                    if event.finished is not None:
                        return
            finally:
                live.subscribers.remove(queue)
        snapshot = await self.store.get(rid)
        if snapshot is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"request_id: no request {rid!r}")
        msg = api_pb2.GenerateResponse(request_id=rid, offset=offset, token_ids=snapshot.output_tokens[offset:])
        finish = snapshot_finish(snapshot)
        if finish is not None:
            msg.finished.CopyFrom(finish_to_proto(finish))
        yield msg

    async def Cancel(self, request: api_pb2.CancelRequest, context: grpc.aio.ServicerContext) -> api_pb2.CancelResponse:
        await _check_request_id(request.request_id, context)
        return api_pb2.CancelResponse(cancelled=self.scheduler.cancel(request.request_id))

    async def GetRequest(self, request: api_pb2.GetRequestRequest, context: grpc.aio.ServicerContext) -> api_pb2.RequestState:
        rid = request.request_id
        await _check_request_id(rid, context)
        live = self.scheduler.get(rid)
        snapshot = await self.store.get(rid)
        if snapshot is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"request_id: no request {rid!r}")
        finish = snapshot_finish(snapshot)
        if finish is not None:
            status = api_pb2.REQUEST_STATUS_FINISHED
        elif live is not None and self.scheduler.is_queued(rid):
            status = api_pb2.REQUEST_STATUS_QUEUED
        else:
            status = api_pb2.REQUEST_STATUS_RUNNING
        state = api_pb2.RequestState(request_id=rid, status=status, prompt_token_ids=snapshot.prompt_tokens, output_token_ids=snapshot.output_tokens)
        if self.tokenizer is not None:
            state.text = self.tokenizer.decode(list(snapshot.output_tokens), skip_special_tokens=False)
        if finish is not None:
            state.finished.CopyFrom(finish_to_proto(finish))
        return state

    async def GetModelInfo(self, request: api_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> api_pb2.ModelInfo:
        lim = self.limits
        info = api_pb2.ModelInfo(
            llm=lim.llm_name,
            ssms=lim.ssm_names,
            vocab_size=lim.vocab_size,
            max_positions=lim.max_positions,
            max_new_tokens_limit=lim.max_new_tokens,
            default_expansion=lim.default_expansion,
            has_tokenizer=self.tokenizer is not None,
        )
        if lim.eos_token_id is not None:
            info.eos_token_id = lim.eos_token_id
        return info
