"""Unary calls sent over one long-lived gRPC stream (:class:`StreamedUnary`): the request manager's verify calls.

Why: on the 2-core VMs of BENCHMARKS.md a unary call's round trip costs about 1 ms of gRPC's own work whatever it
carries (a new HTTP/2 stream, its headers and trailers, several thread hand-offs on each side), and a message on an
open bidirectional stream about half that; a one-token step makes one verify call, so this is a fixed cost of
every step through the services.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc

from specinfer.serving.security import ClientAuth
from specinfer.serving.socket_calls import SocketUnary, call_error

log = logging.getLogger("specinfer.request_manager")

RETRY_AFTER_CALLS = 256  # unary calls after a new stream was refused with a status other than UNIMPLEMENTED


class _Refused(Exception):
    """A new stream ended before its first request went out. An older server's UNIMPLEMENTED can surface so, as
    INTERNAL ("Failed execute_batch"), when its status lands before the write: the call then goes unary, which
    answers with its own status."""

    def __init__(self, code: grpc.StatusCode | None) -> None:
        super().__init__(code)
        self.code = code


class StreamedUnary:
    """A unary method's calls, one at a time, each the next request on one bidirectional stream of the same
    messages (``stream_method``, whose server answers each request with one response, in order) and the stream's
    next response. A call behaves as the unary call would: it raises :class:`grpc.aio.AioRpcError` with the status the
    server ended the stream with (then the next call opens a new stream), DEADLINE_EXCEEDED after ``timeout`` seconds
    (the stream is cancelled), and a server without the stream method (UNIMPLEMENTED: an older release) gets the
    unary call (``unary_method``) from then on; a new stream that ended before its first request went out with
    another status (:class:`_Refused`) sends the call, and the next :data:`RETRY_AFTER_CALLS`, unary.
    ``metadata``: every stream's and call's (credentials)."""

    def __init__(
        self, stream_method: Callable[..., Any], unary_method: Callable[..., Any], metadata: Sequence[tuple[str, str]]
    ) -> None:
        self._open = stream_method
        self._unary = unary_method
        self._metadata = metadata
        self._call: Any = (
            None  # the open stream (grpc.aio.StreamStreamCall), None before the first call or after an error
        )
        self._lock = asyncio.Lock()  # one exchange at a time: responses come in request order
        self.streams = True  # False once the server said it has no stream method (or refused a new stream)
        self._unary_left: int | None = None  # unary calls before a refused stream is tried again (None: never)

    async def __call__(self, request: Any, timeout: float) -> Any:
        if not self.streams:
            if self._unary_left is not None:
                self._unary_left -= 1
                self.streams = self._unary_left <= 0
            return await self._unary(request, timeout=timeout, metadata=self._metadata)
        async with self._lock:
            try:
                async with asyncio.timeout(timeout):  # not wait_for: its task costs the step a turn of the loop
                    return await self._exchange(request)
            except TimeoutError:
                self.close()
                raise call_error(grpc.StatusCode.DEADLINE_EXCEEDED, f"no response within {timeout} s") from None
            except grpc.aio.AioRpcError as exc:
                self.close()
                if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                self.streams = False
            except _Refused as exc:
                self.close()
                self.streams = False  # unary for now; UNIMPLEMENTED for good, another status for a while
                self._unary_left = None if exc.code == grpc.StatusCode.UNIMPLEMENTED else RETRY_AFTER_CALLS
            except BaseException:  # cancelled: the stream may hold an unread response
                self.close()
                raise
        return await self._unary(request, timeout=timeout, metadata=self._metadata)

    async def _exchange(self, request: Any) -> Any:
        fresh = self._call is None
        if fresh:
            self._call = self._open(metadata=self._metadata)  # no deadline: the stream outlives each call's
        try:
            await self._call.write(request)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:  # the stream had already ended
            if fresh:
                raise _Refused(exc.code() if isinstance(exc, grpc.aio.AioRpcError) else None) from exc
            if isinstance(exc, grpc.aio.AioRpcError):
                raise
            raise call_error(grpc.StatusCode.UNAVAILABLE, "the stream ended") from exc
        response = await self._call.read()
        if response is grpc.aio.EOF:  # the server ended the stream without an error status (it should not)
            raise call_error(grpc.StatusCode.UNAVAILABLE, "the stream ended")
        return response

    def close(self) -> None:
        """End the open stream, if any (the replica left, or the stream failed)."""
        if self._call is not None:
            self._call.cancel()
            self._call = None


def stream_calls(
    stream_method: Callable[..., Any],
    unary_method: Callable[..., Any],
    auth: ClientAuth,
    address: str,
    socket_port: int,
    response_type: Any,
    ask_port: AskPort,
    tls_name: str = "",
) -> StreamedUnary | SocketFirst:
    """A replica's calls of one method: over its socket where it has one (``socket_port``, on ``address``'s host;
    ``ask_port``: how to learn the port again), falling back to gRPC's stream (``stream_method``, or
    ``unary_method`` for an older server); else the stream."""
    calls = StreamedUnary(stream_method, unary_method, auth.metadata)
    if not socket_port:
        return calls
    host = address.rpartition(":")[0].strip("[]")
    return SocketFirst(SocketUnary(host, socket_port, response_type, auth, tls_name), calls, ask_port)


AskPort = Callable[[float], Awaitable[int]]  # the replica's socket port now, asked over gRPC within a timeout


class SocketFirst:
    """A replica's calls over its socket (:class:`~specinfer.serving.socket_calls.SocketUnary`, cheaper per message
    than gRPC's stream), else over ``fallback``. Where a connection cannot be opened, the replica is asked for its
    socket's port again (``ask_port``): a restarted one listens on another (a free port by default), and the call
    goes there; one without a socket now, or whose port was never reached (a firewall or a network policy that
    lets only the gRPC port through), gets its calls over ``fallback`` from then on. A replica that does not
    answer the question fails the call as the socket did (it is down)."""

    def __init__(self, socket: SocketUnary, fallback: StreamedUnary, ask_port: AskPort) -> None:
        self.socket: SocketUnary | None = socket
        self.fallback = fallback
        self._ask_port = ask_port

    async def __call__(self, request: Any, timeout: float) -> Any:
        if self.socket is not None:
            try:
                return await self.socket(request, timeout)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or not self.socket.unopened:
                    raise
                try:
                    port = await self._ask_port(timeout)
                except grpc.aio.AioRpcError:
                    raise exc from None  # down: the call fails as it would over gRPC
                if port and port != self.socket.port:  # restarted: its socket moved
                    log.info(
                        "the socket moved", extra={"address": f"{self.socket.host}:{self.socket.port}", "port": port}
                    )
                    self.socket = self.socket.moved(port)
                    return await self.socket(request, timeout)
                if port and self.socket.reached:  # the same port, which answered before: a fault of this call
                    raise
                log.warning(
                    "the socket is unreachable or gone; calls go over gRPC",
                    extra={"address": f"{self.socket.host}:{self.socket.port}", "details": exc.details()},
                )
                self.socket = None
        return await self.fallback(request, timeout)

    def close(self) -> None:
        if self.socket is not None:
            self.socket.close()
        self.fallback.close()
