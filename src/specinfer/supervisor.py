"""``specinfer up`` keeps a started local stack running (:func:`run_up`).

The :class:`Supervisor` polls the members of a :class:`specinfer.launcher.Stack`: a member that
exits is started again with the same flags on the same port after the stack's
:class:`specinfer.launcher.RestartPolicy` delay, and watched until its health is SERVING again,
while the other replicas keep serving; a member that fails at start-up again and again stops the
stack (:class:`specinfer.launcher.StartUpFailure`).
"""

from __future__ import annotations

import signal
import sys
import time
from dataclasses import dataclass, field

from specinfer.launcher import START_TIMEOUT, Stack, StackConfig, StartUpFailure
from specinfer.serving.healthcheck import check


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
    again after the :class:`~specinfer.launcher.RestartPolicy` delay with the same flags on the same port, and
    watches its health until it is SERVING again, without waiting on it: the others keep serving meanwhile.
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
