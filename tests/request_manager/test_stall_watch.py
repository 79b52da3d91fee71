"""StallWatch: a gap in the request manager's own running is told apart from a slow worker."""

from __future__ import annotations

import asyncio
import time

from specinfer.request_manager.cluster.failover import StallWatch


def test_a_blocked_loop_is_a_stall_and_a_running_one_is_not():
    async def run() -> None:
        watch = StallWatch(tick=0.02, gap=0.3)
        loop = asyncio.get_running_loop()
        assert not watch.stalled_since(loop.time())  # not started: never
        watch.start()
        await asyncio.sleep(0.1)
        before = loop.time()
        await asyncio.sleep(0.5)  # slow, but the loop runs: no stall
        assert not watch.stalled_since(before)
        time.sleep(0.6)  # the loop (as the whole process under SIGSTOP) does not run
        assert watch.stalled_since(before)  # seen at once, before the ticker has run again
        await asyncio.sleep(0.1)
        assert watch.stalled_since(before)  # and after it
        after = loop.time()
        await asyncio.sleep(0.2)
        assert not watch.stalled_since(after)  # a call begun after the stall: its timeout is real
        watch.close()

    asyncio.run(run())
