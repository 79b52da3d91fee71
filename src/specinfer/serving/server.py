"""gRPC server bootstrap shared by the services.

Every service gets ``grpc.health.v1`` health (overall and per service), server reflection,
graceful shutdown on SIGTERM/SIGINT (health turns NOT_SERVING, new calls are refused, in-flight
calls get ``grace`` seconds), JSON logs on stderr and, when a metrics port is set, Prometheus
metrics on ``http://HOST:METRICS_PORT/metrics`` (:mod:`specinfer.serving.metrics`). What start-up made (modules,
models) is frozen out of the garbage collector's view once the service serves (:func:`freeze_start_up_objects`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from specinfer.serving.config import check_ports_free, port_in_use
from specinfer.serving.metrics import ServiceMetrics
from specinfer.serving.security import ServerSecurity

if TYPE_CHECKING:
    from specinfer.serving.socket_calls import SocketServer

MAX_MESSAGE_BYTES = 64 << 20
FAILED_LINGER_SECONDS = 1.0  # after a failure, how long health answers NOT_SERVING before the server stops


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and any ``extra`` fields."""

    _skip = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 3),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update({k: v for k, v in record.__dict__.items() if k not in self._skip})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


@dataclass(frozen=True)
class ServerConfig:
    """``metrics_port``: HTTP port of ``/metrics`` (None: no metrics endpoint; 0: a free port,
    written to ``metrics_port_file`` when set)."""

    host: str
    port: int
    grace_seconds: float = 10.0
    metrics_port: int | None = None
    metrics_port_file: str | None = None
    parent_pid: int = 0  # the launcher: when our parent is another process, it died and we stop (0: never)

    def check_ports_free(self) -> None:
        """:class:`InvalidArgument` naming ``port`` or ``metrics-port`` when another process holds it
        (:func:`specinfer.serving.config.check_ports_free`)."""
        check_ports_free(
            self.host, {"port": self.port, "metrics-port": self.metrics_port if self.metrics_port is not None else -1}
        )

    @staticmethod
    def from_args(args) -> ServerConfig:
        """From the settings of :func:`specinfer.serving.config.add_server_settings`."""
        metrics_port = args.metrics_port if args.metrics_port >= 0 else None
        return ServerConfig(
            args.host, args.port, args.grace_seconds, metrics_port, args.metrics_port_file, args.parent_pid
        )


Register = Callable[[grpc.aio.Server], None]


class Service:
    """A running gRPC server with health and reflection. ``credentials``: a TLS port (None:
    plaintext); ``interceptors`` run on every call (e.g. the bearer-token check), after the
    metrics interceptor, which times every call, refused ones included."""

    def __init__(
        self,
        config: ServerConfig,
        service_names: Sequence[str],
        register: Register,
        credentials: grpc.ServerCredentials | None = None,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        metrics: ServiceMetrics | None = None,
        sockets: Sequence[SocketServer] = (),
    ) -> None:
        self.config = config
        self.sockets = tuple(sockets)  # served beside the gRPC port, started and stopped with it
        self.service_names = list(service_names)
        self.metrics = metrics or ServiceMetrics(service_names[0] if service_names else "")
        self.metrics_port: int | None = None
        self.server = grpc.aio.server(
            interceptors=[self.metrics.interceptor(), *interceptors],
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.keepalive_time_ms", 30_000),
                ("grpc.keepalive_timeout_ms", 10_000),
                ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
                ("grpc.keepalive_permit_without_calls", 1),
                # gRPC sets SO_REUSEPORT by default, so a second server on a taken port would share it
                # silently (and calls would go to either); without it, the bind fails and says so
                ("grpc.so_reuseport", 0),
            ],
        )
        register(self.server)
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = [
            *self.service_names,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ]
        reflection.enable_server_reflection(names, self.server)
        address = f"{config.host}:{config.port}"
        try:
            self.port = (
                self.server.add_secure_port(address, credentials)
                if credentials is not None
                else self.server.add_insecure_port(address)
            )
        except RuntimeError as exc:  # what grpc raises when the bind fails
            raise port_in_use("port", config.host, config.port, exc) from None
        if self.port == 0:
            raise port_in_use("port", config.host, config.port, OSError("the bind failed"))

    async def start(self, serving: bool = True) -> None:
        """Open the port; health SERVING, or NOT_SERVING with ``serving=False`` (still starting)."""
        await self.server.start()
        for socket_server in self.sockets:
            try:
                await socket_server.start(self.config.host)
            except OSError as exc:
                await self.halt()
                raise port_in_use(socket_server.setting, self.config.host, socket_server.asked_port, exc) from None
        if self.config.metrics_port is not None:
            try:
                self.metrics_port = self.metrics.start_http(self.config.host, self.config.metrics_port)
            except OSError as exc:
                await self.halt()
                raise port_in_use("metrics-port", self.config.host, self.config.metrics_port, exc) from None
            if self.config.metrics_port_file:
                write_port_file(self.config.metrics_port_file, self.metrics_port)
        await self.set_serving(serving)

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self.service_names]:
            await self.health.set(name, status)

    async def stop(self) -> None:
        await self.set_serving(False)
        grace = self.config.grace_seconds
        await asyncio.gather(self.server.stop(grace), *(s.stop(grace) for s in self.sockets))
        self.metrics.stop_http()

    async def halt(self) -> None:
        """Close every port now, calls in progress cancelled (a failed start, or a service that cannot work)."""
        await asyncio.gather(self.server.stop(0), *(s.stop(0) for s in self.sockets))
        self.metrics.stop_http()


