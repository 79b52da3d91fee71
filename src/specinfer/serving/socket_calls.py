"""Unary calls over one TCP connection of length-prefixed protobuf frames: the request manager's per-step calls.

Why: gRPC Python's asyncio stack hands every message between three threads of each process (its event engine's
poller, the completion-queue poller and the event loop). On the 2-core VMs of BENCHMARKS.md, where the LLM
verifier's OpenMP worker then held one core between steps, a verify message took 0.25-0.57 ms one way over gRPC's
stream, where asyncio's own sockets wake one thread (a round trip of ~0.1 ms whether a core is busy or not); the
bundled demo's incremental step through the services was ~0.4 ms shorter over this socket (BENCHMARKS.md, "The
model services' sockets"). The verifier's Verify and the SSM workers' Speculate calls go this way; every other
call, health and reflection stay on gRPC. A model service says its socket's port in ``GetInfo`` or
``ListModels`` (``socket_port``; 0: it has none), and the request manager falls back to gRPC's stream where that
port cannot be reached.

Frames: a header of 5 bytes, the payload's length (unsigned 32-bit, big-endian) and its kind, then the payload:

- ``HELLO``: the client's first frame, the bearer token (UTF-8; empty: none). A server with tokens answers a
  missing or wrong one with UNAUTHENTICATED.
- ``MESSAGE``: one serialized protobuf message. The server answers each request with one response, in order.
- ``STATUS``: the server's last frame, a status code (unsigned 16-bit, gRPC's numbering) and its details (UTF-8);
  the server then closes the connection, as a gRPC stream ends with its status. A call that gets it raises
  :class:`grpc.aio.AioRpcError` with that status, as the gRPC call would.

The connection is TLS where the service's gRPC port is (the same files; mTLS where that asks for client
certificates).
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from specinfer.core.errors import InvalidArgument
from specinfer.serving.metrics import ServiceMetrics
from specinfer.serving.rpc import failure_status
from specinfer.serving.security import ClientAuth, ServerSecurity, token_matches
from specinfer.serving.server import MAX_MESSAGE_BYTES

HEADER = struct.Struct(">IB")  # payload length, kind
CODE = struct.Struct(">H")  # a STATUS frame's code, before its details
HELLO, MESSAGE, STATUS = 0, 1, 2
CONNECT_SECONDS = 5.0  # at most, opening a connection (TLS included) within a call's own timeout

Handler = Callable[[bytes], Awaitable[bytes]]


def frame(kind: int, payload: bytes) -> bytes:
    return HEADER.pack(len(payload), kind) + payload


async def read_frame(reader: asyncio.StreamReader, max_bytes: int) -> tuple[int, bytes] | None:
    """The next frame's kind and payload; None at a clean end of the stream (between frames). Raises
    :class:`ValueError` for a frame larger than ``max_bytes`` and :class:`asyncio.IncompleteReadError` for a
    stream cut inside one."""
    try:
        header = await reader.readexactly(HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise
    length, kind = HEADER.unpack(header)
    if length > max_bytes:
        raise ValueError(f"a frame of {length} bytes exceeds the limit of {max_bytes}")
    return kind, await reader.readexactly(length)


def call_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The error a gRPC call with that status raises (what this module's and the gRPC streams' calls raise)."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


CODES = {code.value[0]: code for code in grpc.StatusCode}


class SocketServer:
    """Serves one method's calls (``handle``: request bytes to response bytes; an exception ends the connection
    with the status :func:`~specinfer.serving.rpc.failure_status` gives it) on TCP port ``asked_port`` (0: a free
    one; ``setting``: the flag that set it, named where it cannot be bound), timed in ``metrics`` as gRPC's calls
    are (``method``: its label there)."""

    def __init__(
        self,
        handle: Handler,
        method: str,
        security: ServerSecurity,
        metrics: ServiceMetrics,
        asked_port: int,
        setting: str,
    ) -> None:
        self._handle = handle
        self.asked_port = asked_port
        self.setting = setting
        self.method = method
        self._security = security
        self._tokens = [t.encode() for t in security.tokens]
        self._metrics = metrics
        self.port: int | None = None  # once started
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[Any]] = set()
        self._waiting: set[asyncio.Task[Any]] = set()  # connections between calls (cancelled at once on stop)
        self._stopping = False

    async def start(self, host: str) -> int:
        """Listen on ``host``; returns the port. Raises :class:`OSError` when the bind fails."""
        self._server = await asyncio.start_server(
            self._serve, host, self.asked_port, ssl=self._security.tls.ssl_context()
        )
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self, grace: float) -> None:
        """Stop listening; calls in progress get ``grace`` seconds to answer, then every connection closes with
        UNAVAILABLE (the caller retries on another replica, or on this one once it is back)."""
        self._stopping = True
        if self._server is None:
            return
        self._server.close()
        for task in list(self._waiting):
            task.cancel()
        if self._connections:
            _done, late = await asyncio.wait(list(self._connections), timeout=grace)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        with contextlib.suppress(Exception):
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        status: tuple[grpc.StatusCode, str] | None = (grpc.StatusCode.UNAVAILABLE, "the server is stopping")
        try:
            status = await self._calls(task, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            status = None  # the client went away mid-frame: nobody to tell
        except ValueError as exc:  # an oversized frame
            status = (grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except asyncio.CancelledError:
            pass  # stopping: the status above
        finally:
            self._connections.discard(task)
            with contextlib.suppress(Exception):
                if status is not None:
                    code, details = status
                    writer.write(frame(STATUS, CODE.pack(code.value[0]) + details.encode()))
                writer.close()

    async def _calls(
        self, task: asyncio.Task[Any], reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> tuple[grpc.StatusCode, str] | None:
        """Serve the connection's calls; the status to end it with (None: the client closed it)."""
        hello = await read_frame(reader, MAX_MESSAGE_BYTES)
        if hello is None:
            return None
        if hello[0] != HELLO:
            return grpc.StatusCode.INVALID_ARGUMENT, "the first frame must be HELLO"
        if self._tokens and not token_matches(hello[1], self._tokens):
            return grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token (the HELLO frame)"
        while not self._stopping:
            self._waiting.add(task)
            try:
                got = await read_frame(reader, MAX_MESSAGE_BYTES)
            finally:
                self._waiting.discard(task)
            if got is None:
                return None
            kind, payload = got
            if kind != MESSAGE:
                return grpc.StatusCode.INVALID_ARGUMENT, f"a frame of kind {kind} where a request was expected"
            self._metrics.grpc_started.labels(self._metrics.service, self.method).inc()
            started = time.perf_counter()
            try:
                response = await self._handle(payload)
            except Exception as exc:
                code, details = failure_status(exc, self.method)
                self._metrics.observe_call(self._metrics.service, self.method, code, time.perf_counter() - started)
                return code, details
            self._metrics.observe_call(
                self._metrics.service, self.method, grpc.StatusCode.OK, time.perf_counter() - started
            )
            writer.write(frame(MESSAGE, response))
            await writer.drain()
        return grpc.StatusCode.UNAVAILABLE, "the server is stopping"


