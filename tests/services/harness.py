"""Run gRPC services as separate processes for tests.

Usage (any command that accepts ``--host``, ``--port`` and ``--port-file``, as every specinfer
service does)::

    with running_service([sys.executable, "-m", "specinfer.ssm_worker", "--ssm", path]) as svc:
        channel = grpc.insecure_channel(svc.address)
        ...
    # leaving the block sends SIGTERM and asserts exit code 0

The harness appends ``--host 127.0.0.1 --port 0 --port-file F``, waits for the port file and for
``grpc.health.v1`` to answer SERVING, and keeps the process's output in a log file whose tail
goes into every failure message. :func:`running_services` starts several at once (they load
their models in parallel) and stops them in reverse order.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

HOST = "127.0.0.1"


class ServiceError(RuntimeError):
    """A service did not start, or did not stop as it should."""


@dataclass
class ServiceProcess:
    """A service started by :func:`start_service`."""

    name: str
    command: list[str]
    process: subprocess.Popen
    port_file: Path
    log_path: Path
    address: str = ""

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "<no log>"

    def _fail(self, what: str) -> ServiceError:
        return ServiceError(
            f"{self.name}: {what}\ncommand: {' '.join(self.command)}\n--- log tail ---\n{self.log_tail()}"
        )

    def wait_ready(self, timeout: float = 60.0) -> str:
        """Wait for the port file, then for health SERVING; returns the address ``host:port``."""
        deadline = time.monotonic() + timeout
        while not self.address:
            self._check_alive()
            with contextlib.suppress(OSError, ValueError):
                self.address = f"{HOST}:{int(self.port_file.read_text())}"
                break
            if time.monotonic() > deadline:
                raise self._fail(f"no port file after {timeout:.0f} s")
            time.sleep(0.05)
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                self._check_alive()
                with contextlib.suppress(grpc.RpcError):
                    if (
                        stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0).status
                        == health_pb2.HealthCheckResponse.SERVING
                    ):
                        return self.address
                if time.monotonic() > deadline:
                    raise self._fail(f"not SERVING after {timeout:.0f} s")
                time.sleep(0.05)

    def _check_alive(self) -> None:
        code = self.process.poll()
        if code is not None:
            raise self._fail(f"exited with code {code} while starting")

    def terminate(self) -> None:
        """Send SIGTERM (graceful shutdown) unless the process has already exited."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then wait; returns the exit code. Killed (and an error) after ``timeout``."""
        self.terminate()
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise self._fail(f"still running {timeout:.0f} s after SIGTERM; killed") from None

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def _default_name(command: Sequence[str]) -> str:
    """``python -m pkg.mod ...`` -> ``pkg.mod``; otherwise the program's file name."""
    args = list(command)
    return args[args.index("-m") + 1] if "-m" in args[:-1] else Path(args[0]).name


def start_service(
    command: Sequence[str],
    name: str | None = None,
    env: Mapping[str, str] | None = None,
    workdir: str | os.PathLike | None = None,
) -> ServiceProcess:
    """Start ``command`` (plus the listening flags) without waiting for it; see :meth:`ServiceProcess.wait_ready`."""
    folder = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="specinfer-svc-"))
    name = name or _default_name(command)
    stem = f"{name.replace('/', '_')}-{time.monotonic_ns()}"
    port_file, log_path = folder / f"{stem}.port", folder / f"{stem}.log"
    full = [*command, "--host", HOST, "--port", "0", "--port-file", str(port_file)]
    with open(log_path, "wb") as log:
        # its own session: a Ctrl-C in the test runner does not reach it, the harness stops it
        process = subprocess.Popen(
            full, stdout=log, stderr=subprocess.STDOUT, env=None if env is None else dict(env), start_new_session=True
        )
    return ServiceProcess(name, full, process, port_file, log_path)


