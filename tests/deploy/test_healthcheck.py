"""``python -m specinfer.serving.healthcheck``: the images' HEALTHCHECK, against a real gRPC health service."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specinfer.serving import healthcheck
from specinfer.serving.config import env_name


@pytest.fixture
def server() -> Iterator[tuple[str, health.HealthServicer]]:
    servicer = health.HealthServicer()
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        srv.stop(None)


def test_exit_code_follows_the_health_status(server, capsys):
    address, servicer = server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert healthcheck.main([address]) == 0
    assert capsys.readouterr().out == f"{address}: SERVING\n"
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert healthcheck.main([address]) == 1
    servicer.set("specinfer.v1.SsmWorker", health_pb2.HealthCheckResponse.SERVING)
    assert healthcheck.main([address, "--service", "specinfer.v1.SsmWorker"]) == 0
    assert healthcheck.main([address, "--service", "specinfer.v1.Unknown"]) == 1
    assert "NOT_FOUND" in capsys.readouterr().out


def test_unreachable_is_unhealthy():
    assert healthcheck.check("127.0.0.1:1", timeout=2.0) == "UNAVAILABLE"


def test_address_defaults_to_the_service_port(server, monkeypatch):
    """The images run it without arguments: 127.0.0.1:$SPECINFER_PORT, in a fresh interpreter."""
    address, servicer = server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert env_name("--port") == healthcheck.PORT_ENV
    env = {**os.environ, "SPECINFER_PORT": address.rpartition(":")[2]}
    out = subprocess.run(
        [sys.executable, "-m", "specinfer.serving.healthcheck"], env=env, capture_output=True, text=True, timeout=30
    )
    assert (out.returncode, out.stdout) == (0, f"{address}: SERVING\n")
    monkeypatch.delenv("SPECINFER_PORT", raising=False)
    with pytest.raises(SystemExit) as exc:
        healthcheck.main([])
    assert exc.value.code == 2