Watch = Callable[[], Awaitable[str]]


def freeze_start_up_objects() -> None:
    """Collect start-up's garbage, then move every object left (torch's and transformers' modules, the model:
    ~200k objects in a verifier) out of the garbage collector's view (``gc.freeze``). Each of Python's full
    collections rescanned them all, a 50-80 ms pause on this project's CPUs. A full collection comes only when the
    objects that survive reach a quarter of those tracked: rarely in a serving loop (none in a short run of the demo
    pair), so what this removes is an occasional long pause. Objects made later are collected as before."""
    gc.collect()
    gc.freeze()


ORPHAN_POLL_SECONDS = 0.5  # how often a launched service checks that its launcher lives (--parent-pid)


async def run_service(
    service: Service,
    on_stop: Callable[[], Awaitable[None]] | None = None,
    ready: Callable[[int], None] | None = None,
    watch: Watch | None = None,
    start_up: Callable[[], Awaitable[None]] | None = None,
) -> int:
    """Serve until SIGTERM/SIGINT, then shut down gracefully and return 0. ``watch``, when
    given, runs beside the server and returns only when the service can no longer work (its
    result says why): health turns NOT_SERVING, in-flight calls are cancelled (no grace: they
    cannot complete) and 1 is returned, without ``on_stop``. ``start_up``, when given, runs
    after the port opens (health NOT_SERVING meanwhile, so probes and clients see the process
    starting); health turns SERVING when it returns; a signal during it cancels it."""
    log = logging.getLogger("specinfer.server")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    orphan_watch = (
        asyncio.ensure_future(_stop_when_orphaned(service.config.parent_pid, stop, log))
        if service.config.parent_pid
        else None
    )
    # a signal mask survives fork and exec: a parent that started us with these blocked (specinfer up blocks them
    # around a member's restart, so that Ctrl-C cannot orphan it mid-fork) would leave us deaf to a graceful stop
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})
    if start_up is None:  # everything is loaded: freeze before the port opens, so no call waits for the collection
        freeze_start_up_objects()
    await service.start(serving=start_up is None)
    log.info(
        "serving" if start_up is None else "listening; starting up",
        extra={
            "services": service.service_names,
            "address": f"{service.config.host}:{service.port}",
            "metrics_port": service.metrics_port,
        },
    )
    if ready is not None:
        ready(service.port)
    stopped = asyncio.ensure_future(stop.wait())
    if start_up is not None:
        starting = asyncio.ensure_future(start_up())
        await asyncio.wait([stopped, starting], return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():  # stopped while starting: nothing to drain
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting
            log.info("stopped during start-up")
            await service.stop()
            return 0
        if starting.exception() is not None:  # a failed start-up: close the port, then raise for the caller to clean up
            await service.halt()
            starting.result()
        freeze_start_up_objects()
        await service.set_serving(True)
        log.info("serving", extra={"address": f"{service.config.host}:{service.port}"})
    watched = asyncio.ensure_future(watch()) if watch is not None else None
    await asyncio.wait([stopped, *([watched] if watched else [])], return_when=asyncio.FIRST_COMPLETED)
    if watched is not None and watched.done() and not stopped.done():
        log.error("failed, not serving any more", extra={"reason": watched.result()})
        await service.set_serving(False)
        await asyncio.sleep(FAILED_LINGER_SECONDS)  # health watchers and probes see NOT_SERVING, not only a closed port
        await service.halt()
        return 1
    for task in (stopped, watched):
        if task is not None:
            task.cancel()
    started = time.monotonic()
    log.info("shutting down", extra={"grace_seconds": service.config.grace_seconds})
    await service.stop()
    if on_stop is not None:
        await on_stop()
    log.info("stopped", extra={"seconds": round(time.monotonic() - started, 3)})
    if orphan_watch is not None:
        orphan_watch.cancel()
    return 0


async def _stop_when_orphaned(parent_pid: int, stop: asyncio.Event, log: logging.Logger) -> None:
    """Set ``stop`` once our parent is not ``parent_pid`` any more: the launcher died without stopping us (kill -9,
    a test killed at its timeout), and the system re-parented us. A graceful stop then, as on SIGTERM, which
    also stops what we started (our Redis), instead of serving on as an orphan nobody will stop."""
    while os.getppid() == parent_pid:
        await asyncio.sleep(ORPHAN_POLL_SECONDS)
    log.warning("the launcher that started us is gone; stopping", extra={"launcher_pid": parent_pid})
    stop.set()


def write_port_file(path: str | os.PathLike, port: int) -> None:
    """Write the bound port for a launcher; atomically (write, then rename), so that a reader
    polling for the file never sees it half-written."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(f"{port}\n")
    os.replace(tmp, path)


async def serve(
    config: ServerConfig,
    service_names: Sequence[str],
    register: Register,
    port_file: str | None = None,
    on_stop: Callable[[], Awaitable[None]] | None = None,
    metrics: ServiceMetrics | None = None,
    watch: Watch | None = None,
    security: ServerSecurity | None = None,
    sockets: Sequence[SocketServer] = (),
) -> int:
    """Build the server inside the running event loop (grpc.aio binds to it) and serve until
    SIGTERM/SIGINT (returns 0) or until ``watch`` reports a failure (returns 1; see
    :func:`run_service`); ``port_file`` gets the bound port once the server accepts calls;
    ``security``: TLS and bearer tokens of the port (None: plaintext, open); ``sockets``: served beside it."""
    security = security or ServerSecurity()
    service = Service(
        config, service_names, register, security.tls.credentials(), security.interceptors(), metrics, sockets
    )
    ready = (lambda port: write_port_file(port_file, port)) if port_file else None
    return await run_service(service, on_stop, ready, watch)


class ModelServicer(Protocol):
    """What :func:`serve_model` serves: a servicer's gRPC methods and the socket it makes."""

    def register(self, server: grpc.aio.Server) -> None: ...

    def socket_server(self, security: ServerSecurity, metrics: ServiceMetrics, port: int) -> SocketServer: ...


def serve_model(
    config: ServerConfig,
    service_name: str,
    servicer: ModelServicer,
    port_file: str | None,
    metrics: ServiceMetrics,
    security: ServerSecurity,
    socket_port: int,
) -> int:
    """:func:`serve` a model service of one process: ``servicer``'s gRPC methods, and its socket on ``socket_port``
    (``--socket-port``; -1: none)."""
    from specinfer.serving.socket_calls import model_sockets  # that module reads this one's message bound

    sockets = model_sockets(servicer.socket_server, socket_port, security, metrics)
    return asyncio.run(
        serve(config, [service_name], servicer.register, port_file, metrics=metrics, security=security, sockets=sockets)
    )
