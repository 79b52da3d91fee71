"""EmbeddedRedis: transports, clean stop, a clear error when there is no redis-server, one owner per
state dir, and no server left behind by an owner that failed or was killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specinfer.request_manager.state.redis_server import (
    EmbeddedRedis,
    RedisBinaryNotFoundError,
    RedisStartError,
    StateDirInUse,
)


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


def redis_servers_in(state_dir: Path) -> list[int]:
    """Pids of the redis-server processes running from ``state_dir`` (their working directory: it or its data dir)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            exe = os.path.basename(os.readlink(entry / "exe"))
            cwd = Path(os.readlink(entry / "cwd"))
        except OSError:
            continue
        if exe.startswith("redis-server") and cwd in (
            state_dir.resolve(),
            state_dir.resolve() / "data",
        ):  # redis chdirs to its data dir
            out.append(int(entry.name))
    return out


def test_owned_refuses_a_second_owner_and_stops_on_the_way_out(tmp_path: Path, redis_binary: Path):
    first = EmbeddedRedis(tmp_path, executable=redis_binary)
    with first.owned():
        assert redis_servers_in(tmp_path) == [first.pid]
        with (
            pytest.raises(StateDirInUse, match=f"pid {os.getpid()}"),
            EmbeddedRedis(tmp_path, executable=redis_binary).owned(),
        ):
            pass
        assert redis_servers_in(tmp_path) == [first.pid]  # the refused owner touched nothing
    assert redis_servers_in(tmp_path) == []
    with pytest.raises(RuntimeError, match="boom"), EmbeddedRedis(tmp_path, executable=redis_binary).owned():
        raise RuntimeError("boom")
    assert redis_servers_in(tmp_path) == []  # stopped on an error too


def test_owned_stops_a_dead_owners_server_and_keeps_its_data(tmp_path: Path, redis_binary: Path):
    # a predecessor that died without stopping its server: the server runs on, its pid in redis.pid
    orphan = EmbeddedRedis(tmp_path, appendonly=True, appendfsync="always", executable=redis_binary).start()
    with orphan.client() as client:
        client.set("kept", b"yes")
    orphan._process = None  # forget it, as a killed owner would (the process keeps running)
    assert len(redis_servers_in(tmp_path)) == 1
    successor = EmbeddedRedis(tmp_path, appendonly=True, executable=redis_binary)
    with successor.owned():
        assert redis_servers_in(tmp_path) == [successor.pid]  # the orphan is gone, never two on one AOF
        with successor.client() as client:
            assert client.get("kept") == b"yes"
    assert redis_servers_in(tmp_path) == []


def test_die_with_parent_stops_the_server_when_its_owner_is_killed(tmp_path: Path, redis_binary: Path):
    owner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from specinfer.request_manager.state.redis_server import EmbeddedRedis\n"
            f"EmbeddedRedis({str(tmp_path)!r}, executable={str(redis_binary)!r}, die_with_parent=True).start()\n"
            "print('up', flush=True)\n"
            "time.sleep(600)\n",
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert owner.stdout is not None and owner.stdout.readline().strip() == b"up"
        assert len(redis_servers_in(tmp_path)) == 1
        owner.kill()
        owner.wait(10)
        deadline = time.monotonic() + 10
        while redis_servers_in(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert redis_servers_in(tmp_path) == []
    finally:
        owner.kill()
        for pid in redis_servers_in(tmp_path):
            os.kill(pid, signal.SIGKILL)
