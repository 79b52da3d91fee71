"""End to end on a Redis Cluster: the stack's request manager keeps its requests in a real 3-master,
3-replica cluster (--redis-cluster) and has every write acknowledged by a replica
(--redis-min-replica-acks 1). kill -9 the master that holds most of 8 running streams' keys: its
replica is promoted, the failed node comes back as the new master's replica (as a restarted pod
would), and every stream finishes with exactly transformers' greedy output, nothing lost or
repeated."""

from __future__ import annotations

import collections
import concurrent.futures

import pytest
from oracles import hf_greedy, serving  # tests/oracles.py
from redis_cluster import LocalRedisCluster  # tests/redis_cluster.py
from services.harness import wait_until  # tests/services/harness.py

from specinfer.client import Client
from specinfer.core.drafts import PAPER_EXPANSION
from specinfer.launcher import StackConfig
from specinfer.request_manager.state.redis_layout import KeySpace
from specinfer.request_manager.state.redis_server import RedisBinaryNotFoundError, find_redis_server
from specinfer.v1 import api_pb2

STREAMS = 8
NEW_TOKENS = 64  # long enough that every stream is mid-way when the master dies (asserted)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    try:
        find_redis_server()
    except RedisBinaryNotFoundError as exc:
        pytest.skip(str(exc))
    with LocalRedisCluster(tmp_path_factory.mktemp("redis-cluster")) as c:
        yield c


@pytest.fixture(scope="module")
def stack(model_pair, cluster, tmp_path_factory):
    cfg = StackConfig(
        llm=model_pair.llm,
        ssms=(model_pair.ssm,),
        workers=1,
        port=0,
        state_dir=tmp_path_factory.mktemp("state"),
        expansion=PAPER_EXPANSION,
        threads=1,
        redis_url=cluster.url,
        redis_cluster=True,
        rm_args=("--max-batch", "16", "--redis-min-replica-acks", "1"),
    )
    with serving(cfg) as s:
        yield s


def progress(client: Client, request_id: str) -> int:
    """Committed output tokens of a request (0 while unknown or while Redis cannot answer)."""
    try:
        return len(client.get_request(request_id).output_token_ids)
    except Exception:
        return 0


def test_streams_finish_exactly_through_the_failover_of_a_master(stack, cluster, model_pair):
    prompts = model_pair.prompts[:STREAMS]
    expected = hf_greedy(model_pair.llm, prompts, NEW_TOKENS, ignore_eos=True)
    ids = [f"cluster-{i}" for i in range(STREAMS)]
    keys = KeySpace()  # the request manager's (default prefix)
    homes = {rid: cluster.master_of(keys.meta(rid)) for rid in ids}
    victim, held = collections.Counter(homes.values()).most_common(1)[0]
    assert held >= 2, "the streams' keys are spread too thin to make the failover matter"

    with Client(stack.address, timeout=600) as client, concurrent.futures.ThreadPoolExecutor(STREAMS) as pool:
        futures = [
            pool.submit(
                lambda p, r: list(client.stream(Client.request(p, NEW_TOKENS, request_id=r, ignore_eos=True))), p, r
            )
            for p, r in zip(prompts, ids, strict=True)
        ]
        wait_until(lambda: all(progress(client, r) > 0 for r in ids), 120, "every stream committing")
        replica = cluster.kill_master(victim)
        before = [progress(client, r) for r in ids if homes[r] is victim]
        cluster.wait_promoted(replica)
        cluster.restart(victim)  # until it follows the new master, that shard's writes wait for an acknowledgement
        cluster.wait_replica_of(victim, replica)
        results = [f.result(timeout=600) for f in futures]

    assert all(b < NEW_TOKENS for b in before), (
        "a stream on the failed master finished before it died: make NEW_TOKENS larger"
    )
    for i, messages in enumerate(results):
        tokens: list[int] = []
        for m in messages:
            assert m.offset == len(tokens), f"stream {i}: offset {m.offset} after {len(tokens)} tokens"
            tokens.extend(m.token_ids)
        assert messages[-1].finished.reason == api_pb2.FINISH_REASON_LENGTH, f"stream {i}: {messages[-1].finished}"
        assert tokens == expected[i], f"stream {i} differs from transformers"
    with Client(stack.address, timeout=60) as client:  # and Redis holds each output whole
        for i, rid in enumerate(ids):
            assert list(client.get_request(rid).output_token_ids) == expected[i]
    log = (stack.workdir / "request-manager.log").read_text(errors="replace")
    assert "redis call retried" in log  # the client rode out the failover
