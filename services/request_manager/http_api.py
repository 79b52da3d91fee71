"""The OpenAI-compatible HTTP front door of the request manager (Starlette, served by uvicorn on the
request manager's own event loop: no extra hop, no extra process).

Endpoints: ``/v1/completions``, ``/v1/chat/completions`` (messages rendered by the checkpoint's
chat template, :mod:`.chat_template`), ``/v1/models``, ``/health``. Handlers convert (:mod:`.openai_wire`), admit each choice with the same
:func:`.admission.build_live` as the gRPC servicer, call :meth:`.lifecycle.Requests.start` once per
choice, and wrap the events; they hold no logic of their own. Errors are OpenAI error objects: 400
naming the ``param``, 401 without the bearer token (``--auth-token`` is the API key), 404 for an
unknown model, 429 when the queue is full, 503 while the verifier has not answered yet or, after
start-up, while it is unreachable (requests already running wait for it) or while this request
manager does not hold its ownership lease (:mod:`.ownership`). A client that disconnects cancels its
requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import uvicorn
from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from specinfer.core.errors import FieldError, InvalidArgument, ResourceExhausted, Unavailable
from specinfer.request_manager import openai_wire as ow
from specinfer.request_manager.admission import build_live
from specinfer.request_manager.chat_template import ChatTemplate, check_messages
from specinfer.request_manager.live import StreamEvent
from specinfer.request_manager.servicer import SpecInferServicer, finish_to_proto
from specinfer.serving.config import port_in_use
from specinfer.serving.security import ServerSecurity
from specinfer.v1 import api_pb2

log = logging.getLogger("specinfer.request_manager.http")

MAX_BODY_BYTES = 4 << 20  # a request body larger than this is refused (413), not kept nor parsed
DRAIN_BYTES = 64 << 20  # an oversized body is read (and dropped) up to this, so that its sender gets the 413
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class HttpMetrics:
    """Latency as clients of the HTTP API see it, and its requests by status."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("specinfer_http_requests", "HTTP API requests by endpoint and status code", ["endpoint", "status"], registry=registry)
        self.ttft = Histogram("specinfer_time_to_first_token_seconds", "From an HTTP request to its first token", buckets=LATENCY_BUCKETS, registry=registry)
        self.itl = Histogram(
            "specinfer_inter_token_latency_seconds", "Time between a choice's token arrivals over HTTP, per token", buckets=LATENCY_BUCKETS, registry=registry
        )
        self.e2e = Histogram("specinfer_e2e_request_latency_seconds", "Time from an HTTP request to its last token", buckets=LATENCY_BUCKETS, registry=registry)


class HttpError(Exception):
    def __init__(self, status: int, message: str, kind: str, param: str | None = None, code: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.param, self.code, self.retry_after = status, kind, param, code, retry_after

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(max(1, round(self.retry_after)))} if self.retry_after is not None else None
        return JSONResponse(ow.error_object(str(self), self.kind, self.param, self.code), status_code=self.status, headers=headers)


def http_error(exc: Exception) -> HttpError:
    """The OpenAI error a core error stands for."""
    if isinstance(exc, HttpError):
        return exc
    if isinstance(exc, InvalidArgument):
        param = ow.openai_param(exc.field)
        return HttpError(400, f"{param}: {exc.message}", "invalid_request_error", param)
    if isinstance(exc, ResourceExhausted):
        return HttpError(429, str(exc), "rate_limit_error", None, "queue_full")
    if isinstance(exc, Unavailable):
        return HttpError(503, str(exc), "service_unavailable", None, "unavailable", retry_after=1)
    if isinstance(exc, FieldError):
        return HttpError(400, str(exc), "invalid_request_error", ow.openai_param(exc.field))
    log.exception("HTTP request failed")
    return HttpError(500, f"{type(exc).__name__}: {exc}", "server_error")


@dataclass
class _Stream:
    """One choice's events, its first one already taken (admission errors surface before a response starts)."""

    events: AsyncIterator[StreamEvent]
    first: StreamEvent


