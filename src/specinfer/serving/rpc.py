"""Mapping exceptions of servicer methods onto gRPC statuses."""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from specinfer.core import InvalidArgument
from specinfer.models.native.kv_pool import KVCacheFull
from specinfer.models.native.parallel.driver import RankFailure

log = logging.getLogger("specinfer.rpc")

Handler = TypeVar("Handler", bound=Callable[..., Awaitable[Any]])


def rpc_errors(method: Handler) -> Handler:
    """Wrap a servicer method so that exceptions become statuses and never reach gRPC's own
    handler: :class:`InvalidArgument` -> INVALID_ARGUMENT ("field: message"), a full KV pool ->
    RESOURCE_EXHAUSTED (the caller may retry with fewer requests), a failed rank of a parallel
    model -> UNAVAILABLE (the service is going down; another replica may answer), anything else -> INTERNAL
    (logged with its traceback)."""

    @functools.wraps(method)
    async def wrapper(self, request, context: grpc.aio.ServicerContext):
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise  # the method aborted with a status of its own choosing
        except InvalidArgument as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except KVCacheFull as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except RankFailure as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except Exception as exc:
            log.exception("call failed", extra={"method": method.__name__})
            await context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")

    return wrapper  # type: ignore[return-value]
