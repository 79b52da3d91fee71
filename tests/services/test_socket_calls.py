"""The verify socket's transport (specinfer/serving/socket_calls.py) on its own, in process: calls answered in
order over one connection, the statuses a failed call, a timeout, a wrong token, bad frames and a stopping server
end a connection with, TLS and mTLS with deploy/tls/make-certs.sh's certificates. Against the real verifier:
tests/services/test_llm_verifier.py and (TLS, tokens) tests/deploy/test_compose.py."""

from __future__ import annotations

import asyncio
import shutil
import socket
import struct

import grpc
import pytest

from specinfer.core import InvalidArgument
from specinfer.serving.metrics import ServiceMetrics
from specinfer.serving.security import ClientAuth, ClientTls, ServerSecurity, ServerTls
from specinfer.serving.socket_calls import CODE, CODES, HELLO, MESSAGE, STATUS, SocketServer, SocketUnary, frame
from specinfer.v1 import internal_pb2

# a message type with a repeated string: requests and responses of the test handler
Message = internal_pb2.ReleaseRequest


class Handler:
    """Answers each request with its IDs reversed; an ID names what to do instead: ``invalid`` (INVALID_ARGUMENT),
    ``bug`` (an unexpected exception), ``slow`` (sleep 1 s first)."""

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, data: bytes) -> bytes:
        self.calls += 1
        ids = list(Message.FromString(data).request_ids)
        if "invalid" in ids:
            raise InvalidArgument("request_ids[0]", "is invalid")
        if "bug" in ids:
            raise RuntimeError("a bug")
        if "slow" in ids:
            await asyncio.sleep(1.0)
        return Message(request_ids=ids[::-1]).SerializeToString()


def request(*ids: str) -> Message:
    return Message(request_ids=list(ids))


async def started(security: ServerSecurity | None = None) -> tuple[SocketServer, Handler, ServiceMetrics]:
    handler, metrics = Handler(), ServiceMetrics("test")
    server = SocketServer(handler, "VerifySocket", security or ServerSecurity(), metrics, 0, "socket-port")
    await server.start("127.0.0.1")
    return server, handler, metrics


def calls_counted(metrics: ServiceMetrics, code: str) -> float:
    value = metrics.registry.get_sample_value(
        "specinfer_grpc_server_handling_seconds_count", {"service": "test", "method": "VerifySocket", "code": code}
    )
    return value or 0.0


