"""Undecodable request messages become INVALID_ARGUMENT.

gRPC's own handling of a request that protobuf cannot parse (a string field holding invalid
UTF-8, truncated bytes, wrong wire types) answers UNKNOWN, which reads like a server fault. The
interceptor here parses the request itself and answers INVALID_ARGUMENT naming the message type
and protobuf's reason, so a client knows the fault is its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError


@dataclass(frozen=True)
class BadMessage:
    """Stands in for a request that did not parse."""

    error: str


def _tolerant(deserialize):
    def parse(raw: bytes):
        try:
            return deserialize(raw)
        except DecodeError as exc:
            return BadMessage(str(exc))

    return parse


def _checked_unary(behavior):
    async def handle(request, context: grpc.aio.ServicerContext):
        if isinstance(request, BadMessage):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: not a valid message: {request.error}")
        return await behavior(request, context)

    return handle


def _checked_stream(behavior):
    async def handle(request, context: grpc.aio.ServicerContext):
        if isinstance(request, BadMessage):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: not a valid message: {request.error}")
        async for item in behavior(request, context):
            yield item

    return handle


class BadMessageInterceptor(grpc.aio.ServerInterceptor):
    """Answers INVALID_ARGUMENT for unary requests protobuf cannot parse (streamed requests pass unchanged)."""

    async def intercept_service(self, continuation, handler_call_details: grpc.HandlerCallDetails):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse, serialize = _tolerant(handler.request_deserializer), handler.response_serializer
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _checked_unary(handler.unary_unary), request_deserializer=parse, response_serializer=serialize
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _checked_stream(handler.unary_stream), request_deserializer=parse, response_serializer=serialize
            )
        return handler
