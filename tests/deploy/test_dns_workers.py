"""``--ssm-workers dns:///name:port``: the request manager finds every SSM worker replica in DNS.

Fake SSM workers (in-process gRPC servers answering ListModels and Release) stand in for the
real ones; the lookups are real for ``localhost`` and scripted (monkeypatched) for membership
changes.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from specinfer.request_manager.cluster.discovery import DnsTarget
from specinfer.request_manager.cluster.ssm_workers import SsmWorkers
from specinfer.request_manager.state.redis_server import free_tcp_port
from specinfer.serving.security import ClientAuth, ClientTls
from specinfer.v1 import internal_pb2, internal_pb2_grpc

VOCAB = 259


class FakeWorker(internal_pb2_grpc.SsmWorkerServicer):
    def __init__(self, models: tuple[str, ...] = ("ssm",), vocab_size: int = VOCAB) -> None:
        self.models, self.vocab_size = models, vocab_size
        self.released: list[str] = []

    async def ListModels(self, request, context):
        return internal_pb2.ListModelsResponse(models=self.models, vocab_size=self.vocab_size)

    async def Release(self, request, context):
        self.released += request.request_ids
        return internal_pb2.ReleaseResponse()


async def start_fake(worker: FakeWorker) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    internal_pb2_grpc.add_SsmWorkerServicer_to_server(worker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), 20))


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("ssm-worker:50052", None),
        ("10.0.0.7:50052", None),
        ("dns:///ssm-worker:50052", DnsTarget("ssm-worker", 50052)),
        (
            "dns:ssm-worker.specinfer.svc.cluster.local:50052",
            DnsTarget("ssm-worker.specinfer.svc.cluster.local", 50052),
        ),
        ("dns:///[::1]:50052", DnsTarget("::1", 50052)),
    ],
)
def test_parse_targets(target, expected):
    assert DnsTarget.parse(target) == expected


@pytest.mark.parametrize(
    "target", ["dns:///ssm-worker", "dns:///:50052", "dns:///ssm-worker:http", "dns://8.8.8.8/ssm-worker:50052"]
)
def test_bad_dns_targets_fail_at_start_up(target):
    with pytest.raises(ValueError, match="SSM worker target"):
        SsmWorkers([target], timeout=1.0)


def test_localhost_resolves_to_its_loopback_addresses():
    addresses = asyncio.run(DnsTarget("localhost", 50052).resolve())
    assert "127.0.0.1:50052" in addresses
    assert set(addresses) <= {"127.0.0.1:50052", "[::1]:50052"}
    assert addresses == sorted(addresses)


def test_discover_uses_every_address_of_the_name(caplog):
    async def test() -> None:
        server, port = await start_fake(FakeWorker(("ssm", "ssm2")))
        workers = SsmWorkers([f"dns:///localhost:{port}", f"dns:///localhost:{port}"], timeout=5.0, refresh_seconds=0)
        try:
            with caplog.at_level(logging.INFO, logger="specinfer.request_manager"):
                await workers.discover()
            assert "127.0.0.1:" + str(port) in workers.addresses  # duplicates (same name twice) collapse
            assert len(workers.addresses) == len(set(workers.addresses))
            assert set(workers.models) == {"ssm", "ssm2"}
            assert workers.vocab_size == VOCAB
            assert workers.worker_for("r1", "ssm") in workers.addresses
            logged = [r for r in caplog.records if r.getMessage() == "SSM workers resolved"]
            assert logged and logged[0].addresses == workers.addresses
            assert workers._refresher is None  # refresh_seconds=0: looked up once
        finally:
            await workers.close()
            await server.stop(None)

    run(test)


def test_plain_addresses_are_used_as_given():
    async def test() -> None:
        server, port = await start_fake(FakeWorker())
        workers = SsmWorkers([f"127.0.0.1:{port}"], timeout=5.0)
        try:
            await workers.discover()
            assert workers.addresses == [f"127.0.0.1:{port}"]
            assert workers._refresher is None  # nothing to look up again
        finally:
            await workers.close()
            await server.stop(None)

    run(test)


def scripted_lookup(monkeypatch, answers: list[list[str] | OSError]) -> None:
    """DnsTarget.resolve answers from ``answers``, one per call (the last one repeats)."""

    async def resolve(self: DnsTarget) -> list[str]:
        answer = answers.pop(0) if len(answers) > 1 else answers[0]
        if isinstance(answer, OSError):
            raise answer
        return answer

    monkeypatch.setattr(DnsTarget, "resolve", resolve)


def test_discover_does_not_wait_for_the_name_and_joins_when_it_appears(monkeypatch):
    async def test() -> None:
        server, port = await start_fake(FakeWorker())
        answers: list[list[str] | OSError] = [socket.gaierror(socket.EAI_NONAME, "not known")]
        scripted_lookup(monkeypatch, answers)
        workers = SsmWorkers(["dns:///ssm-worker:50052"], timeout=5.0, refresh_seconds=0, probe_seconds=0.05)
        changes: list[int] = []
        workers.on_change = lambda: changes.append(len(workers.addresses))
        try:
            await workers.discover()  # returns at once: start-up does not wait for the workers
            assert workers.addresses == [] and workers.models == {}
            answers[:] = [[f"127.0.0.1:{port}"]]
            for _ in range(100):
                if workers.addresses:
                    break
                await asyncio.sleep(0.05)
            assert workers.addresses == [f"127.0.0.1:{port}"]
            assert workers.models == {"ssm": [f"127.0.0.1:{port}"]}
            assert changes == [1]
        finally:
            await workers.close()
            await server.stop(None)

    run(test)


def test_plain_addresses_that_are_down_join_when_they_come_up():
    async def test() -> None:
        up_server, up_port = await start_fake(FakeWorker(models=("a",)))
        down_port = free_tcp_port()
        up, down = f"127.0.0.1:{up_port}", f"127.0.0.1:{down_port}"
        workers = SsmWorkers([up, down], timeout=30.0, probe_seconds=0.05, vocab_size=VOCAB)
        try:
            started = time.monotonic()
            await workers.discover()
            assert time.monotonic() - started < workers.join_seconds + 1  # not the 30 s call timeout
            assert workers.addresses == [up] and workers.pending == [down]
            assert workers.models == {"a": [up]}
            late = grpc.aio.server()
            internal_pb2_grpc.add_SsmWorkerServicer_to_server(FakeWorker(models=("a", "b")), late)
            late.add_insecure_port(down)
            await late.start()
            try:
                for _ in range(100):
                    if workers.addresses == [up, down]:
                        break
                    await asyncio.sleep(0.05)
                assert workers.addresses == [up, down] and workers.pending == []
                assert workers.models == {"a": [up, down], "b": [down]}
                for _ in range(20):  # nothing left to look for: the background lookups end
                    if workers._refresher is None:
                        break
                    await asyncio.sleep(0.05)
                assert workers._refresher is None
            finally:
                await late.stop(None)
        finally:
            await workers.close()
            await up_server.stop(None)

    run(test)


def test_a_worker_with_another_vocabulary_is_refused_at_start_up():
    async def test() -> None:
        server, port = await start_fake(FakeWorker(vocab_size=VOCAB + 1))
        workers = SsmWorkers([f"127.0.0.1:{port}"], timeout=5.0, vocab_size=VOCAB)
        try:
            with pytest.raises(ValueError, match="vocabulary"):
                await workers.discover()
        finally:
            await workers.close()
            await server.stop(None)

    run(test)


def test_refresh_follows_scaling(monkeypatch):
    async def test() -> None:
        fakes = [FakeWorker(), FakeWorker(), FakeWorker(vocab_size=VOCAB + 1)]
        servers = [await start_fake(f) for f in fakes]
        a, b, odd = (f"127.0.0.1:{port}" for _, port in servers)
        dead = f"127.0.0.1:{free_tcp_port()}"
        answers: list[list[str] | OSError] = [[a]]
        scripted_lookup(monkeypatch, answers)
        workers = SsmWorkers(["dns:///ssm-worker:50052"], timeout=1.0, refresh_seconds=0)
        try:
            await workers.discover()
            assert workers.addresses == [a]
            # scale up: b joins; a replica that does not answer, or has another vocabulary, does not
            answers[:] = [[a, b, dead, odd]]
            await workers.refresh()
            assert workers.addresses == [a, b]
            assert workers.models == {"ssm": [a, b]}
            owner = {rid: workers.worker_for(rid, "ssm") for rid in (f"r{i}" for i in range(40))}
            assert set(owner.values()) == {a, b}  # requests spread over both
            for rid, address in owner.items():  # as if each request had drafted on its worker
                workers._trackers[address].sent(rid, 3)
            # a failed or empty lookup keeps the workers
            for answer in (socket.gaierror(socket.EAI_AGAIN, "temporary failure"), []):
                answers[:] = [answer]
                await workers.refresh()
                assert workers.addresses == [a, b]
            # scale down: a leaves; its requests move to b, which rebuilds their caches
            answers[:] = [[b]]
            await workers.refresh()
            assert workers.addresses == [b]
            assert workers.models == {"ssm": [b]}
            assert all(workers.worker_for(rid, "ssm") == b for rid in owner)
            await workers.release(list(owner))
            assert sorted(fakes[1].released) == sorted(rid for rid, address in owner.items() if address == b)
            assert fakes[0].released == []  # a left: nothing is sent there
        finally:
            await workers.close()
            for server, _ in servers:
                await server.stop(None)

    run(test)


def test_refresh_runs_in_the_background(monkeypatch):
    async def test() -> None:
        servers = [await start_fake(FakeWorker()) for _ in range(2)]
        a, b = (f"127.0.0.1:{port}" for _, port in servers)
        answers: list[list[str] | OSError] = [[a]]
        scripted_lookup(monkeypatch, answers)
        workers = SsmWorkers(["dns:///ssm-worker:50052"], timeout=1.0, refresh_seconds=0.05)
        try:
            await workers.discover()
            answers[:] = [[a, b]]
            for _ in range(100):
                if workers.addresses == [a, b]:
                    break
                await asyncio.sleep(0.05)
            assert workers.addresses == [a, b]
        finally:
            await workers.close()
            for server, _ in servers:
                await server.stop(None)
        assert workers._refresher is not None and workers._refresher.done()

    run(test)


# -- TLS: which name the workers' certificates must carry ----------------------------------------


def worker_certificate(folder: Path) -> tuple[Path, Path, Path]:
    """A CA and a worker certificate for the DNS name ``localhost`` only, no IP address: as in a
    cluster, where the name is known in advance and the pods' addresses are not. (CA, cert, key)."""
    now = datetime.datetime.now(datetime.UTC)

    def cert(subject: str, issuer: str, key, signer, ca: bool, names: list[x509.GeneralName]) -> x509.Certificate:
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True)
        )
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        return builder.sign(signer, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = cert("test CA", "test CA", ca_key, ca_key, True, [])
    leaf = cert("ssm-worker", "test CA", key, ca_key, False, [x509.DNSName("localhost")])
    paths = folder / "ca.crt", folder / "tls.crt", folder / "tls.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return paths


async def start_tls_fake(worker: FakeWorker, cert: Path, key: Path) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    internal_pb2_grpc.add_SsmWorkerServicer_to_server(worker, server)
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())]))
    await server.start()
    return server, port


