"""HealthProbes: a worker taken out is back soon after it serves again, however long it was down.

The probe runs on the worker's own channel, whose reconnect backoff grows while the worker is down;
a probe during the backoff fails at once. The fault campaign found that with a 5 s cap the manager
took a restarted worker back up to 5 s after it served, long enough for the other worker to fail
meanwhile and leave its SSM with none.
"""

from __future__ import annotations

import asyncio
import socket
import time

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specinfer.request_manager.cluster.failover import CHANNEL_OPTIONS, PROBE_SECONDS, HealthProbes

pytestmark = pytest.mark.reliability  # waits DOWN_SECONDS

DOWN_SECONDS = 15.0  # long enough that the old 5 s cap took it back 4 s late (measured); 8 s did not show it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _serve(port: int) -> grpc.aio.Server:
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server


def test_a_worker_down_for_long_is_back_within_two_probe_periods_of_serving():
    async def run() -> float:
        port = _free_port()
        address = f"127.0.0.1:{port}"
        server = await _serve(port)
        channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)  # connected
        await server.stop(None)  # the worker dies
        back = asyncio.Event()
        probes = HealthProbes(PROBE_SECONDS, (), lambda a: back.set())
        probes.take_out(address, channel)
        await asyncio.sleep(DOWN_SECONDS)  # probes fail and the channel's reconnect backoff grows
        assert not back.is_set() and address in probes
        server = await _serve(port)  # restarted on the same address
        serving = time.monotonic()
        await asyncio.wait_for(back.wait(), 30)
        took = time.monotonic() - serving
        assert address not in probes
        probes.close()
        await channel.close()
        await server.stop(None)
        return took

    took = asyncio.run(run())
    # one probe period plus at most one reconnect backoff (capped at PROBE_SECONDS, +20% jitter)
    assert took < 2 * PROBE_SECONDS + 0.6, f"taken back {took:.2f} s after serving"
