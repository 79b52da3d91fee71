"""The OpenAI-compatible HTTP front door of the request manager (Starlette, served by uvicorn on the
request manager's own event loop: no extra hop, no extra process).

Endpoints: ``/v1/completions``, ``/v1/chat/completions`` (messages rendered by the checkpoint's
chat template, :mod:`.chat_template`), ``/v1/models``, ``/health``. Handlers convert (:mod:`.openai_wire` in,
:mod:`.openai_objects` out), admit each choice with the same :func:`.admission.build_live` as the gRPC servicer, call
:meth:`.state.lifecycle.Requests.start` once per choice, and wrap the events; they hold no logic of their own. Errors
are OpenAI error objects: 400 naming the ``param``, 401 without the bearer token (``--auth-token`` is the API key), 404
for an unknown model, 429 when the queue is full, 503 while the verifier has not answered yet or, after start-up,
while it is unreachable (requests already running wait for it) or while this request manager does not hold its
ownership lease (:mod:`.state.ownership`). A client that disconnects cancels its requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from specinfer.core.errors import InvalidArgument, Unavailable
from specinfer.request_manager.api import openai_objects as oo
from specinfer.request_manager.api import openai_wire as ow
from specinfer.request_manager.api import tool_calls as tc
from specinfer.request_manager.api.admission import build_live
from specinfer.request_manager.api.chat_template import ChatTemplate, check_messages
from specinfer.request_manager.api.http_transport import (
    HttpError,
    HttpMetrics,
    disconnected,
    http_error,
    json_body,
    sse,
)
from specinfer.request_manager.api.servicer import SpecInferServicer, finish_to_proto
from specinfer.request_manager.scheduling.live import StreamEvent
from specinfer.serving.security import ServerSecurity
from specinfer.v1 import api_pb2

log = logging.getLogger("specinfer.request_manager.http")


@dataclass
class _Stream:
    """One choice's events, its first one already taken (admission errors surface before a response starts)."""

    events: AsyncIterator[StreamEvent]
    first: StreamEvent


