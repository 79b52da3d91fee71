"""The CPU kernels' own thread team (kernels/cpu_team.c): results the same on any number of threads, workers that
sleep between calls (the point of the team: OpenMP's spun on a core between steps), one call at a time from many
Python threads, and a forked child that starts workers of its own."""

from __future__ import annotations

import multiprocessing
import threading
import time

import pytest
import torch

from specinfer.kernels import cpu_layers, cpu_qgemm, cpu_team

pytestmark = pytest.mark.skipif(cpu_qgemm.library() is None, reason="the C kernels do not run here")


def _threads(n: int):
    """A context in which torch (and so the kernels' callers) asks for n threads."""

    class Threads:
        def __enter__(self):
            self.before = torch.get_num_threads()
            torch.set_num_threads(n)

        def __exit__(self, *exc):
            torch.set_num_threads(self.before)

    return Threads()


def _inputs(seed: int, rows: int = 9) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 256, generator=g)  # [rows, k]
    w = torch.randn(515, 256, generator=g).to(torch.bfloat16)  # [n, k]: n not a multiple of any tile
    return x, w


def test_any_number_of_threads_gives_the_same_bits():
    x, w = _inputs(0)
    with _threads(1):
        alone = cpu_layers.dense_linear(x, w)
    for n in (2, 3, 5):
        with _threads(n):
            assert torch.equal(cpu_layers.dense_linear(x, w), alone), n
    assert cpu_qgemm.library().team_workers() >= 4  # the team grew to the most threads asked for


def test_workers_sleep_soon_after_a_call():
    """After a call a worker busy-waits 5 ms for the next one, then sleeps: over the next 300 ms the workers use
    almost no CPU."""
    lib = cpu_qgemm.library()
    x, w = _inputs(1, rows=64)
    with _threads(2):
        busy_at = lib.team_cpu_seconds()
        for _ in range(50):
            cpu_layers.dense_linear(x, w)
        used = lib.team_cpu_seconds() - busy_at
        time.sleep(0.02)
        before = lib.team_cpu_seconds()
        time.sleep(0.3)
        idle = lib.team_cpu_seconds() - before
    assert used > 0.0  # the clock reads the workers: they worked (or spun) through the calls
    assert idle < 0.002, f"the workers used {idle * 1e3:.2f} ms of CPU in 300 ms without a call"


def test_calls_from_many_python_threads_run_one_at_a_time():
    """ctypes lets go of the GIL, so four Python threads call the kernels at once: each call must still get the
    whole team and its own inputs' answer."""
    inputs = [_inputs(seed) for seed in range(4)]
    with _threads(1):
        expected = [cpu_layers.dense_linear(x, w) for x, w in inputs]
    wrong: list[int] = []

    def hammer(i: int) -> None:
        x, w = inputs[i]
        for _ in range(40):
            if not torch.equal(cpu_layers.dense_linear(x, w), expected[i]):
                wrong.append(i)

    with _threads(2):
        threads = [threading.Thread(target=hammer, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a call never returned"
    assert not wrong


def _child(conn, x: torch.Tensor, w: torch.Tensor, alone: torch.Tensor) -> None:
    # only our kernels run here: libgomp, which torch's own parallel operations use, does not survive a fork
    torch.set_num_threads(2)
    conn.send(bool(torch.equal(cpu_layers.dense_linear(x, w), alone)))


def test_a_forked_child_starts_its_own_workers():
    """The parent's workers are not in a forked child: its first call starts workers of its own instead of
    waiting for threads that are not there."""
    x, w = _inputs(3)
    with _threads(1):
        alone = cpu_layers.dense_linear(x, w)
    with _threads(2):
        cpu_layers.dense_linear(x, w)  # the parent's team has its worker
    assert cpu_qgemm.library().team_workers() >= 1
    ctx = multiprocessing.get_context("fork")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_child, args=(there, x, w, alone))
    child.start()
    child.join(timeout=60)
    if child.is_alive():
        child.kill()
        pytest.fail("the forked child's call never returned")
    assert child.exitcode == 0 and here.poll() and here.recv() is True


def test_rest_sends_idle_workers_to_sleep_and_wake_wakes_them():
    """A service's runner: rest() after a call ends the workers' busy wait at once (without it they spin 5 ms after
    every call), wake() starts it again before a call comes. CPU time under another test process's load is noisy:
    the best of a few attempts must show it."""
    x, w = _inputs(4)

    def spun_after_calls(rest: bool) -> float:
        spent = 0.0
        for _ in range(20):
            cpu_layers.dense_linear(x, w)
            if rest:
                cpu_team.rest()
            before = cpu_team.cpu_seconds()
            time.sleep(0.004)
            spent += cpu_team.cpu_seconds() - before
        return spent

    def woken_spin() -> float:
        cpu_team.rest()
        time.sleep(0.01)
        before = cpu_team.cpu_seconds()
        cpu_team.wake()
        time.sleep(0.004)
        return cpu_team.cpu_seconds() - before

    attempts = []
    with _threads(2):
        for _ in range(5):
            spinning, resting, woken = spun_after_calls(rest=False), spun_after_calls(rest=True), woken_spin()
            attempts.append((spinning, resting, woken))
            if resting < spinning / 2 and woken > 0.0003:  # the worker spun after wake() though no call came
                return
    pytest.fail(f"(spun without rest, with rest, after wake) seconds: {attempts}")
