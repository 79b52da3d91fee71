"""``specinfer up``: the whole stack as separate local processes on 127.0.0.1.

Starts the LLM verifier, N SSM workers and the request manager (which starts its embedded Redis, or
uses the Redis or Redis Cluster ``StackConfig.redis_url`` names),
waits until each reports its port and its health is SERVING, and prints the addresses. With
several request managers (``request_managers``), it starts a Redis they share (docs/request-managers.md).

Each of these processes is a *member* of the stack. ``specinfer up`` supervises them
(:class:`Supervisor`): a member that exits is started again with the same flags on the same port
(the others find it again there) after an exponential backoff (:class:`RestartPolicy`), while the
other replicas keep serving. The stack stops (SIGTERM, then SIGKILL after a grace period) on
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
from specinfer.serving.security import ClientAuth, ClientTls


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
    ssm_threads: int = (
        1  # torch threads per SSM worker (0: torch's default): small models, and they must not crowd the verifier
    )
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
    # its own --owner rm-<i> and state dir; the first has ``port`` and ``http_port``, the others free ports
    request_managers: int = 1
    restart: RestartPolicy = field(default_factory=RestartPolicy)

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
        cmd += ["--metrics-port", "0", "--metrics-port-file", str(metrics_file), *args]
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
                str(c.port if i == 0 else 0),
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


@dataclass
class Member:
    """What the supervisor knows of one member across its restarts (its current process is
    ``Stack.process(name)``)."""

    name: str
    restarts: int = 0  # how often it was started again
    exits: int = 0  # exits in a row (the backoff's exponent): reset after RestartPolicy.stable_after s of serving
    start_failures: int = 0  # exits in a row before it was SERVING: reset once it serves
    started: float = 0.0  # monotonic time of its last start
    serving_since: float | None = None  # monotonic time it was first seen SERVING since its last start
    due: float | None = None  # while it is down: when it is started again


@dataclass
class Supervisor:
    """Keeps a started :class:`Stack` running: :meth:`poll` notices a member that exited, starts it
    again after the :class:`RestartPolicy` delay with the same flags on the same port, and watches
    its health until it is SERVING again, without waiting on it: the others keep serving meanwhile.
    Raises :class:`StartUpFailure` when a member fails at start-up too often in a row."""

    stack: Stack
    members: dict[str, Member] = field(default_factory=dict)

    def __post_init__(self) -> None:
        now = time.monotonic()
        for p in self.stack.processes:  # Stack.start returns with every member SERVING
            self.members[p.name] = Member(p.name, started=now, serving_since=now)

    @property
    def restarts(self) -> int:
        return sum(m.restarts for m in self.members.values())

    def poll(self, now: float | None = None) -> None:
        """One round over the members (call it every fraction of a second)."""
        now = time.monotonic() if now is None else now
        policy, stack = self.stack.config.restart, self.stack
        for proc in list(stack.processes):
            m = self.members[proc.name]
            if m.due is not None:
                if now >= m.due:
                    self._restart(m, now)
                continue
            code = proc.popen.poll()
            if code is not None:
                if m.serving_since is None:
                    m.start_failures += 1
                    if m.start_failures >= policy.max_start_failures:
                        raise StartUpFailure(m.name, m.start_failures, stack.log_path(m.name))
                elif now - m.serving_since >= policy.stable_after:
                    m.exits = 0
                m.exits += 1
                m.serving_since = None
                delay = policy.delay(m.exits)
                m.due = now + delay
                stack.report(
                    f"{m.name} (pid {proc.popen.pid}) exited with {code}; "
                    f"starting it again in {delay:.1f} s on {proc.address}"
                )
            elif m.serving_since is None:
                if check(proc.address, timeout=1, tls=stack.config.security.client_tls) == "SERVING":
                    m.serving_since, m.start_failures = now, 0
                    stack.read_metrics_address(proc)
                    stack.report(
                        f"{m.name} SERVING again on {proc.address} "
                        f"(pid {proc.popen.pid}, restart {m.restarts}, {self.restarts} in all; "
                        f"metrics http://{proc.metrics_address}/metrics)"
                    )
                elif now - m.started > START_TIMEOUT:
                    stack.report(f"{m.name} not SERVING {START_TIMEOUT:.0f} s after its start; killing it")
                    proc.popen.kill()

    def _restart(self, m: Member, now: float) -> None:
        # Ctrl-C or SIGTERM between the fork and Stack.processes' update would leave an orphan
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            proc = self.stack.respawn(m.name, wait=False)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        m.due, m.started = None, now
        m.restarts += 1
        self.stack.report(
            f"{m.name} started again (pid {proc.popen.pid}, restart {m.restarts}); log {self.stack.log_path(m.name)}"
        )


def run_up(config: StackConfig) -> int:
    """Start the stack, print the addresses, keep it running (:class:`Supervisor`) until Ctrl-C or
    SIGTERM (exit 0) or a member's repeated start-up failure (exit 1, with its last log lines)."""
    stack = Stack(config)

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    # a shell's background job starts with SIGINT ignored; SIGTERM (docker, systemd) stops us too
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, interrupt)
    supervisor = None
    try:
        stack.start()
        for p in stack.processes:
            print(
                f"{p.name:16s} {p.address}  metrics http://{p.metrics_address}/metrics  "
                f"(pid {p.popen.pid}, log {stack.log_path(p.name)})",
                flush=True,
            )
        print(
            f"public API: {stack.address}   try: specinfer generate --server {stack.address} 'def main():'", flush=True
        )
        if config.request_managers > 1:
            print(
                f"every request manager serves every request: {', '.join(stack.request_manager_addresses)}", flush=True
            )
        if config.http_port:
            http = f"{'https' if config.security.cert else 'http'}://127.0.0.1:{config.http_port}/v1"
            example = """'{"prompt": "def main():", "max_tokens": 32}'"""
            print(
                f"OpenAI-compatible API: {http}   "
                f"try: curl {http}/completions -H 'Content-Type: application/json' -d {example}",
                flush=True,
            )
        print(
            f"a process that exits is started again on its port; Ctrl-C stops them all (logs: {stack.workdir})",
            flush=True,
        )
        supervisor = Supervisor(stack)
        while True:
            supervisor.poll()
            time.sleep(0.25)
    except StartUpFailure as exc:
        print(f"stopping: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        stack.stop()
        if supervisor is not None and supervisor.restarts:
            counts = ", ".join(f"{m.name} {m.restarts}" for m in supervisor.members.values() if m.restarts)
            print(f"restarts: {counts}", file=sys.stderr, flush=True)
        print(f"stopped; logs in {stack.workdir}", file=sys.stderr, flush=True)
