"""The public ``specinfer.v1.SpecInfer`` servicer: translates messages, nothing else.

Admission is :mod:`specinfer.request_manager.api.admission`, the operations on requests
:class:`~specinfer.request_manager.state.lifecycle.Requests`; ``rpc_errors`` maps their errors onto statuses:
invalid fields INVALID_ARGUMENT naming the field, a full queue RESOURCE_EXHAUSTED, a running request ID
reused ALREADY_EXISTS, an unknown one NOT_FOUND; every call UNAVAILABLE until start-up has
reached the verifier (:meth:`SpecInferServicer.open`).
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import aclosing

import grpc
from tokenizers import Tokenizer

from specinfer import wire
from specinfer.core.errors import Unavailable
from specinfer.request_manager.api.admission import build_live, check_request_id, resume_request_id
from specinfer.request_manager.scheduling.live import Finish, StreamEvent
from specinfer.request_manager.state.lifecycle import Requests, RequestState
from specinfer.request_manager.state.live_records import snapshot_text
from specinfer.request_manager.state.records import RequestStatus
from specinfer.serving.rpc import rpc_errors
from specinfer.v1 import api_pb2, api_pb2_grpc

FINISH_REASONS = {
    "length": api_pb2.FINISH_REASON_LENGTH,
    "eos": api_pb2.FINISH_REASON_EOS,
    "stop": api_pb2.FINISH_REASON_STOP,
    "cancelled": api_pb2.FINISH_REASON_CANCELLED,
    "error": api_pb2.FINISH_REASON_ERROR,
}

STATUSES = {
    RequestStatus.QUEUED: api_pb2.REQUEST_STATUS_QUEUED,
    RequestStatus.RUNNING: api_pb2.REQUEST_STATUS_RUNNING,
    RequestStatus.FINISHED: api_pb2.REQUEST_STATUS_FINISHED,
}


def finish_to_proto(finish: Finish) -> api_pb2.Finished:
    usage = api_pb2.Usage(**dataclasses.asdict(finish.usage))  # the same field names
    return api_pb2.Finished(reason=FINISH_REASONS[finish.reason], usage=usage, error=finish.error)


def event_to_proto(request_id: str, event: StreamEvent) -> api_pb2.GenerateResponse:
    msg = api_pb2.GenerateResponse(
        request_id=request_id,
        offset=event.offset,
        token_ids=event.tokens,
        text=event.text,
        logprobs=wire.token_logprobs_to_proto(event.logprobs),
    )
    if event.finished is not None:
        msg.finished.CopyFrom(finish_to_proto(event.finished))
    return msg


def state_to_proto(state: RequestState, tokenizer: Tokenizer | None) -> api_pb2.RequestState:
    snapshot = state.snapshot
    msg = api_pb2.RequestState(
        request_id=snapshot.request_id,
        status=STATUSES[state.status],
        prompt_token_ids=snapshot.prompt_tokens,
        output_token_ids=snapshot.output_tokens,
        output_logprobs=wire.token_logprobs_to_proto(snapshot.output_logprobs),
    )
    if tokenizer is not None:
        msg.text = snapshot_text(snapshot, tokenizer)
    if state.finish is not None:
        msg.finished.CopyFrom(finish_to_proto(state.finish))
    return msg


def deadline(context: grpc.aio.ServicerContext) -> float | None:
    """The call's deadline as ``time.monotonic()`` (None: it has none)."""
    remaining = context.time_remaining()
    return time.monotonic() + remaining if remaining is not None else None


class SpecInferServicer(api_pb2_grpc.SpecInferServicer):
    """Serves from the moment the port opens; calls are UNAVAILABLE until :meth:`open` gives it the
    requests (the request manager's start-up waits for the verifier first)."""

    def __init__(self, requests: Requests | None = None) -> None:
        self._requests = requests

    def open(self, requests: Requests) -> None:
        self._requests = requests

    @property
    def requests(self) -> Requests:
        if self._requests is None:
            raise Unavailable(
                "the request manager is starting: the LLM verifier has not answered yet, "
                "or it waits for its ownership lease; retry later"
            )
        return self._requests

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.requests.tokenizer

    @rpc_errors
    async def Generate(self, request: api_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        if request.HasField("resume_from"):
            request_id = resume_request_id(request)
            events = self.requests.attach(request_id, request.resume_from)
        else:
            live = build_live(request, self.requests.limits, self.tokenizer, deadline(context), self.requests.grammars)
            request_id, events = live.request_id, self.requests.start(live)
        async with aclosing(events):  # closed with the call: an abandoned request is cancelled at once
            async for event in events:
                yield event_to_proto(request_id, event)

    @rpc_errors
    async def Cancel(self, request: api_pb2.CancelRequest, context: grpc.aio.ServicerContext) -> api_pb2.CancelResponse:
        return api_pb2.CancelResponse(cancelled=await self.requests.cancel(check_request_id(request.request_id)))

    @rpc_errors
    async def GetRequest(
        self, request: api_pb2.GetRequestRequest, context: grpc.aio.ServicerContext
    ) -> api_pb2.RequestState:
        return state_to_proto(await self.requests.state(check_request_id(request.request_id)), self.tokenizer)

    @rpc_errors
    async def GetModelInfo(
        self, request: api_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> api_pb2.ModelInfo:
        lim = self.requests.limits  # read per call: it grows when workers with new SSMs join
        info = api_pb2.ModelInfo(
            llm=lim.llm_name,
            ssms=lim.ssm_names,
            vocab_size=lim.vocab_size,
            max_positions=lim.max_positions,
            max_new_tokens_limit=lim.max_new_tokens,
            default_expansion=lim.default_expansion,
            default_speculation=lim.default_speculation,
            has_tokenizer=self.tokenizer is not None,
            draft_vocabulary=dict(lim.draft_vocabulary),
        )
        if lim.eos_token_id is not None:
            info.eos_token_id = lim.eos_token_id
        return info