@contextlib.contextmanager
def running_services(
    commands: Sequence[Sequence[str]],
    names: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
    startup_timeout: float = 60.0,
    stop_timeout: float = 30.0,
    check_exit: bool = True,
    workdir: str | os.PathLike | None = None,
) -> Iterator[list[ServiceProcess]]:
    """Start every command, wait until all serve, yield them; on exit stop them in reverse
    order and (``check_exit``) assert exit code 0. If the block raised, they are stopped
    without that check so the original error stays the one reported. Logs and port files go
    to ``workdir`` (default: a new temporary folder, kept for post-mortems)."""
    started: list[ServiceProcess] = []
    try:
        for i, cmd in enumerate(commands):
            started.append(start_service(cmd, names[i] if names else None, env, workdir))
        for svc in started:
            svc.wait_ready(startup_timeout)
    except BaseException:
        for svc in started:
            svc.kill()
        raise
    try:
        yield started
    except BaseException:
        for svc in reversed(started):
            with contextlib.suppress(ServiceError):
                svc.stop(stop_timeout)
        raise
    failures: list[ServiceError] = []
    for svc in reversed(started):  # every one is stopped, whatever happens to the others
        try:
            code = svc.stop(stop_timeout)
        except ServiceError as exc:
            failures.append(exc)
            continue
        if check_exit and code != 0:
            failures.append(svc._fail(f"exit code {code} after SIGTERM"))
    if failures:
        raise ServiceError("\n\n".join(str(f) for f in failures))


@contextlib.contextmanager
def running_service(command: Sequence[str], name: str | None = None, **kwargs) -> Iterator[ServiceProcess]:
    """One service; see :func:`running_services` for the keyword arguments."""
    with running_services([command], [name] if name else None, **kwargs) as (svc,):
        yield svc


def wait_until(predicate, timeout: float = 60.0, what: str = "condition") -> None:
    """Poll ``predicate`` every 50 ms; fail the test when it is still false after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached in {timeout:.0f} s"
        time.sleep(0.05)


SPECINFER = Path(sys.executable).parent / "specinfer"  # the installed entry point, as a user runs it
# what `specinfer up` prints per process once the stack serves
UP_MEMBER = re.compile(
    r"^(?P<name>[a-z0-9-]+)\s+(?P<address>127\.0\.0\.1:\d+)\s+metrics http://\S+/metrics\s+\(pid (?P<pid>\d+), log "
)


class SpecinferUp:
    """``specinfer up ARGS`` as a subprocess; a thread collects its output (stdout and stderr) line by line."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.popen = subprocess.Popen(
            [str(SPECINFER), "up", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        self.lines: list[str] = []
        self.reader = threading.Thread(
            target=lambda: self.lines.extend(iter(self.popen.stdout.readline, "")), daemon=True
        )
        self.reader.start()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_line(self, pattern: str, timeout: float, what: str) -> re.Match:
        """The first output line matching ``pattern``; fails (with the output) if none comes in ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            for line in list(self.lines):
                if m := re.search(pattern, line):
                    return m
            assert self.popen.poll() is None or self.reader.is_alive(), (
                f"specinfer up exited ({self.popen.returncode}) before {what}:\n{self.output}"
            )
            assert time.monotonic() < deadline, f"{what} not seen in {timeout:.0f} s:\n{self.output}"
            time.sleep(0.1)

    def wait_serving(self, timeout: float = 600) -> str:
        """The public API's address, once the whole stack serves."""
        return self.wait_line(r"^public API: (\S+)", timeout, "the stack serving")[1]

    def members(self) -> dict[str, tuple[str, int]]:
        """``{name: (address, pid)}`` of the processes as first started."""
        return {m["name"]: (m["address"], int(m["pid"])) for line in list(self.lines) if (m := UP_MEMBER.match(line))}

    def stop(self, sig: int = signal.SIGINT, timeout: float = 120) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            raise


def processes_naming(text: str) -> list[str]:
    """Live processes (not zombies) whose command line contains ``text`` (a test's temporary folder)."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # exited meanwhile
            continue
        if text in cmdline and state != "Z":
            out.append(f"{proc.name}: {cmdline}")
    return out
