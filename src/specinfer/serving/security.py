"""Transport security and bearer tokens for every gRPC port.

Server side, a service with ``--tls-cert``/``--tls-key`` listens with TLS; with ``--tls-client-ca``
as well it requires client certificates signed by that CA (mTLS). A bearer token (the request
manager's ``--auth-token`` for the public API, every service's ``--internal-token`` for calls
between services) makes the server refuse calls without ``authorization: Bearer <token>`` with
UNAUTHENTICATED. ``grpc.health.v1.Health`` stays open: load balancers, container and Kubernetes
probes check health without credentials, and health reveals nothing but SERVING/NOT_SERVING.
Reflection is not open: it describes the API, which callers without the token need not see.

Client side (request manager -> workers and verifier, :class:`specinfer.client.Client` -> request
manager, health probes) ``--tls-ca`` trusts the servers' CA and ``--tls-client-cert``/``--tls-client-key``
present a client certificate. Secrets are never logged: the dataclasses hide them in ``repr``.

A local stack (``specinfer up``, :class:`specinfer.launcher.Stack`) holds its files and tokens in
:class:`StackSecurity`, which hands them to each process as SPECINFER_* environment variables.

This module imports only grpc (no numpy, no torch): the health probe uses it.
"""

from __future__ import annotations

import hmac
import os
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

AUTHORIZATION = "authorization"
# methods callable without a token (see the module docstring for why)
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{what}: cannot read {path!r}: {exc.strerror}") from None


def read_token(token: str, token_file: str, what: str) -> str:
    """The token given directly or in a file (first line, stripped); empty: no token. Giving both is an error."""
    if token and token_file:
        raise ValueError(f"{what}: give the token or the token file, not both")
    if token_file:
        token = _read(token_file, f"{what}-file").decode().strip()
        if not token:
            raise ValueError(f"{what}-file: {token_file!r} is empty")
    return token


def _check_pair(cert: str, key: str, names: str) -> None:
    """A certificate and its private key are given together or not at all."""
    if bool(cert) != bool(key):
        raise ValueError(f"{names} go together")


@dataclass(frozen=True)
class ServerTls:
    """Files of a TLS server: certificate chain and key (PEM); ``client_ca`` set: mTLS."""

    cert: str = ""
    key: str = ""
    client_ca: str = ""

    def __post_init__(self) -> None:
        _check_pair(self.cert, self.key, "tls-cert and tls-key")
        if self.client_ca and not self.cert:
            raise ValueError("tls-client-ca (mTLS) needs tls-cert and tls-key")

    @property
    def enabled(self) -> bool:
        return bool(self.cert)

    def credentials(self) -> grpc.ServerCredentials | None:
        """Server credentials, or None for a plaintext port."""
        if not self.enabled:
            return None
        pair = (_read(self.key, "tls-key"), _read(self.cert, "tls-cert"))
        if self.client_ca:
            return grpc.ssl_server_credentials(
                [pair], root_certificates=_read(self.client_ca, "tls-client-ca"), require_client_auth=True
            )
        return grpc.ssl_server_credentials([pair])

    def ssl_context(self) -> ssl.SSLContext | None:
        """The same TLS for a plain socket (:mod:`specinfer.serving.socket_calls`), or None for plaintext."""
        if not self.enabled:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.cert, self.key)
        if self.client_ca:
            context.load_verify_locations(self.client_ca)
            context.verify_mode = ssl.CERT_REQUIRED
        return context


@dataclass(frozen=True)
class ClientTls:
    """Files of a TLS client: the CA that signed the servers (empty: the system's roots) and an
    optional client certificate and key for mTLS. ``enabled`` False: plaintext channels."""

    enabled: bool = False
    ca: str = ""
    cert: str = ""
    key: str = ""

    def __post_init__(self) -> None:
        _check_pair(self.cert, self.key, "tls-client-cert and tls-client-key")

    @staticmethod
    def from_files(ca: str = "", cert: str = "", key: str = "") -> ClientTls:
        """TLS when any file is given, plaintext otherwise."""
        return ClientTls(bool(ca or cert or key), ca, cert, key)

    def credentials(self) -> grpc.ChannelCredentials | None:
        if not self.enabled:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca, "tls-ca") if self.ca else None,
            private_key=_read(self.key, "tls-client-key") if self.key else None,
            certificate_chain=_read(self.cert, "tls-client-cert") if self.cert else None,
        )

    def ssl_context(self) -> ssl.SSLContext | None:
        """The same TLS for a plain socket (:mod:`specinfer.serving.socket_calls`), or None for plaintext."""
        if not self.enabled:
            return None
        context = ssl.create_default_context(cafile=self.ca or None)
        if self.cert:
            context.load_cert_chain(self.cert, self.key)
        return context


