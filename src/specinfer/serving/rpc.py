"""Mapping exceptions of servicer methods onto gRPC statuses: the one place where that happens."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from specinfer.core.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted, Unavailable

log = logging.getLogger("specinfer.rpc")

Handler = TypeVar("Handler", bound=Callable[..., Any])

# The status of each domain error; their messages ("field: message") go to the client as they are.
STATUSES: dict[type[Exception], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,  # a full queue or KV pool: the caller may retry later
    Unavailable: grpc.StatusCode.UNAVAILABLE,  # e.g. a failed rank of a parallel model: another replica may answer
}


def status_of(exc: Exception) -> grpc.StatusCode:
    """The status an exception of a servicer method ends its call with (INTERNAL: a bug)."""
    for cls, code in STATUSES.items():
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


def failure_status(exc: Exception, method: str) -> tuple[grpc.StatusCode, str]:
    """The status and details a call of ``method`` that raised ``exc`` ends with; an unexpected exception (INTERNAL)
    is logged with its traceback (call this inside the ``except`` block)."""
    code = status_of(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.exception("call failed", extra={"method": method})
        return code, f"{type(exc).__name__}: {exc}"
    return code, str(exc)


async def _abort(context: grpc.aio.ServicerContext, method: Callable[..., Any], exc: Exception) -> None:
    await context.abort(*failure_status(exc, method.__name__))


def rpc_errors(method: Handler) -> Handler:
    """Wrap a servicer method (a coroutine, or an async generator for a streaming RPC) so that exceptions
    become statuses (:func:`status_of`) and never reach gRPC's own handler; an unexpected one is logged
    with its traceback. A method may still abort with a status of its own choosing."""
    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream(self, request, context: grpc.aio.ServicerContext):
            responses = method(self, request, context)
            try:
                async for response in responses:
                    yield response
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await _abort(context, method, exc)
            finally:
                await responses.aclose()  # at once, not when collected: the method's cleanup frees resources

        return stream  # type: ignore[return-value]

    @functools.wraps(method)
    async def unary(self, request, context: grpc.aio.ServicerContext):
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort(context, method, exc)

    return unary  # type: ignore[return-value]
