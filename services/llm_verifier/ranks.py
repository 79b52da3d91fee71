"""The ranks of a tensor x pipeline parallel verifier: who starts them, and watching them.

Two ways to get ``tp * pp`` processes:

- *spawned* (default): rank 0, the process started with ``--tensor-parallel N
  --pipeline-parallel M``, starts ranks 1..N*M-1 as child processes running this same command
  (with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and ``LOCAL_RANK`` set), on
  this machine, meeting on a free port of 127.0.0.1;
- *joined*: an outside launcher (torchrun, a Kubernetes LeaderWorkerSet or StatefulSet) starts
  every rank with those variables already set; ``WORLD_SIZE`` must equal N*M.

Rank 0 serves gRPC and drives the others (:mod:`specinfer.models.native.parallel.driver`).
A failed rank makes the service NOT_SERVING and exit with code 1 (:func:`watch_ranks`): a child
that exits, or a collective that fails (a dead peer closes its sockets at once; a stuck one
runs into ``--rank-timeout-seconds``). The other ranks exit when rank 0 does: their next
collective fails, and :func:`exit_with_parent` ends them when their parent goes away.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from specinfer.core import InvalidArgument
from specinfer.models.native.parallel import DriverRunner, ParallelLayout, Rendezvous

WATCH_INTERVAL_SECONDS = 0.2


@dataclass(frozen=True)
class Launch:
    layout: ParallelLayout
    rendezvous: Rendezvous
    local_rank: int  # which of this machine's GPUs the rank uses
    spawn: bool  # rank 0 starts the other ranks itself


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def plan_launch(tp: int, pp: int, timeout_seconds: float, environ: Mapping[str, str]) -> Launch:
    """Joined when the environment names the rank (``RANK`` and ``WORLD_SIZE``), else spawned."""
    if "RANK" in environ and "WORLD_SIZE" in environ:
        world, rank = int(environ["WORLD_SIZE"]), int(environ["RANK"])
        if world != tp * pp:
            raise InvalidArgument(
                "tensor-parallel",
                f"WORLD_SIZE is {world}, but --tensor-parallel {tp} x --pipeline-parallel {pp} = {tp * pp}",
            )
        if "MASTER_ADDR" not in environ or "MASTER_PORT" not in environ:
            raise InvalidArgument(
                "tensor-parallel", "a joined launch (RANK and WORLD_SIZE set) needs MASTER_ADDR and MASTER_PORT too"
            )
        rendezvous = Rendezvous(environ["MASTER_ADDR"], int(environ["MASTER_PORT"]), timeout_seconds)
        return Launch(ParallelLayout(tp, pp, rank), rendezvous, int(environ.get("LOCAL_RANK", rank)), spawn=False)
    return Launch(
        ParallelLayout(tp, pp, 0), Rendezvous("127.0.0.1", free_port("127.0.0.1"), timeout_seconds), 0, spawn=True
    )


def rank_device(device: str, local_rank: int) -> str:
    """Each rank on its own GPU: ``cuda`` or ``cuda:K`` -> ``cuda:<K + local rank>``; CPU stays."""
    if not device.startswith("cuda"):
        return device
    base = int(device.partition(":")[2] or 0)
    return f"cuda:{base + local_rank}"


def spawn_ranks(launch: Launch, argv: Sequence[str]) -> list[subprocess.Popen]:
    """Start ranks 1.. as children running ``python -m specinfer.llm_verifier argv`` (their
    output goes where this process's goes)."""
    children = []
    for rank in range(1, launch.layout.world_size):
        env = dict(os.environ)
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(launch.layout.world_size),
            LOCAL_RANK=str(rank),
            MASTER_ADDR=launch.rendezvous.master_addr,
            MASTER_PORT=str(launch.rendezvous.master_port),
        )
        children.append(subprocess.Popen([sys.executable, "-m", "specinfer.llm_verifier", *argv], env=env))
    return children


def stop_ranks(children: Sequence[subprocess.Popen], timeout: float) -> None:
    """Wait up to ``timeout`` for the children to exit, then kill the rest."""
    deadline = time.monotonic() + timeout
    for child in children:
        try:
            child.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def failure(children: Sequence[subprocess.Popen], runner: DriverRunner) -> str | None:
    """Why the group cannot serve any more, or None while it can."""
    for rank, child in enumerate(children, start=1):
        code = child.poll()
        if code is not None:
            return f"rank {rank} (pid {child.pid}) exited with code {code}"
    return runner.failure


async def watch_ranks(children: Sequence[subprocess.Popen], runner: DriverRunner) -> str:
    """Returns (the reason) once a rank has failed; a :data:`specinfer.serving.server.Watch`."""
    while True:
        reason = failure(children, runner)
        if reason is not None:
            return reason
        await asyncio.sleep(WATCH_INTERVAL_SECONDS)


def exit_with_parent(interval: float = 0.5) -> None:
    """End this process (code 1) as soon as its parent exits: a spawned rank must not outlive
    rank 0, even when it is blocked in a collective."""
    parent = os.getppid()

    def check() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        os._exit(1)

    threading.Thread(target=check, name="exit-with-parent", daemon=True).start()
