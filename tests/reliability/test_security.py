"""TLS, mTLS and bearer tokens on every port of a running stack; Redis ACL users."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specinfer.client import Client
from specinfer.core.drafts import PAPER_EXPANSION
from specinfer.launcher import Stack, StackConfig
from specinfer.request_manager.state.redis_client import connect
from specinfer.request_manager.state.redis_server import EmbeddedRedis
from specinfer.serving.security import ClientAuth, ClientTls, StackSecurity
from specinfer.v1 import api_pb2, internal_pb2, internal_pb2_grpc

from .certs import make_certs
from .conftest import tokens_of

pytestmark = pytest.mark.reliability

AUTH_TOKEN = "public-4f9c2e7d1a-token"
INTERNAL_TOKEN = "internal-8b3d6f0e2c-token"
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def secure_stack(model_pair, certs, tmp_path_factory):
    """Every port TLS with client certificates required (mTLS), a public and an internal token."""
    security = StackSecurity(
        cert=str(certs.server_cert),
        key=str(certs.server_key),
        ca=str(certs.ca),
        client_ca=str(certs.ca),
        client_cert=str(certs.client_cert),
        client_key=str(certs.client_key),
        auth_token=AUTH_TOKEN,
        internal_token=INTERNAL_TOKEN,
    )
    # a static tree, so every request drafts and a refused SSM worker shows (adaptive speculation may rightly not
    # speculate)
    cfg = StackConfig(
        llm=model_pair.llm,
        ssms=(model_pair.ssm,),
        workers=1,
        port=0,
        state_dir=tmp_path_factory.mktemp("state"),
        threads=1,
        expansion=PAPER_EXPANSION,
        security=security,
    )
    stack = Stack(cfg).start()
    try:
        yield stack
    finally:
        codes = stack.stop()
    assert all(code == 0 for code in codes.values()), codes


def _full_tls(certs) -> ClientTls:
    return ClientTls.from_files(str(certs.ca), str(certs.client_cert), str(certs.client_key))


def test_with_tls_client_certificate_and_token_it_works(secure_stack, certs, model_pair, greedy):
    prompt = model_pair.prompts[0]
    with Client(secure_stack.address, timeout=120, auth=ClientAuth(_full_tls(certs), AUTH_TOKEN)) as client:
        messages = list(client.stream(Client.request(prompt, NEW_TOKENS, ignore_eos=True)))
    assert messages[-1].finished.reason == api_pb2.FINISH_REASON_LENGTH
    assert tokens_of(messages) == greedy(
        prompt, NEW_TOKENS
    )  # the verifier answered the request manager over mTLS with the token
    assert (
        messages[-1].finished.usage.mean_tree_size > 1
    )  # so did the SSM worker (a refused worker would leave root-only trees)


@pytest.mark.parametrize(
    "case",
    [
        "plaintext",
        "tls-without-client-cert",
        "tls-trusting-another-ca",
        "no-token",
        "wrong-token",
        "token-with-another-scheme",
    ],
)
def test_without_the_credentials_it_is_refused(secure_stack, certs, case):
    full = _full_tls(certs)
    auth = {
        "plaintext": ClientAuth(ClientTls(), AUTH_TOKEN),
        "tls-without-client-cert": ClientAuth(ClientTls.from_files(str(certs.ca)), AUTH_TOKEN),
        "tls-trusting-another-ca": ClientAuth(
            ClientTls.from_files(str(certs.other_ca), str(certs.client_cert), str(certs.client_key)), AUTH_TOKEN
        ),
        "no-token": ClientAuth(full),
        "wrong-token": ClientAuth(full, AUTH_TOKEN + "x"),
        "token-with-another-scheme": ClientAuth(full),
    }[case]
    want = (
        grpc.StatusCode.UNAUTHENTICATED
        if case in ("no-token", "wrong-token", "token-with-another-scheme")
        else grpc.StatusCode.UNAVAILABLE
    )
    with Client(secure_stack.address, timeout=10, auth=auth) as client:
        if case == "token-with-another-scheme":
            client.metadata = (("authorization", f"Basic {AUTH_TOKEN}"),)
        with pytest.raises(grpc.RpcError) as err:
            client.model_info()
        assert err.value.code() == want, err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            client.generate(Client.request([5, 6, 7], 4))
        assert err.value.code() == want, err.value.details()


def test_health_is_open_but_needs_tls(secure_stack, certs):
    """Probes check health without a token (they still need the TLS files)."""
    for proc in secure_stack.processes:
        with ClientAuth(_full_tls(certs)).channel(proc.address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, proc.name


@pytest.mark.parametrize("token", ["", AUTH_TOKEN], ids=["no-token", "public-token"])
def test_internal_services_refuse_calls_without_the_internal_token(secure_stack, certs, token):
    """Even with a valid client certificate, and even with the public API's token."""
    auth = ClientAuth(_full_tls(certs), token)
    worker, verifier = secure_stack.process("ssm-worker-0"), secure_stack.process("llm-verifier")
    with auth.channel(worker.address) as channel, pytest.raises(grpc.RpcError) as err:
        internal_pb2_grpc.SsmWorkerStub(channel).ListModels(
            internal_pb2.ListModelsRequest(), timeout=10, metadata=auth.metadata
        )
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with auth.channel(verifier.address) as channel, pytest.raises(grpc.RpcError) as err:
        internal_pb2_grpc.LlmVerifierStub(channel).GetInfo(
            internal_pb2.LlmInfoRequest(), timeout=10, metadata=auth.metadata
        )
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    good = ClientAuth(_full_tls(certs), INTERNAL_TOKEN)
    with good.channel(worker.address) as channel:
        assert (
            internal_pb2_grpc.SsmWorkerStub(channel)
            .ListModels(internal_pb2.ListModelsRequest(), timeout=10, metadata=good.metadata)
            .models
        )


