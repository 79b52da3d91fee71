"""The two model services as separate processes, started once per test session (in parallel)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest

from services.harness import ServiceProcess, running_services
from specinfer.v1 import internal_pb2_grpc

# two service processes share this machine's cores with the test process
COMMON_FLAGS = ["--torch-threads", "1", "--kv-cache-bytes", str(256 << 20), "--grace-seconds", "5"]


def ssm_worker_command(model_pair, *flags: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "specinfer.ssm_worker",
        "--ssm",
        f"ssm={model_pair.ssm},ssm2={model_pair.ssm2}",
        *COMMON_FLAGS,
        *flags,
    ]


def llm_verifier_command(model_pair, *flags: str) -> list[str]:
    return [sys.executable, "-m", "specinfer.llm_verifier", "--llm", f"llm={model_pair.llm}", *COMMON_FLAGS, *flags]


@dataclass(frozen=True)
class Services:
    ssm_worker: ServiceProcess
    llm_verifier: ServiceProcess
    ssm_stub: internal_pb2_grpc.SsmWorkerStub
    llm_stub: internal_pb2_grpc.LlmVerifierStub


@pytest.fixture(scope="session")
def services(model_pair, tmp_path_factory) -> Iterator[Services]:
    logs = tmp_path_factory.mktemp("service-logs")
    with (
        running_services([ssm_worker_command(model_pair), llm_verifier_command(model_pair)], workdir=logs) as (
            ssm,
            llm,
        ),
        grpc.insecure_channel(ssm.address) as ssm_channel,
        grpc.insecure_channel(llm.address) as llm_channel,
    ):
        yield Services(
            ssm, llm, internal_pb2_grpc.SsmWorkerStub(ssm_channel), internal_pb2_grpc.LlmVerifierStub(llm_channel)
        )