class HttpApi:
    """Routes of the HTTP API over the gRPC servicer's requests (``servicer.requests`` raises
    Unavailable until start-up has reached the verifier)."""

    def __init__(self, servicer: SpecInferServicer, security: ServerSecurity, metrics: HttpMetrics, chat: ChatTemplate | None = None) -> None:
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
            raise HttpError(401, "missing or wrong API key (Authorization: Bearer <key>)", "authentication_error", None, "invalid_api_key")

    def _model(self, wanted: str | None) -> str:
        name = self.servicer.requests.limits.llm_name
        if wanted is not None and wanted != name:
            raise HttpError(404, f"the model {wanted!r} does not exist; this server serves {name!r}", "invalid_request_error", "model", "model_not_found")
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
            raise HttpError(503, "the LLM verifier is unreachable; retry later", "service_unavailable", None, "verifier_unavailable", retry_after=1)

    async def health(self, request: Request) -> Response:
        try:
            self.servicer.requests  # noqa: B018 - raises Unavailable while starting
        except Unavailable as exc:
            return JSONResponse({"status": "starting", "detail": str(exc)}, status_code=503)
        if not self.servicer.requests.scheduler.verifier_reachable:
            return JSONResponse({"status": "unavailable", "detail": "the LLM verifier is unreachable"}, status_code=503)
        if not self.servicer.requests.lease.held:
            return JSONResponse({"status": "unavailable", "detail": "this request manager does not hold its ownership lease"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        return await self._endpoint("models", request, lambda: self._models())

    async def _models(self) -> Response:
        return JSONResponse(ow.models_object(self._model(None), ow.now()))

    async def completions(self, request: Request) -> Response:
        return await self._endpoint("completions", request, lambda: self._completions(request))

    async def chat_completions(self, request: Request) -> Response:
        return await self._endpoint("chat_completions", request, lambda: self._chat(request))

    async def _completions(self, request: Request) -> Response:
        started = time.monotonic()
        body = await _json_body(request)
        return await self._generate(request, body, False, started)

    async def _chat(self, request: Request) -> Response:
        started = time.monotonic()
        body = await _json_body(request)
        messages = check_messages(body.get("messages"))
        tokenizer = self.servicer.requests.tokenizer
        if self.chat is None or tokenizer is None:
            raise InvalidArgument("messages", "this model has no chat template (tokenizer_config.json or chat_template.jinja); use /v1/completions")
        add_generation_prompt = body.get("add_generation_prompt", True)
        if not isinstance(add_generation_prompt, bool):
            raise InvalidArgument("add_generation_prompt", "must be true or false")
        text = self.chat.render(messages, add_generation_prompt)
        prompt = tokenizer.encode(text, add_special_tokens=False).ids  # the template wrote the special tokens
        if not prompt:
            raise InvalidArgument("messages", "the chat template rendered an empty prompt")
        return await self._generate(request, ow.chat_as_completion(body, prompt), True, started)

    async def _generate(self, request: Request, body: dict[str, Any], chat: bool, started: float) -> Response:
        """Admit every choice of ``body`` (a completions body), then answer: one object, or a stream."""
        params = ow.completion_params(body)
        model = self._model(params.model)
        self._check_verifier()
        requests = self.servicer.requests
        response_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        msgs = ow.generate_requests(body, params, response_id)
        lives = [build_live(m, requests.limits, requests.tokenizer, None) for m in msgs]
        echo = [self._echo_text(p) if params.echo else "" for p in params.prompts]
        prompt_tokens = [len(lives[p * params.n].request.prompt_tokens) for p in range(len(params.prompts))]
        streams = await self._start(lives)
        created = ow.now()
        if params.stream:
            chunks = self._chunks(streams, params, echo, prompt_tokens, response_id, model, created, started, chat)
            return StreamingResponse(chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        choices = await self._collect(request, streams, params, echo, started)
        build = ow.chat_object if chat else ow.completion_object
        return JSONResponse(build(response_id, model, created, choices, prompt_tokens))

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

    async def _collect(self, request: Request, streams: list[_Stream], params: ow.CompletionParams, echo: list[str], started: float) -> list[ow.Choice]:
        """Every choice to its end; the requests are cancelled if the client goes away first."""
        choices = [ow.Choice(i, text=echo[i // params.n]) for i in range(len(streams))]

        async def follow(i: int, s: _Stream) -> None:
            last = started
            event: StreamEvent | None = s.first
            async with contextlib.aclosing(s.events):
                while event is not None:
                    last = self._observe(choices[i], event, started, last)
                    event = None if event.finished is not None else await anext(s.events, None)

        work = asyncio.gather(*(follow(i, s) for i, s in enumerate(streams)))
        gone = asyncio.ensure_future(_disconnected(request))
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

    def _observe(self, choice: ow.Choice, event: StreamEvent, started: float, last: float) -> float:
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
        if event.finished is not None:
            choice.finish_reason = ow.FINISH_REASONS[event.finished.reason]
            choice.usage = _usage_proto(event)
        return now if event.tokens else last

    async def _chunks(self, streams, params, echo, prompt_tokens, response_id, model, created, started, chat: bool) -> AsyncIterator[str]:
        """Server-sent events: a chunk per event of any choice as it comes (chat: a first chunk
        with the role, content deltas, then an empty delta with the finish reason), a usage chunk
        when asked, then ``[DONE]``. Starlette cancels this generator when the client disconnects;
        the event streams close with it, which cancels the requests."""
        choices = [ow.Choice(i) for i in range(len(streams))]
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

        def chunk(i: int, text: str, finish_reason: str | None) -> str:
            if not chat:
                return _sse(ow.completion_chunk(response_id, model, created, i, text, finish_reason))
            if finish_reason is None:
                return _sse(ow.chat_chunk(response_id, model, created, i, {"content": text}, None))
            head = _sse(ow.chat_chunk(response_id, model, created, i, {"content": text}, None)) if text else ""
            return head + _sse(ow.chat_chunk(response_id, model, created, i, {}, finish_reason))

        try:
            for i in range(len(streams)):
                if chat:
                    yield _sse(ow.chat_chunk(response_id, model, created, i, {"role": "assistant", "content": ""}, None))
                elif echo[i // params.n]:
                    yield _sse(ow.completion_chunk(response_id, model, created, i, echo[i // params.n], None))
            open_choices = len(streams)
            while open_choices:
                i, item = await queue.get()
                if isinstance(item, BaseException):
                    err = http_error(item)
                    yield _sse(ow.error_object(str(err), err.kind, err.param, err.code))
                    open_choices -= 1
                    continue
                last[i] = self._observe(choices[i], item, started, last[i])
                if item.text or item.finished is not None:
                    yield chunk(i, item.text, choices[i].finish_reason)
                if item.finished is not None:
                    open_choices -= 1
            if params.include_usage:
                usage = ow.chat_usage_chunk if chat else ow.usage_chunk
                yield _sse(usage(response_id, model, created, choices, prompt_tokens))
            yield "data: [DONE]\n\n"
            self.metrics.e2e.observe(time.monotonic() - started)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def _usage_proto(event: StreamEvent) -> api_pb2.Usage:
    assert event.finished is not None
    return finish_to_proto(event.finished).usage


async def _json_body(request: Request) -> dict[str, Any]:
    """The request's JSON object; 413 past MAX_BODY_BYTES, 400 when it is not one."""
    raw = bytearray()
    seen = 0
    async for part in request.stream():
        seen += len(part)
        if seen <= MAX_BODY_BYTES:
            raw += part
        elif seen > DRAIN_BYTES:  # past this, answer at once (the client may see the connection close)
            break
    if seen > MAX_BODY_BYTES:
        # read to the end where it is not huge, so that the client, still sending, gets the answer
        raise HttpError(413, f"the body is over {MAX_BODY_BYTES} bytes", "invalid_request_error", None, "request_too_large")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise HttpError(400, "the body is not valid JSON", "invalid_request_error") from None
    if not isinstance(body, dict):
        raise HttpError(400, "the body must be a JSON object", "invalid_request_error")
    return body


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone away."""
    while not await request.is_disconnected():
        await asyncio.sleep(0.25)


class _Server(uvicorn.Server):
    """uvicorn without its own SIGINT/SIGTERM handlers: the request manager's shutdown
    (:func:`specinfer.serving.server.run_service`) owns them and stops this server itself."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class HttpServer:
    """uvicorn serving :class:`HttpApi` on the running event loop, on a socket bound at once (port 0:
    any free port, read back from :attr:`port`); TLS (and mTLS) from the same files as the gRPC port."""

    def __init__(self, api: HttpApi, host: str, port: int, security: ServerSecurity) -> None:
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
        except OSError as exc:
            self.sock.close()
            raise port_in_use("http-port", host, port, exc) from None
        self.port = self.sock.getsockname()[1]
        tls = security.tls
        ssl: dict[str, Any] = {}
        if tls.enabled:
            import ssl as ssl_module

            ssl = {"ssl_certfile": tls.cert, "ssl_keyfile": tls.key}
            if tls.client_ca:
                ssl.update(ssl_ca_certs=tls.client_ca, ssl_cert_reqs=ssl_module.CERT_REQUIRED)
        config = uvicorn.Config(api.app, log_config=None, access_log=False, lifespan="off", timeout_graceful_shutdown=5, **ssl)
        self.server = _Server(config)
        self.scheme = "https" if tls.enabled else "http"
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self.sock.listen(512)
        self._task = asyncio.get_running_loop().create_task(self.server.serve(sockets=[self.sock]))

    async def stop(self) -> None:
        if self._task is None:
            self.sock.close()
            return
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.sock.close()