def joined_over_tls(tmp_path: Path, target: str) -> list[str]:
    """The addresses that join a pool of ``target`` (``{port}`` filled in), calling with TLS and
    trusting only the CA of a worker certificate that names ``localhost``."""
    ca, cert, key = worker_certificate(tmp_path)
    found: list[str] = []

    async def test() -> None:
        server, port = await start_tls_fake(FakeWorker(), cert, key)
        workers = SsmWorkers(
            [target.format(port=port)], timeout=5.0, auth=ClientAuth(ClientTls.from_files(str(ca))), refresh_seconds=0
        )
        try:
            await workers.discover()
            found.extend(workers.addresses)
        finally:
            await workers.close()
            await server.stop(None)

    run(test)
    return found


def test_tls_to_a_worker_named_by_host_checks_that_name(tmp_path):
    """The control for the test below: the certificate and CA are good, and a plain host:port
    target is dialled (and its certificate checked) by that name."""
    assert len(joined_over_tls(tmp_path, "localhost:{port}")) == 1


def test_tls_to_dns_discovered_workers_checks_the_looked_up_name(tmp_path):
    """docker-compose.tls.yml and deploy/k8s/overlays/tls reach the SSM workers through
    dns:///ssm-worker:50052, whose addresses no certificate can list in advance."""
    assert joined_over_tls(tmp_path, "dns:///localhost:{port}")
