"""``specinfer up``: the whole stack as separate local processes on 127.0.0.1.

Starts the LLM verifier, N SSM workers and the request manager (which starts its embedded Redis, or
uses the Redis or Redis Cluster ``StackConfig.redis_url`` names),
waits until each reports its port and its health is SERVING, and prints the addresses. With
several request managers (``request_managers``), it starts a Redis they share (docs/request-managers.md).

Each of these processes is a *member* of the stack. ``specinfer up`` supervises them
(:func:`specinfer.supervisor.run_up`): a member that exits is started again with the same flags on
the same port (the others find it again there) after an exponential backoff (:class:`RestartPolicy`),
while the other replicas keep serving. The stack stops (SIGTERM, then SIGKILL after a grace period) on
Ctrl-C or SIGTERM, or when a member fails at start-up again and again (:class:`StartUpFailure`).
Logs, port files and the like live in a ``logs-*`` folder under ``StackConfig.state_dir``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from specinfer.request_manager.state.redis_server import EmbeddedRedis
from specinfer.serving.config import named_paths
from specinfer.serving.healthcheck import check
from specinfer.serving.security import ClientTls, StackSecurity

# seconds a service may take to serve: the verifier times its cost model at start-up, about 2
# minutes for a 1B model on 2 CPU cores (progress in its log)
START_TIMEOUT = 600.0


@dataclass(frozen=True)
class RestartPolicy:
    """How a member that exits is brought back. It is started again ``first_delay`` seconds after
    it exits; each further exit doubles the delay, up to ``max_delay``, until the member has served
    for ``stable_after`` seconds in one go. A *start-up failure* is a start after which the member
    exits before its health is SERVING (bad flags, a missing model): ``max_start_failures`` of them
    in a row stop the stack instead (:class:`StartUpFailure`)."""

    first_delay: float = 0.5
    max_delay: float = 10.0
    stable_after: float = 60.0
    max_start_failures: int = 3

    def delay(self, exits: int) -> float:
        """Seconds before the next start of a member that exited ``exits`` times in a row (>= 1)."""
        return min(self.max_delay, self.first_delay * 2 ** max(0, exits - 1))


@dataclass(frozen=True)
class StackConfig:
    """What ``specinfer up`` (and tests, through :class:`Stack`) start. ``ssms``: the SSM checkpoints,
    each a folder (served under its folder's name) or ``NAME=PATH`` (``specinfer.serving.config.named_paths``)."""

    llm: Path
    ssms: tuple[Path | str, ...]
    workers: int = 1
    port: int = 50051
    state_dir: Path = Path("./specinfer-state")
    backend: str = "auto"
    expansion: str = "auto"  # the request manager's --expansion: auto (adaptive), tuned, widths, @FILE, none
    threads: int = 0  # torch threads of the verifier (0: torch's default)
    # torch threads per SSM worker (0: torch's default): small models, and they must not crowd the verifier
    ssm_threads: int = 1
    extra_env: tuple[tuple[str, str], ...] = ()
    rm_args: tuple[str, ...] = ()  # further request-manager flags
    model_args: tuple[str, ...] = ()  # further flags of the verifier and the SSM workers (e.g. --kv-cache-bytes)
    verifier_args: tuple[str, ...] = ()  # further flags of the verifier only (e.g. --tensor-parallel 2)
    security: StackSecurity = field(default_factory=StackSecurity)
    http_port: int = 0  # the request manager's OpenAI-compatible HTTP API (0: off)
    verifiers: int = 1  # LLM verifier replicas (llm-verifier, llm-verifier-1, ...), each request placed on one
    redis_url: str = ""  # the request manager's --redis-url (empty: its embedded Redis under state_dir)
    redis_cluster: bool = False  # redis_url names a node of a Redis Cluster (--redis-cluster)
    # request-manager replicas: more than one share a Redis the launcher starts (under state_dir/redis), each with
    # its own --owner rm-<i> and state dir; manager i listens on ``port`` + i (0: free ports), the first on http_port
    request_managers: int = 1
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    head: Path | None = None  # a draft head of the LLM (specinfer train-head), which every verifier drafts with

    @property
    def named_ssms(self) -> dict[str, str]:
        """``{name: checkpoint folder}`` of the SSMs, in order (InvalidArgument on a name given twice)."""
        return named_paths(self.ssms, "ssm")


class MemberExited(RuntimeError):
    """A member exited while it was starting (before its health was SERVING)."""


class StartUpFailure(RuntimeError):
    """A member failed at start-up ``RestartPolicy.max_start_failures`` times in a row; the message
    ends with the last lines of its log."""

    def __init__(self, name: str, failures: int, log: Path, tail_lines: int = 20) -> None:
        lines = log.read_text(errors="replace").splitlines()[-tail_lines:] if log.is_file() else ["(no log)"]
        tail = "\n".join("    " + line for line in lines)
        super().__init__(
            f"{name} exited before it served, {failures} times in a row; the last lines of its log {log}:\n{tail}"
        )
        self.name = name


@dataclass
class Process:
    name: str
    popen: subprocess.Popen
    port_file: Path
    address: str = ""
    metrics_address: str = ""  # host:port of its Prometheus /metrics endpoint
    args: tuple[str, ...] = ()  # the service's own flags (what _spawn was given), which a respawn reuses


def wait_serving(address: str, timeout: float, tls: ClientTls | None = None) -> None:
    """Block until ``address`` answers a health check with SERVING."""
    deadline = time.monotonic() + timeout
    while check(address, timeout=2, tls=tls) != "SERVING":
        if time.monotonic() > deadline:
            raise TimeoutError(f"{address} not SERVING after {timeout:.0f} s")
        time.sleep(0.1)


def say(line: str) -> None:
    """A line of the launcher's own (starts, exits, restarts), time-stamped, on stderr."""
    print(f"{time.strftime('%H:%M:%S')} {line}", file=sys.stderr, flush=True)


@dataclass
class Stack:
    """Running processes of a local stack; use as a context manager. ``workdir`` holds each
    process's log, port files and the like: by default a new ``logs-<time>-*`` folder under
    ``config.state_dir`` (kept after a stop, for reading)."""

    config: StackConfig
    processes: list[Process] = field(default_factory=list)
    workdir: Path | None = None
    redis: EmbeddedRedis | None = None  # the Redis several request managers share
    report: Callable[[str], None] = say  # where the launcher's own lines go

    def __post_init__(self) -> None:
        if self.workdir is None:
            self.config.state_dir.mkdir(parents=True, exist_ok=True)
            self.workdir = Path(
                tempfile.mkdtemp(prefix=time.strftime("logs-%Y%m%d-%H%M%S-"), dir=self.config.state_dir)
            )

    def log_path(self, name: str) -> Path:
        return self.workdir / f"{name}.log"

    def _spawn(self, name: str, module: str, args: Sequence[str], timeout: float, address: str = "") -> Process:
        """Start ``module`` as ``name`` and wait until it is SERVING; with ``address`` (its fixed
        host:port, for a restart) return at once, without waiting (see :meth:`wait_ready`)."""
        port_file = self.workdir / f"{name}.port"
        metrics_file = self.workdir / f"{name}.metrics-port"
        for stale in (port_file, metrics_file):  # an earlier start's: wait_ready must read this one's
            stale.unlink(missing_ok=True)
        env = dict(os.environ)
        env.update(self.config.security.env(request_manager=module == "specinfer.request_manager"))
        env.update(self.config.extra_env)
        log = open(self.log_path(name), "ab")  # noqa: SIM115 (lives as long as the process; a respawn appends)
        cmd = [sys.executable, "-m", module, "--host", "127.0.0.1", "--port-file", str(port_file)]
        cmd += ["--metrics-port", "0", "--metrics-port-file", str(metrics_file)]
        # a member stops once we are gone, however we die: no orphans serving on
        cmd += ["--parent-pid", str(os.getpid()), *args]
        proc = Process(
            name,
            subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env),
            port_file,
            address,
            args=tuple(args),
        )
        log.close()  # the child holds its own copy
        self.processes.append(proc)
        if address:
            return proc
        return self.wait_ready(proc, timeout)

    def wait_ready(self, proc: Process, timeout: float = START_TIMEOUT) -> Process:
        """Block until ``proc`` listens and is SERVING (RuntimeError if it exits first)."""
        name = proc.name
        port_file = proc.port_file
        deadline = time.monotonic() + timeout
        while not port_file.is_file() or not port_file.read_text().strip():
            if proc.popen.poll() is not None:
                raise MemberExited(f"{name} exited with {proc.popen.returncode}; log: {self.log_path(name)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} did not start in {timeout:.0f} s; log: {self.log_path(name)}")
            time.sleep(0.05)
        proc.address = f"127.0.0.1:{port_file.read_text().strip()}"
        while True:  # SERVING, unless it exits first
            try:
                wait_serving(
                    proc.address, min(2.0, max(1.0, deadline - time.monotonic())), self.config.security.client_tls
                )
                break
            except TimeoutError:
                if proc.popen.poll() is not None:
                    raise MemberExited(
                        f"{name} exited with {proc.popen.returncode}; log: {self.log_path(name)}"
                    ) from None
                if time.monotonic() > deadline:
                    raise
        self.read_metrics_address(proc)
        return proc

    def read_metrics_address(self, proc: Process) -> None:
        """Where ``proc`` serves /metrics (its file is written before health turns SERVING)."""
        proc.metrics_address = f"127.0.0.1:{(self.workdir / f'{proc.name}.metrics-port').read_text().strip()}"

    def _start_member(self, name: str, module: str, args: Sequence[str], timeout: float) -> Process:
        """Start a member and wait until it is SERVING; one that exits first is started again after
        the restart policy's delay, up to ``max_start_failures`` starts (then :class:`StartUpFailure`)."""
        policy, failures = self.config.restart, 0
        while True:
            try:
                return self._spawn(name, module, args, timeout)
            except MemberExited as exc:
                failures += 1
                if failures >= policy.max_start_failures:
                    raise StartUpFailure(name, failures, self.log_path(name)) from exc
                delay = policy.delay(failures)
                self.report(f"{exc}; starting it again in {delay:.1f} s")
                self.processes.remove(self.process(name))
                time.sleep(delay)

    def start(self, timeout: float = START_TIMEOUT) -> Stack:
        c = self.config
        model = ["--backend", c.backend, *c.model_args]
        ssm_arg = ",".join(
            f"{name}={path}" for name, path in c.named_ssms.items()
        )  # before anything starts: names must be distinct
        for i in range(c.verifiers):
            name = "llm-verifier" if i == 0 else f"llm-verifier-{i}"
            args = ["--port", "0", "--llm", str(c.llm), "--torch-threads", str(c.threads), *model, *c.verifier_args]
            if c.head is not None:
                args += ["--head", str(c.head)]
            self._start_member(name, "specinfer.llm_verifier", args, timeout)
        workers = [
            self._start_member(
                f"ssm-worker-{i}",
                "specinfer.ssm_worker",
                [
                    "--port",
                    "0",
                    "--ssm",
                    ssm_arg,
                    "--llm-dir",
                    str(c.llm),
                    "--torch-threads",
                    str(c.ssm_threads),
                    *model,
                ],
                timeout,
            )
            for i in range(c.workers if c.ssms else 0)
        ]
        # several request managers share one Redis: the configured one, one named in the environment
        # (SPECINFER_REDIS_URL, which they read themselves), else one the launcher starts
        if c.request_managers > 1 and not c.redis_url and not os.environ.get("SPECINFER_REDIS_URL"):
            self.redis = EmbeddedRedis(c.state_dir / "redis", appendonly=True, die_with_parent=True).start()

        def rm_args(i: int) -> list[str]:
            """The flags of request manager ``i`` (0: the main one)."""
            state, shared = c.state_dir, []
            if c.redis_url:
                shared = ["--redis-url", c.redis_url] + (["--redis-cluster", "on"] if c.redis_cluster else [])
            elif self.redis is not None:
                shared = ["--redis-url", self.redis.url]
            if c.request_managers > 1:
                state, shared = c.state_dir / f"rm-{i}", [*shared, "--owner", f"rm-{i}"]
            return [
                "--port",
                str(c.port + i if c.port else 0),  # request manager i on --port + i
                "--verifier",
                self.verifier_addresses,
                "--ssm-workers",
                ",".join(w.address for w in workers),
                "--model-dir",
                str(c.llm),
                "--state-dir",
                str(state),
                "--expansion",
                c.expansion,
                "--http-port",
                str(c.http_port if i == 0 else 0),
                *shared,
                *c.rm_args,
            ]

        for i in range(1, c.request_managers):
            self._start_member(f"request-manager-{i}", "specinfer.request_manager", rm_args(i), timeout)
        self._start_member("request-manager", "specinfer.request_manager", rm_args(0), timeout)  # last: Stack.address
        return self

    def respawn(self, name: str, timeout: float = START_TIMEOUT, wait: bool = True) -> Process:
        """Start the exited process ``name`` again with its command, on the same port (callers
        keep their address); for fault tests that kill a process and bring it back. ``wait=False``:
        return once started (:meth:`wait_ready` waits for it)."""
        old = self.process(name)
        if old.popen.poll() is None:
            raise RuntimeError(f"{name} is still running")
        module = old.popen.args[old.popen.args.index("-m") + 1]
        args = list(old.args)
        if "--port" in args:  # the first start's port (0: any) becomes the port it got
            del args[args.index("--port") : args.index("--port") + 2]
        port = old.address.rpartition(":")[2]
        old.port_file.unlink(missing_ok=True)
        self.processes.remove(old)
        proc = self._spawn(name, module, [*args, "--port", port], timeout, address="" if wait else old.address)
        self.processes.remove(proc)
        # the verifiers first, the main request manager last (Stack.address), the rest before it
        if name.startswith("llm-verifier"):
            self.processes.insert(0, proc)
        elif name == "request-manager":
            self.processes.append(proc)
        else:
            self.processes.insert(len(self.processes) - 1, proc)
        return proc

    def spawn_request_manager(self, name: str, args: Sequence[str], timeout: float = 60.0) -> Process:
        """Another request manager on the same verifier and workers (e.g. with other limits)."""
        workers = ",".join(p.address for p in self.processes if p.name.startswith("ssm-worker"))
        base = [
            "--port",
            "0",
            "--http-port",
            "0",
            "--verifier",
            self.verifier_addresses,
            "--ssm-workers",
            workers,
            "--model-dir",
            str(self.config.llm),
        ]
        base += ["--state-dir", str(self.workdir / name), "--owner", name]  # its own owner, should it share a Redis
        proc = self._spawn(name, "specinfer.request_manager", [*base, *args], timeout)
        # keep the main request manager last (Stack.address)
        self.processes.remove(proc)
        self.processes.insert(len(self.processes) - 1, proc)
        return proc

    @property
    def verifier_addresses(self) -> str:
        """The LLM verifier replicas' addresses, comma-separated (the request manager's ``--verifier``)."""
        return ",".join(p.address for p in self.processes if p.name.startswith("llm-verifier"))

    @property
    def address(self) -> str:
        return self.processes[-1].address

    @property
    def request_manager_addresses(self) -> list[str]:
        """The addresses of the request managers :meth:`start` started, the main one (:attr:`address`) first."""
        names = ["request-manager", *(f"request-manager-{i}" for i in range(1, self.config.request_managers))]
        return [self.process(name).address for name in names]

    def process(self, name: str) -> Process:
        return next(p for p in self.processes if p.name == name)

    def stop(self, grace: float = 15.0) -> dict[str, int]:
        """SIGTERM in reverse start order; returns each process's exit code."""
        codes = {}
        for p in reversed(self.processes):
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGTERM)
        for p in reversed(self.processes):
            try:
                codes[p.name] = p.popen.wait(grace)
            except subprocess.TimeoutExpired:
                p.popen.kill()
                codes[p.name] = p.popen.wait()
        if self.redis is not None:
            self.redis.close()
        return codes

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
