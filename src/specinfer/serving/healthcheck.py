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

from specinfer.serving.security import ClientAuth, ClientTls, env_or

# env_name("--port") of specinfer.serving.config, spelled out: importing that module imports numpy,
# which a probe run every few seconds need not pay for
PORT_ENV = "SPECINFER_PORT"


def check(address: str, service: str = "", timeout: float = 3.0, tls: ClientTls | None = None) -> str:
    """The health status name of ``service`` at ``address`` (``SERVING``, ``NOT_SERVING``, ...)
    or the gRPC error code name when the call fails. ``tls``: how to reach a TLS port (health
    needs no bearer token)."""
    with ClientAuth(tls or ClientTls()).channel(address) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError as exc:
            return exc.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def main(argv: Sequence[str] | None = None) -> int:
    port = os.environ.get(PORT_ENV, "")
    parser = argparse.ArgumentParser(
        prog="python -m specinfer.serving.healthcheck",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "address",
        nargs="?",
        default=f"127.0.0.1:{port}" if port else None,
        help="host:port [default: 127.0.0.1:$SPECINFER_PORT]",
    )
    parser.add_argument("--service", default="", help="service name to check (default: the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds")
    # a TLS port: the same files (and SPECINFER_* variables) as the request manager's calls to it
    parser.add_argument(
        "--tls-ca", default=env_or("TLS_CA"), help="PEM CA of the server: probe with TLS [env SPECINFER_TLS_CA]"
    )
    parser.add_argument(
        "--tls-client-cert",
        default=env_or("TLS_CLIENT_CERT"),
        help="PEM client certificate (mTLS) [env SPECINFER_TLS_CLIENT_CERT]",
    )
    parser.add_argument(
        "--tls-client-key",
        default=env_or("TLS_CLIENT_KEY"),
        help="PEM key of --tls-client-cert [env SPECINFER_TLS_CLIENT_KEY]",
    )
    args = parser.parse_args(argv)
    if not args.address:
        parser.error("give ADDRESS or set SPECINFER_PORT")
    try:
        tls = ClientTls.from_files(args.tls_ca, args.tls_client_cert, args.tls_client_key)
        tls.credentials()
    except ValueError as exc:
        parser.error(str(exc))
    status = check(args.address, args.service, args.timeout, tls)
    print(f"{args.address}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