class HttpApi:
    """Routes of the HTTP API over the gRPC servicer's requests (``servicer.requests`` raises
    Unavailable until start-up has reached the verifier)."""

    def __init__(
        self,
        servicer: SpecInferServicer,
        security: ServerSecurity,
        metrics: HttpMetrics,
        chat: ChatTemplate | None = None,
    ) -> None:
        """``chat``: the LLM checkpoint's chat template (None: chat completions answer 400)."""
        self.servicer = servicer
        self.chat = chat
        self._keys = [t.encode() for t in security.tokens if t]
        self.metrics = metrics
        self.app = Starlette(
            routes=[
                Route("/health", self.health, methods=["GET"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            ]
        )

    # -- helpers ---------------------------------------------------------------------------

    def _check_key(self, request: Request) -> None:
        if not self._keys:
            return
        given = request.headers.get("authorization", "")
        scheme, _, key = given.partition(" ")
        if scheme.lower() != "bearer" or not any(hmac.compare_digest(key.strip().encode(), k) for k in self._keys):
            raise HttpError(
                401,
                "missing or wrong API key (Authorization: Bearer <key>)",
                "authentication_error",
                None,
                "invalid_api_key",
            )

    def _model(self, wanted: str | None) -> str:
        name = self.servicer.requests.limits.llm_name
        if wanted is not None and wanted != name:
            raise HttpError(
                404,
                f"the model {wanted!r} does not exist; this server serves {name!r}",
                "invalid_request_error",
                "model",
                "model_not_found",
            )
        return name

    async def _endpoint(self, name: str, request: Request, handle: Callable[[], Awaitable[Response]]) -> Response:
        try:
            self._check_key(request)
            response = await handle()
        except Exception as exc:  # every failure is an OpenAI error object, never a crash
            response = http_error(exc).response()
        self.metrics.requests.labels(name, str(response.status_code)).inc()
        return response

    # -- endpoints -------------------------------------------------------------------------

    def _check_verifier(self) -> None:
        """503 for a new request while the verifier is unreachable after start-up: requests in
        flight wait for it, but a new caller is better told to retry (OpenAI clients retry 503
        with backoff) than kept waiting for an outage of unknown length."""
        if not self.servicer.requests.scheduler.verifier_reachable:
            raise HttpError(
                503,
                "the LLM verifier is unreachable; retry later",
                "service_unavailable",
                None,
                "verifier_unavailable",
                retry_after=1,
            )

    async def health(self, request: Request) -> Response:
        try:
            self.servicer.requests  # noqa: B018 - raises Unavailable while starting
        except Unavailable as exc:
            return JSONResponse({"status": "starting", "detail": str(exc)}, status_code=503)
        if not self.servicer.requests.scheduler.verifier_reachable:
            return JSONResponse({"status": "unavailable", "detail": "the LLM verifier is unreachable"}, status_code=503)
        if not self.servicer.requests.lease.held:
            return JSONResponse(
                {"status": "unavailable", "detail": "this request manager does not hold its ownership lease"},
                status_code=503,
            )
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        return await self._endpoint("models", request, lambda: self._models())

    async def _models(self) -> Response:
        return JSONResponse(oo.models_object(self._model(None), oo.now()))

    async def completions(self, request: Request) -> Response:
        return await self._endpoint("completions", request, lambda: self._completions(request))

    async def chat_completions(self, request: Request) -> Response:
        return await self._endpoint("chat_completions", request, lambda: self._chat(request))

    async def _completions(self, request: Request) -> Response:
        started = time.monotonic()
        body = await json_body(request)
        return await self._generate(request, body, started)

    async def _chat(self, request: Request) -> Response:
        started = time.monotonic()
        body = await json_body(request)
        messages = check_messages(body.get("messages"))
        tokenizer = self.servicer.requests.tokenizer
        if self.chat is None or tokenizer is None:
            raise InvalidArgument(
                "messages",
                "this model has no chat template (tokenizer_config.json or chat_template.jinja); use /v1/completions",
            )
        add_generation_prompt = body.get("add_generation_prompt", True)
        if not isinstance(add_generation_prompt, bool):
            raise InvalidArgument("add_generation_prompt", "must be true or false")
        tools = tc.tool_request(body)
        constraint = tools.constraint(self.servicer.requests.grammars)
        text = self.chat.render(messages, add_generation_prompt, tools.offered)
        prompt = tokenizer.encode(text, add_special_tokens=False).ids  # the template wrote the special tokens
        if not prompt:
            raise InvalidArgument("messages", "the chat template rendered an empty prompt")
        grammar = constraint.text if constraint is not None else None
        return await self._generate(request, ow.chat_as_completion(body, prompt, grammar), started, tools)

    async def _generate(
        self, request: Request, body: dict[str, Any], started: float, tools: tc.ToolRequest | None = None
    ) -> Response:
        """Admit every choice of ``body`` (a completions body), then answer: one object, or a stream. ``tools``: a
        chat request's (None: a completions request)."""
        chat = tools is not None
        params = ow.completion_params(body)
        model = self._model(params.model)
        self._check_verifier()
        requests = self.servicer.requests
        response_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        msgs = ow.generate_requests(body, params, response_id)
        lives = [build_live(m, requests.limits, requests.tokenizer, None, requests.grammars) for m in msgs]
        echo = [self._echo_text(p) if params.echo else "" for p in params.prompts]
        prompt_tokens = [len(lives[p * params.n].request.prompt_tokens) for p in range(len(params.prompts))]
        streams = await self._start(lives)
        env = oo.Envelope(response_id, model, oo.now())
        logprobs = oo.Logprobs(self._token_text) if params.logprobs is not None else None
        if params.stream:
            chunks = self._chunks(streams, params, echo, prompt_tokens, env, started, tools, logprobs)
            return StreamingResponse(chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        choices = await self._collect(request, streams, params, echo, started)
        failed = [c for c in choices if c.error]
        if failed:  # a failed generation is the server's error, not an answer (a stream says it in an error event)
            raise HttpError(
                500, f"choice {failed[0].index}: {failed[0].error}", "server_error", None, "generation_failed"
            )
        if tools is not None:
            return JSONResponse(oo.chat_object(env, choices, prompt_tokens, logprobs, tools))
        return JSONResponse(oo.completion_object(env, choices, prompt_tokens, logprobs))

    def _token_text(self, token: int) -> str:
        """One token's text in a logprobs object: the tokenizer's decoding of it alone (special tokens too), or
        ``token_id:N`` without a tokenizer (as vLLM spells it)."""
        tokenizer = self.servicer.requests.tokenizer
        if tokenizer is None:
            return f"token_id:{token}"
        return tokenizer.decode([token], skip_special_tokens=False)

    def _echo_text(self, prompt: str | Sequence[int]) -> str:
        if isinstance(prompt, str):
            return prompt
        tokenizer = self.servicer.requests.tokenizer
        if tokenizer is None:
            raise InvalidArgument("echo", "echoing a token prompt needs a tokenizer, which this server lacks")
        return tokenizer.decode(list(prompt), skip_special_tokens=False)

    async def _start(self, lives) -> list[_Stream]:
        """Admit every choice and take its first event; if one fails, cancel the ones started."""
        streams: list[_Stream] = []
        try:
            for live in lives:
                events = self.servicer.requests.start(live)
                streams.append(_Stream(events, await anext(events)))
        except BaseException:
            for s in streams:
                await s.events.aclose()
            raise
        return streams

    async def _collect(
        self, request: Request, streams: list[_Stream], params: ow.CompletionParams, echo: list[str], started: float
    ) -> list[oo.Choice]:
        """Every choice to its end; the requests are cancelled if the client goes away first."""
        choices = [oo.Choice(i, text=echo[i // params.n]) for i in range(len(streams))]

        async def follow(i: int, s: _Stream) -> None:
            last = started
            event: StreamEvent | None = s.first
            async with contextlib.aclosing(s.events):
                while event is not None:
                    last = self._observe(choices[i], event, started, last)
                    event = None if event.finished is not None else await anext(s.events, None)

        work = asyncio.gather(*(follow(i, s) for i, s in enumerate(streams)))
        gone = asyncio.ensure_future(disconnected(request))
        try:
            await asyncio.wait([work, gone], return_when=asyncio.FIRST_COMPLETED)
            if not work.done():  # the client left: closing the event streams cancels the requests
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await work
                raise asyncio.CancelledError
            work.result()
        finally:
            gone.cancel()
        self.metrics.e2e.observe(time.monotonic() - started)
        return choices

    def _observe(self, choice: oo.Choice, event: StreamEvent, started: float, last: float) -> float:
        """Add ``event`` to ``choice``; record its latencies; the arrival time."""
        now = time.monotonic()
        if event.tokens:
            if choice.token_ids == 0:
                self.metrics.ttft.observe(now - started)
            else:
                per_token = (now - last) / len(event.tokens)
                for _ in event.tokens:
                    self.metrics.itl.observe(per_token)
        choice.text += event.text
        choice.token_ids += len(event.tokens)
        choice.logprobs.extend(event.logprobs)
        if event.finished is not None:
            choice.finish_reason = oo.FINISH_REASONS[event.finished.reason]
            choice.error = event.finished.error
            choice.usage = _usage_proto(event)
        return now if event.tokens else last

    async def _chunks(
        self, streams, params, echo, prompt_tokens, env, started, tools: tc.ToolRequest | None, logprobs
    ) -> AsyncIterator[str]:
        """Server-sent events: a chunk per event of any choice as it comes (chat, ``tools`` not None: a first chunk
        with the role, content and tool call deltas, then an empty delta with the finish reason), a usage chunk
        when asked, then ``[DONE]``. With ``logprobs`` (:class:`.openai_objects.Logprobs`), each event's first chunk
        carries its tokens' (a chunk comes for new tokens even while their text is held back). Starlette cancels this
        generator when the client disconnects;
        the event streams close with it, which cancels the requests."""
        chat = tools is not None
        choices = [oo.Choice(i) for i in range(len(streams))]
        parsers = [tools.parser() if tools is not None else None for _ in streams]
        queue: asyncio.Queue[tuple[int, StreamEvent | BaseException]] = asyncio.Queue()

        async def pump(i: int, s: _Stream) -> None:
            try:
                async with contextlib.aclosing(s.events):
                    await queue.put((i, s.first))
                    if s.first.finished is None:
                        async for event in s.events:
                            await queue.put((i, event))
            except Exception as exc:
                await queue.put((i, exc))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        last = [started] * len(streams)
        offsets = [0] * len(streams)  # each choice's text_offset so far (logprobs come without echo)

        def chunk(i: int, event: StreamEvent, finish_reason: str | None) -> str:
            text, lp = event.text, None
            if logprobs is not None and not chat:
                lp = logprobs.completion(event.logprobs, offsets[i])
                offsets[i] += sum(len(t) for t in lp["tokens"])
            elif logprobs is not None:
                lp = logprobs.chat(event.logprobs)
            if not chat:
                return sse(oo.completion_chunk(env, i, text, finish_reason, lp))
            parser = parsers[i]
            if parser is None:
                return "".join(sse(c) for c in oo.chat_event_chunks(env, i, [text], finish_reason, 0, lp))
            pieces = parser.feed(text) + (parser.finish() if finish_reason is not None else [])
            return "".join(sse(c) for c in oo.chat_event_chunks(env, i, pieces, finish_reason, parser.calls, lp))

        try:
            for i in range(len(streams)):
                if chat:
                    yield sse(oo.chat_chunk(env, i, {"role": "assistant", "content": ""}, None))
                elif echo[i // params.n]:
                    yield sse(oo.completion_chunk(env, i, echo[i // params.n], None))
            open_choices = len(streams)
            while open_choices:
                i, item = await queue.get()
                if isinstance(item, BaseException):
                    err = http_error(item)
                    yield sse(oo.error_object(str(err), err.kind, err.param, err.code))
                    open_choices -= 1
                    continue
                last[i] = self._observe(choices[i], item, started, last[i])
                if item.text or item.finished is not None or (logprobs is not None and item.logprobs):
                    yield chunk(i, item, choices[i].finish_reason)
                if item.finished is not None:
                    open_choices -= 1
                    if item.finished.error:
                        message = f"choice {i}: {item.finished.error}"
                        yield sse(oo.error_object(message, "server_error", None, "generation_failed"))
            if params.include_usage:
                usage = oo.chat_usage_chunk if chat else oo.usage_chunk
                yield sse(usage(env, choices, prompt_tokens))
            yield "data: [DONE]\n\n"
            self.metrics.e2e.observe(time.monotonic() - started)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def _usage_proto(event: StreamEvent) -> api_pb2.Usage:
    assert event.finished is not None
    return finish_to_proto(event.finished).usage
