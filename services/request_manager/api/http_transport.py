"""The HTTP transport of the request manager's OpenAI-compatible API (:mod:`.http_api` holds the
endpoints): its metrics, OpenAI error objects for core errors, request bodies with a size bound,
server-sent events, and the uvicorn server on the request manager's own event loop."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from typing import Any

import uvicorn
from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse

from specinfer.core.errors import FieldError, InvalidArgument, ResourceExhausted, Unavailable
from specinfer.request_manager.api import openai_objects as oo
from specinfer.request_manager.api import openai_wire as ow
from specinfer.serving.config import port_in_use
from specinfer.serving.security import ServerSecurity

log = logging.getLogger("specinfer.request_manager.http")

MAX_BODY_BYTES = 4 << 20  # a request body larger than this is refused (413), not kept nor parsed
DRAIN_BYTES = 64 << 20  # an oversized body is read (and dropped) up to this, so that its sender gets the 413
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class HttpMetrics:
    """Latency as clients of the HTTP API see it, and its requests by status."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "specinfer_http_requests",
            "HTTP API requests by endpoint and status code",
            ["endpoint", "status"],
            registry=registry,
        )
        self.ttft = Histogram(
            "specinfer_time_to_first_token_seconds",
            "From an HTTP request to its first token",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.itl = Histogram(
            "specinfer_inter_token_latency_seconds",
            "Time between a choice's token arrivals over HTTP, per token",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            "specinfer_e2e_request_latency_seconds",
            "Time from an HTTP request to its last token",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )


class HttpError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.kind, self.param, self.code, self.retry_after = status, kind, param, code, retry_after

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(max(1, round(self.retry_after)))} if self.retry_after is not None else None
        return JSONResponse(
            oo.error_object(str(self), self.kind, self.param, self.code), status_code=self.status, headers=headers
        )


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


async def json_body(request: Request) -> dict[str, Any]:
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
        raise HttpError(
            413, f"the body is over {MAX_BODY_BYTES} bytes", "invalid_request_error", None, "request_too_large"
        )
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise HttpError(400, "the body is not valid JSON", "invalid_request_error") from None
    if not isinstance(body, dict):
        raise HttpError(400, "the body must be a JSON object", "invalid_request_error")
    return body


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def disconnected(request: Request) -> None:
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
    """uvicorn serving ``app`` (:class:`.http_api.HttpApi`'s) on the running event loop, on a socket bound at once
    (port 0: any free port, read back from :attr:`port`); TLS (and mTLS) from the same files as the gRPC port."""

    def __init__(self, app: Starlette, host: str, port: int, security: ServerSecurity) -> None:
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
        config = uvicorn.Config(
            app, log_config=None, access_log=False, lifespan="off", timeout_graceful_shutdown=5, **ssl
        )
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