@dataclass(frozen=True)
class ClientAuth:
    """How a client reaches a server: TLS files and the bearer token it sends (empty: none)."""

    tls: ClientTls = field(default_factory=ClientTls)
    token: str = field(default="", repr=False)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata to send with every call."""
        return ((AUTHORIZATION, f"Bearer {self.token}"),) if self.token else ()

    def channel(self, address: str, options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
        """A blocking channel to ``address``, TLS when configured."""
        creds = self.tls.credentials()
        return (
            grpc.secure_channel(address, creds, options=list(options))
            if creds
            else grpc.insecure_channel(address, options=list(options))
        )

    def aio_channel(
        self, address: str, options: Sequence[tuple[str, object]] = (), tls_name: str = ""
    ) -> grpc.aio.Channel:
        """An asyncio channel to ``address``, TLS when configured. ``tls_name``: the name the server's
        certificate must carry when it is not ``address``'s host (an IP found by a DNS lookup of that name)."""
        creds = self.tls.credentials()
        if not creds:
            return grpc.aio.insecure_channel(address, options=list(options))
        override = [("grpc.ssl_target_name_override", tls_name)] if tls_name else []
        return grpc.aio.secure_channel(address, creds, options=[*options, *override])


def _deny(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that answers UNAUTHENTICATED without reading the request."""

    async def unary(request, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def stream(request, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover (abort raises); makes this an async generator

    ignore: Callable[[bytes], None] = lambda _raw: None  # noqa: E731 (the payload of a refused call is never parsed)
    serialize = handler.response_serializer
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary, request_deserializer=ignore, response_serializer=serialize)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(stream, request_deserializer=ignore, response_serializer=serialize)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary, request_deserializer=ignore, response_serializer=serialize)
    return grpc.stream_stream_rpc_method_handler(stream, request_deserializer=ignore, response_serializer=serialize)


def token_matches(given: bytes, expected: Sequence[bytes]) -> bool:
    """Whether ``given`` is one of ``expected``: compare_digest against every one, without stopping early, so that
    timing reveals nothing (the gRPC ports' bearer tokens and the sockets' HELLO frames)."""
    return sum(hmac.compare_digest(given, want) for want in expected) > 0


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but health checks unless it carries ``authorization: Bearer <one of tokens>``."""

    def __init__(self, tokens: Sequence[str]) -> None:
        if not tokens or not all(tokens):
            raise ValueError("BearerTokenInterceptor needs non-empty tokens")
        self._expected = [f"Bearer {t}".encode() for t in tokens]

    def allows(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
        given = [v if isinstance(v, bytes) else v.encode() for k, v in (metadata or ()) if k == AUTHORIZATION]
        return len(given) == 1 and token_matches(given[0], self._expected)

    async def intercept_service(self, continuation, handler_call_details: grpc.HandlerCallDetails):
        handler = await continuation(handler_call_details)
        if (
            handler is None
            or handler_call_details.method.startswith(OPEN_PREFIXES)
            or self.allows(handler_call_details.invocation_metadata)
        ):
            return handler
        return _deny(handler, "missing or wrong bearer token (metadata 'authorization: Bearer <token>')")


@dataclass(frozen=True)
class ServerSecurity:
    """What a service's port requires: TLS files and the bearer tokens it accepts (any of them)."""

    tls: ServerTls = field(default_factory=ServerTls)
    tokens: tuple[str, ...] = field(default=(), repr=False)

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [BearerTokenInterceptor(self.tokens)] if self.tokens else []


def env_or(name: str, default: str = "") -> str:
    """``SPECINFER_<name>`` from the environment (for the health probe, which has no settings parser)."""
    return os.environ.get(f"SPECINFER_{name}", default)


@dataclass(frozen=True)
class StackSecurity:
    """TLS files and tokens of a local stack. ``cert``/``key``: every port serves TLS (a
    certificate valid for 127.0.0.1); ``ca``: what the request manager and the launcher trust;
    ``client_ca``: every port requires client certificates (mTLS), which the request manager and
    the launcher present (``client_cert``/``client_key``). ``auth_token``: the public API's bearer
    token; ``internal_token``: the one between services. All reach the processes through
    SPECINFER_* environment variables, never the command line (which ``ps`` shows)."""

    cert: str = ""
    key: str = ""
    ca: str = ""
    client_ca: str = ""
    client_cert: str = ""
    client_key: str = ""
    auth_token: str = field(default="", repr=False)
    internal_token: str = field(default="", repr=False)

    @property
    def client_tls(self) -> ClientTls:
        return ClientTls.from_files(self.ca, self.client_cert, self.client_key)

    def client_auth(self) -> ClientAuth:
        """How a client of the public API reaches this stack."""
        return ClientAuth(self.client_tls, self.auth_token)

    def env(self, request_manager: bool) -> dict[str, str]:
        """The environment of one process: server TLS and the internal token for all; the calling
        side and the public token for the request manager."""
        out = {
            "SPECINFER_TLS_CERT": self.cert,
            "SPECINFER_TLS_KEY": self.key,
            "SPECINFER_TLS_CLIENT_CA": self.client_ca,
            "SPECINFER_INTERNAL_TOKEN": self.internal_token,
        }
        if request_manager:
            out |= {
                "SPECINFER_TLS_CA": self.ca,
                "SPECINFER_TLS_CLIENT_CERT": self.client_cert,
                "SPECINFER_TLS_CLIENT_KEY": self.client_key,
                "SPECINFER_AUTH_TOKEN": self.auth_token,
            }
        return {k: v for k, v in out.items() if v}
