"""What both model services share: health, reflection, settings errors, graceful shutdown."""

from __future__ import annotations

import time

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from services.conftest import ssm_worker_command
from services.harness import running_service
from specinfer.llm_verifier.__main__ import main as llm_verifier_main
from specinfer.ssm_worker.__main__ import main as ssm_worker_main

SERVICES = {"ssm_worker": "specinfer.v1.SsmWorker", "llm_verifier": "specinfer.v1.LlmVerifier"}
METHODS = {
    "ssm_worker": {"Speculate", "SpeculateStream", "Release", "ListModels"},
    "llm_verifier": {"Verify", "VerifyStream", "Release", "GetInfo"},
}


@pytest.mark.parametrize("which", list(SERVICES))
def test_health_serving(services, which):
    with grpc.insecure_channel(getattr(services, which).address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for name in ("", SERVICES[which]):
            assert (
                stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status
                == health_pb2.HealthCheckResponse.SERVING
            )


@pytest.mark.parametrize("which", list(SERVICES))
def test_reflection_lists_the_service(services, which):
    with grpc.insecure_channel(getattr(services, which).address) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        names = set(db.get_services())
        assert {SERVICES[which], "grpc.health.v1.Health"} <= names
        # the descriptors come along, so tools like grpcurl can call the service untold
        service = DescriptorPool(db).FindServiceByName(SERVICES[which])
        assert {m.name for m in service.methods} == METHODS[which]


def test_sigterm_drains_and_exits_zero(model_pair, tmp_path):
    """SIGTERM: health turns NOT_SERVING at once and the process exits 0 within the grace
    period (an open Watch stream is an in-flight call, so it holds the server that long).

    One service suffices here: both shut down through :func:`specinfer.serving.server.run_service`,
    and the session's services are stopped with SIGTERM, their exit codes checked, by the harness.
    """
    grace = 1.0
    command = [*ssm_worker_command(model_pair), "--grace-seconds", str(grace)]
    with running_service(command, workdir=tmp_path) as svc, grpc.insecure_channel(svc.address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=SERVICES["ssm_worker"]), timeout=30
        )
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        started = time.monotonic()
        svc.terminate()
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert svc.process.wait(timeout=grace + 10) == 0
        assert time.monotonic() - started < grace + 5


@pytest.mark.parametrize(
    ("main", "argv", "message"),
    [
        (ssm_worker_main, [], "ssm: name at least one SSM checkpoint"),
        (
            ssm_worker_main,
            ["--ssm", "a=/no/such/folder"],
            "--ssm (ssm.a): '/no/such/folder' is not a Hugging Face checkpoint folder",
        ),
        (ssm_worker_main, ["--ssm", "a=x,a=y"], "ssm: name 'a' is given twice"),
        (
            llm_verifier_main,
            ["--llm", "/no/such/folder"],
            "llm: '/no/such/folder' is not a Hugging Face checkpoint folder",
        ),
        (llm_verifier_main, ["--llm", "a,b"], "llm: name exactly one checkpoint"),
    ],
)
def test_bad_settings_exit_2(main, argv, message, tmp_path, capsys, restore_logging):
    port_file = tmp_path / "port"
    assert main([*argv, "--port-file", str(port_file)]) == 2
    assert message in capsys.readouterr().err
    assert not port_file.exists()  # a launcher waiting for the port gives up when the process exits
