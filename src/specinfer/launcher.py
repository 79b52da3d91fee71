"""``specinfer up``: the whole stack as separate local processes on 127.0.0.1.

Starts the LLM verifier, N SSM workers and the request manager (which starts its embedded Redis, or
uses the Redis or Redis Cluster ``StackConfig.redis_url`` names),
waits until each reports its port and its health is SERVING, prints the addresses, and stops
them all (SIGTERM, then SIGKILL after a grace period) on Ctrl-C or when one of them dies. With
several request managers (``request_managers``), it starts a Redis they share (docs/request-managers.md).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from specinfer.request_manager.redis_server import EmbeddedRedis
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
class StackConfig:
    llm: Path
    ssms: tuple[Path, ...]
    workers: int = 1
    port: int = 50051
    state_dir: Path = Path("./specinfer-state")
    backend: str = "auto"
    expansion: str = "auto"  # the request manager's --expansion: auto (adaptive), tuned, widths, @FILE, none
    threads: int = 0  # torch threads of the verifier (0: torch's default)
    ssm_threads: int = 1  # torch threads per SSM worker (0: torch's default): small models, and they must not crowd the verifier
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


@dataclass
class Stack:
    """Running processes of a local stack; use as a context manager."""

    config: StackConfig
    processes: list[Process] = field(default_factory=list)
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="specinfer-stack-")))
    redis: EmbeddedRedis | None = None  # the Redis several request managers share

    def _spawn(self, name: str, module: str, args: Sequence[str], timeout: float, address: str = "") -> Process:
        """Start ``module`` as ``name`` and wait until it is SERVING; with ``address`` (its fixed
        host:port, for a restart) return at once, without waiting (see :meth:`wait_ready`)."""
        port_file = self.workdir / f"{name}.port"
        env = dict(os.environ)
        env.update(self.config.security.env(request_manager=module == "specinfer.request_manager"))
        env.update(self.config.extra_env)
        log = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 (lives as long as the process; a respawn appends)
        metrics_file = self.workdir / f"{name}.metrics-port"
        cmd = [sys.executable, "-m", module, "--host", "127.0.0.1", "--port-file", str(port_file)]
        cmd += ["--metrics-port", "0", "--metrics-port-file", str(metrics_file), *args]
        proc = Process(name, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), port_file, address, args=tuple(args))
        self.processes.append(proc)
        if address:
            return proc
        return self.wait_ready(proc, timeout)

    def wait_ready(self, proc: Process, timeout: float = START_TIMEOUT) -> Process:
        """Block until ``proc`` listens and is SERVING (RuntimeError if it exits first)."""
        name = proc.name
        metrics_file = self.workdir / f"{name}.metrics-port"
        port_file = proc.port_file
        deadline = time.monotonic() + timeout
        while not port_file.is_file() or not port_file.read_text().strip():
            if proc.popen.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.popen.returncode}; log: {self.workdir / (name + '.log')}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} did not start in {timeout:.0f} s; log: {self.workdir / (name + '.log')}")
            time.sleep(0.05)
        proc.address = f"127.0.0.1:{port_file.read_text().strip()}"
        while True:  # SERVING, unless it exits first
            try:
                wait_serving(proc.address, min(2.0, max(1.0, deadline - time.monotonic())), self.config.security.client_tls)
                break
            except TimeoutError:
                if proc.popen.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.popen.returncode}; log: {self.workdir / (name + '.log')}") from None
                if time.monotonic() > deadline:
                    raise
        proc.metrics_address = f"127.0.0.1:{metrics_file.read_text().strip()}"  # written before health turns SERVING
        return proc

    def start(self, timeout: float = START_TIMEOUT) -> Stack:
        c = self.config
        model = ["--backend", c.backend, *c.model_args]
        for i in range(c.verifiers):
            name = "llm-verifier" if i == 0 else f"llm-verifier-{i}"
            args = ["--port", "0", "--llm", str(c.llm), "--torch-threads", str(c.threads), *model, *c.verifier_args]
            self._spawn(name, "specinfer.llm_verifier", args, timeout)
        ssm_arg = ",".join(f"ssm{i}={p}" if len(c.ssms) > 1 else str(p) for i, p in enumerate(c.ssms))
        workers = [
            self._spawn(
                f"ssm-worker-{i}",
                "specinfer.ssm_worker",
                ["--port", "0", "--ssm", ssm_arg, "--llm-dir", str(c.llm), "--torch-threads", str(c.ssm_threads), *model],
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
            self._spawn(f"request-manager-{i}", "specinfer.request_manager", rm_args(i), timeout)
        self._spawn("request-manager", "specinfer.request_manager", rm_args(0), timeout)  # last: Stack.address
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
        base = ["--port", "0", "--http-port", "0", "--verifier", self.verifier_addresses, "--ssm-workers", workers, "--model-dir", str(self.config.llm)]
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


def run_up(config: StackConfig) -> int:
    """Start the stack, print the addresses, wait for Ctrl-C (or a process dying)."""
    stack = Stack(config)

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    # a shell's background job starts with SIGINT ignored; SIGTERM (docker, systemd) stops us too
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, interrupt)
    try:
        stack.start()
        for p in stack.processes:
            log = stack.workdir / (p.name + ".log")
            print(f"{p.name:16s} {p.address}  metrics http://{p.metrics_address}/metrics  (pid {p.popen.pid}, log {log})", flush=True)
        print(f"public API: {stack.address}   try: specinfer generate --server {stack.address} 'def main():'", flush=True)
        if config.request_managers > 1:
            print(f"every request manager serves every request: {', '.join(stack.request_manager_addresses)}", flush=True)
        if config.http_port:
            http = f"{'https' if config.security.cert else 'http'}://127.0.0.1:{config.http_port}/v1"
            example = """'{"prompt": "def main():", "max_tokens": 32}'"""
            print(f"OpenAI-compatible API: {http}   try: curl {http}/completions -H 'Content-Type: application/json' -d {example}", flush=True)
        while all(p.popen.poll() is None for p in stack.processes):
            time.sleep(0.5)
        dead = [p.name for p in stack.processes if p.popen.poll() is not None]
        print(f"stopping: {', '.join(dead)} exited", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        stack.stop()
