"""The CPU kernels' thread team (``cpu_team.c``, built into :mod:`.cpu_qgemm`'s library): what a service tells it.

The team's workers busy-wait 5 ms after each call of the kernels, which keeps them ready for the
next call of a step, and then sleep. A model service's next call is a network round trip away, and there a spinning
worker only takes a core from the processes that make that round trip (the request manager, Redis, the client), so
the service's model runner sends the workers to sleep after each call (:func:`rest`) and wakes them as the next one
begins (:func:`wake`), before the Python work that precedes the kernels. Both are no-ops until the kernels have
been loaded in the process (a service whose model does not use them never builds them for this).
"""

from __future__ import annotations

from . import cpu_qgemm


def wake() -> None:
    """Wake the sleeping workers: a call of the kernels is coming."""
    lib = cpu_qgemm.loaded()
    if lib is not None:
        lib.team_wake()


def rest() -> None:
    """Let the idle workers sleep now rather than after their busy wait: no call is coming soon."""
    lib = cpu_qgemm.loaded()
    if lib is not None:
        lib.team_rest()


def workers() -> int:
    """The workers started so far (0 where the kernels do not run)."""
    lib = cpu_qgemm.library()
    return 0 if lib is None else int(lib.team_workers())


def cpu_seconds() -> float:
    """The CPU time the workers have used (0 where the kernels do not run)."""
    lib = cpu_qgemm.library()
    return 0.0 if lib is None else float(lib.team_cpu_seconds())