def proto_handler(request_type: Any, handle: Callable[[Any], Awaitable[Any]]) -> Handler:
    """A :class:`SocketServer` handler of ``handle``'s messages: the request's bytes parsed as ``request_type``
    (bytes that are none: INVALID_ARGUMENT naming ``request``), its answer serialized."""

    async def bytes_handler(data: bytes) -> bytes:
        try:
            request = request_type.FromString(data)
        except DecodeError as exc:
            raise InvalidArgument("request", f"not a {request_type.DESCRIPTOR.name} ({exc})") from None
        return (await handle(request)).SerializeToString()

    return bytes_handler


def model_sockets(
    make: Callable[[ServerSecurity, ServiceMetrics, int], SocketServer],
    port: int,
    security: ServerSecurity,
    metrics: ServiceMetrics,
) -> list[SocketServer]:
    """A model service's socket beside its gRPC port, made by its servicer (``make``) on ``port`` (the
    ``--socket-port`` setting); none for -1."""
    return [] if port < 0 else [make(security, metrics, port)]


class SocketUnary:
    """Calls of one method, one at a time, over one connection to ``host:port`` (opened at the first call, and
    again after an error), each answered by a ``response_type`` message. A call behaves as the gRPC call would: it
    raises :class:`grpc.aio.AioRpcError` with the server's status, UNAVAILABLE where the connection fails or closes,
    and DEADLINE_EXCEEDED after its ``timeout``. ``auth``: TLS and the bearer token; ``tls_name``: the name the
    server's certificate must carry where it is not ``host``. ``reached``: whether a connection was ever opened;
    ``unopened``: whether the last call failed before one was (nothing listens there, or TLS refused it)."""

    def __init__(self, host: str, port: int, response_type: Any, auth: ClientAuth, tls_name: str = "") -> None:
        self.host, self.port = host, port
        self._response_type = response_type
        self._auth = auth
        self._tls_name = tls_name
        self._lock = asyncio.Lock()  # one exchange at a time: responses come in request order
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self.reached = False
        self.unopened = False

    def moved(self, port: int) -> SocketUnary:
        """The same calls to another port of the same host (a restarted server's)."""
        self.close()
        return SocketUnary(self.host, port, self._response_type, self._auth, self._tls_name)

    async def __call__(self, request: Any, timeout: float) -> Any:
        async with self._lock:
            try:
                async with asyncio.timeout(timeout):  # not wait_for: its task costs the call a turn of the loop
                    return await self._exchange(request, timeout)
            except TimeoutError:
                self.close()
                raise call_error(grpc.StatusCode.DEADLINE_EXCEEDED, f"no response within {timeout} s") from None
            except (OSError, asyncio.IncompleteReadError, ValueError) as exc:  # ssl.SSLError is an OSError
                self.close()
                raise call_error(grpc.StatusCode.UNAVAILABLE, f"{self.host}:{self.port}: {exc}") from exc
            except BaseException:  # an error status, or cancelled: the connection may hold an unread response
                self.close()
                raise

    async def _exchange(self, request: Any, timeout: float) -> Any:
        self.unopened = self._writer is None
        if self._writer is None:
            try:
                async with asyncio.timeout(min(timeout, CONNECT_SECONDS)):
                    self._reader, self._writer = await asyncio.open_connection(
                        self.host,
                        self.port,
                        ssl=self._auth.tls.ssl_context(),
                        server_hostname=(self._tls_name or self.host) if self._auth.tls.enabled else None,
                    )
            except TimeoutError as exc:  # an unreachable port, not a slow call
                raise ConnectionError(f"no connection within {min(timeout, CONNECT_SECONDS)} s") from exc
            self.reached, self.unopened = True, False
            self._writer.write(frame(HELLO, self._auth.token.encode()))
        assert self._reader is not None
        self._writer.write(frame(MESSAGE, request.SerializeToString()))
        got = await read_frame(self._reader, MAX_MESSAGE_BYTES)
        if got is None:
            raise ConnectionError("the server closed the connection")
        kind, payload = got
        if kind == STATUS:
            code = CODES.get(CODE.unpack_from(payload)[0], grpc.StatusCode.UNKNOWN)
            raise call_error(code, payload[CODE.size :].decode(errors="replace"))
        if kind != MESSAGE:
            raise ValueError(f"a frame of kind {kind} where a response was expected")
        return self._response_type.FromString(payload)

    def close(self) -> None:
        """Close the connection, if any (the next call opens another)."""
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None