def test_calls_answer_in_order_and_errors_end_the_connection_with_their_status():
    async def scenario():
        server, _handler, metrics = await started()
        call = SocketUnary("127.0.0.1", server.port, Message, ClientAuth())
        assert not call.reached
        for i in range(3):
            assert list((await call(request(f"a{i}", f"b{i}"), 5)).request_ids) == [f"b{i}", f"a{i}"]
        assert call.reached and calls_counted(metrics, "OK") == 3
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(request("invalid"), 5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_ids[0]" in err.value.details()
        assert calls_counted(metrics, "INVALID_ARGUMENT") == 1
        assert list((await call(request("x", "y"), 5)).request_ids) == ["y", "x"]  # a new connection
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(request("bug"), 5)
        assert err.value.code() == grpc.StatusCode.INTERNAL and "RuntimeError: a bug" in err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(request("slow"), 0.2)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert list((await call(request("after"), 5)).request_ids) == ["after"]
        call.close()
        await server.stop(1.0)
        with pytest.raises(grpc.aio.AioRpcError) as err:  # nothing listens any more
            await call(request("gone"), 5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE

    asyncio.run(scenario())


def test_a_stopping_server_answers_the_call_in_progress_then_closes():
    async def scenario():
        server, _handler, _metrics = await started()
        idle = SocketUnary("127.0.0.1", server.port, Message, ClientAuth())
        busy = SocketUnary("127.0.0.1", server.port, Message, ClientAuth())
        await idle(request("warm"), 5)
        await busy(request("warm"), 5)
        in_progress = asyncio.ensure_future(busy(request("slow", "z"), 5))
        await asyncio.sleep(0.2)
        await server.stop(5.0)
        assert list((await in_progress).request_ids) == ["z", "slow"]  # within the grace
        for call in (idle, busy):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(request("next"), 5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE

    asyncio.run(scenario())


def test_a_server_with_tokens_refuses_a_missing_or_wrong_one():
    async def scenario():
        server, handler, _metrics = await started(ServerSecurity(tokens=("s3cret", "other")))
        for token in ("", "wrong"):
            call = SocketUnary("127.0.0.1", server.port, Message, ClientAuth(token=token))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(request("a"), 5)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and "token" in err.value.details()
        assert handler.calls == 0
        for token in ("s3cret", "other"):
            call = SocketUnary("127.0.0.1", server.port, Message, ClientAuth(token=token))
            assert list((await call(request("a", "b"), 5)).request_ids) == ["b", "a"]
            call.close()
        await server.stop(1.0)

    asyncio.run(scenario())


def raw_exchange(port: int, data: bytes) -> tuple[int, grpc.StatusCode | None, str]:
    """Send ``data`` on a new connection; the kind of the frame the server answers and, for a STATUS, its code and
    details."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(data)
        answer = b""
        while len(answer) < 5 or len(answer) < 5 + struct.unpack(">I", answer[:4])[0]:
            chunk = conn.recv(65536)
            if not chunk:
                break
            answer += chunk
    kind = answer[4]
    if kind != STATUS:
        return kind, None, ""
    code = CODES[CODE.unpack_from(answer, 5)[0]]
    return kind, code, answer[5 + CODE.size :].decode()


def test_bad_frames_get_a_status_naming_what_was_wrong():
    async def scenario():
        server, handler, _metrics = await started()
        port = server.port
        loop = asyncio.get_running_loop()
        no_hello = await loop.run_in_executor(None, raw_exchange, port, frame(MESSAGE, b""))
        assert no_hello[1] == grpc.StatusCode.INVALID_ARGUMENT and "HELLO" in no_hello[2]
        huge = await loop.run_in_executor(None, raw_exchange, port, frame(HELLO, b"") + struct.pack(">IB", 1 << 30, 1))
        assert huge[1] == grpc.StatusCode.RESOURCE_EXHAUSTED and "exceeds" in huge[2]
        bad_kind = await loop.run_in_executor(None, raw_exchange, port, frame(HELLO, b"") + frame(7, b""))
        assert bad_kind[1] == grpc.StatusCode.INVALID_ARGUMENT and "kind 7" in bad_kind[2]
        good = await loop.run_in_executor(
            None, raw_exchange, port, frame(HELLO, b"") + frame(MESSAGE, request("q").SerializeToString())
        )
        assert good[0] == MESSAGE and handler.calls == 1
        await server.stop(1.0)

    asyncio.run(scenario())


@pytest.mark.skipif(not shutil.which("openssl"), reason="deploy/tls/make-certs.sh needs openssl")
def test_tls_and_mtls_with_the_deployments_certificates(tmp_path):
    from deploy.artifacts import make_certs  # tests/deploy/artifacts.py

    certs = make_certs(tmp_path / "tls")
    ca, cert, key = str(certs / "ca.crt"), str(certs / "llm-verifier.crt"), str(certs / "llm-verifier.key")
    client = ClientTls.from_files(ca, str(certs / "request-manager.crt"), str(certs / "request-manager.key"))

    async def scenario():
        server, _handler, _metrics = await started(ServerSecurity(ServerTls(cert, key, ca)))
        call = SocketUnary("127.0.0.1", server.port, Message, ClientAuth(client))
        assert list((await call(request("a", "b"), 5)).request_ids) == ["b", "a"]
        call.close()
        for auth in (ClientAuth(), ClientAuth(ClientTls.from_files(ca))):  # plaintext; no client certificate
            refused = SocketUnary("127.0.0.1", server.port, Message, auth)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await refused(request("a"), 5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        await server.stop(1.0)

    asyncio.run(scenario())