def test_help_does_not_print_tokens(monkeypatch):
    from specinfer.request_manager.config import RequestManagerConfig

    monkeypatch.setenv("SPECINFER_AUTH_TOKEN", AUTH_TOKEN)
    monkeypatch.setenv("SPECINFER_REDIS_PASSWORD", "redis-secret-xyz")
    monkeypatch.setenv("SPECINFER_INTERNAL_TOKEN", INTERNAL_TOKEN)
    text = RequestManagerConfig.parser().format_help()
    assert AUTH_TOKEN not in text and "redis-secret-xyz" not in text and INTERNAL_TOKEN not in text
    cfg = RequestManagerConfig.from_args([])
    assert AUTH_TOKEN not in repr(cfg) and "redis-secret-xyz" not in repr(cfg) and INTERNAL_TOKEN not in repr(cfg)
    assert cfg.security.tokens == (AUTH_TOKEN,) and cfg.internal.token == INTERNAL_TOKEN


def test_redis_acl_user(tmp_path):
    """--redis-username: an ACL user gets in with its own password, not with the default user's."""
    acl = ["user specinfer on >acl-secret ~* &* +@all"]
    with EmbeddedRedis(tmp_path / "redis", transport="tcp", password="default-secret", extra_config=acl) as server:

        async def ping(username, password):
            client = connect(server.url, password=password, username=username)
            try:
                return await client.ping()
            finally:
                await client.aclose()

        assert asyncio.run(ping("specinfer", "acl-secret"))
        for username, password in [(None, "acl-secret"), ("specinfer", "wrong"), (None, None)]:
            with pytest.raises(redis.exceptions.RedisError):
                asyncio.run(ping(username, password))


def test_health_probe_and_cli_take_the_tls_files_and_token(secure_stack, certs, model_pair, tmp_path):
    """The container health probe and ``specinfer generate --server`` reach a TLS + token stack
    with the settings, and fail without them."""
    import os
    import subprocess
    import sys

    from specinfer.serving.healthcheck import main as probe

    tls = [
        "--tls-ca",
        str(certs.ca),
        "--tls-client-cert",
        str(certs.client_cert),
        "--tls-client-key",
        str(certs.client_key),
    ]
    assert probe([secure_stack.address, *tls]) == 0
    assert probe([secure_stack.address, "--timeout", "2"]) == 1  # plaintext probe of a TLS port
    token_file = tmp_path / "token"
    token_file.write_text(AUTH_TOKEN + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECINFER_")}
    base = [
        sys.executable,
        "-m",
        "specinfer.cli",
        "generate",
        "--server",
        secure_stack.address,
        "--max-new-tokens",
        "4",
    ]
    ok = subprocess.run(
        [*base, *tls, "--auth-token-file", str(token_file), "def main():"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert ok.returncode == 0 and "4 tokens" in ok.stdout, ok.stderr
    refused = subprocess.run([*base, *tls, "def main():"], capture_output=True, text=True, env=env, timeout=120)
    assert refused.returncode == 2 and "UNAUTHENTICATED" in refused.stderr, refused.stderr


def test_no_secret_in_logs(secure_stack, certs):
    """Run last in the module: the logs then hold start-up, calls and refusals."""
    logs = {
        p.name: (secure_stack.workdir / f"{p.name}.log").read_text(errors="replace") for p in secure_stack.processes
    }
    assert all(logs.values())
    for name, text in logs.items():
        for secret in (
            AUTH_TOKEN,
            INTERNAL_TOKEN,
            certs.server_key.read_text().splitlines()[1],
            certs.client_key.read_text().splitlines()[1],
        ):
            assert secret not in text, f"a secret is in the log of {name}"
