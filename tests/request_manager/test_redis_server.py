"""EmbeddedRedis: transports, clean stop, and a clear error when there is no redis-server."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from specinfer.request_manager.redis_server import EmbeddedRedis, RedisBinaryNotFoundError, RedisStartError


def test_missing_binary_is_a_clear_error(tmp_path: Path):
    with pytest.raises(RedisBinaryNotFoundError, match="does not exist"):
        EmbeddedRedis(tmp_path, executable=tmp_path / "no-redis-server")


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_starts_answers_and_stops(tmp_path: Path, redis_binary: Path, transport: str):
    server = EmbeddedRedis(tmp_path, transport=transport, executable=redis_binary)
    with server:
        assert server.running
        assert server.url.startswith("unix://" if transport == "unix" else "redis://127.0.0.1:")
        with server.client() as client:
            assert client.ping()
            assert client.config_get("save") == {"save": ""}
            assert client.config_get("appendonly") == {"appendonly": "no"}
        assert os.stat(server.config_path).st_mode & 0o077 == 0  # the config may hold a password
    assert not server.running and server.pid is None
    assert not server.socket_path.exists()
    server.close()  # idempotent


def test_long_state_dir_falls_back_to_tcp(tmp_path: Path, redis_binary: Path):
    deep = tmp_path / ("d" * 120)
    with pytest.raises(ValueError, match="too long"):
        EmbeddedRedis(deep, transport="unix", executable=redis_binary)
    with EmbeddedRedis(deep, executable=redis_binary) as server:
        assert server.transport == "tcp"
        with server.client() as client:
            assert client.ping()


def test_a_server_that_cannot_start_reports_its_log(tmp_path: Path, redis_binary: Path):
    with pytest.raises(RedisStartError, match="exited"):
        EmbeddedRedis(tmp_path, executable=redis_binary, extra_config=["no-such-directive yes"]).start()
