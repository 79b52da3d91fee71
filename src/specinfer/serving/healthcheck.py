"""``python -m specinfer.serving.healthcheck [ADDRESS]``: exit 0 when a service's gRPC health is SERVING.

For container health checks (Docker ``HEALTHCHECK``, compose ``healthcheck``) where no
``grpc_health_probe`` binary is at hand. ``ADDRESS`` defaults to ``127.0.0.1:$SPECINFER_PORT``, the
port the service in the same container listens on. Exit codes: 0 SERVING, 1 anything else
(NOT_SERVING, unreachable, timeout), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

# env_name("--port") of specinfer.serving.config, spelled out: importing that module imports numpy,
# which a probe run every few seconds need not pay for
PORT_ENV = "SPECINFER_PORT"


def check(address: str, service: str = "", timeout: float = 3.0) -> str:
    """The health status name of ``service`` at ``address`` (``SERVING``, ``NOT_SERVING``, ...)
    or the gRPC error code name when the call fails."""
    with grpc.insecure_channel(address) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            return exc.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def main(argv: Sequence[str] | None = None) -> int:
    port = os.environ.get(PORT_ENV, "")
    parser = argparse.ArgumentParser(prog="python -m specinfer.serving.healthcheck", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("address", nargs="?", default=f"127.0.0.1:{port}" if port else None, help="host:port [default: 127.0.0.1:$SPECINFER_PORT]")
    parser.add_argument("--service", default="", help="service name to check (default: the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds")
    args = parser.parse_args(argv)
    if not args.address:
        parser.error("give ADDRESS or set SPECINFER_PORT")
    status = check(args.address, args.service, args.timeout)
    print(f"{args.address}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
