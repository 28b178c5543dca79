#!/usr/bin/env python3
"""Ask a kvserve server's ``grpc.health.v1.Health/Check`` whether it is SERVING.

The container's HEALTHCHECK (deploy/Dockerfile) and docker-compose run this; it needs
only ``grpcio`` and ``grpcio-health-checking`` (both kvserve dependencies) and imports
nothing from kvserve, so it also works from a bare Python with those two installed.

    python grpc_health_probe.py                       # 127.0.0.1:$KVSERVE_PORT (default 50051), service ""
    python grpc_health_probe.py --address host:50051 --service kvserve.v1.GenerationService

Exit status (as the Docker HEALTHCHECK contract wants): 0 when the status is SERVING,
1 otherwise (NOT_SERVING while draining, UNKNOWN service, connection refused, timeout).
One line on stdout says what was seen.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Mapping, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def default_address(environ: Mapping[str, str]) -> str:
    """``127.0.0.1:<KVSERVE_PORT>``: inside the container the server's own port setting."""
    return f"127.0.0.1:{environ.get('KVSERVE_PORT') or 50051}"


def check(address: str, service: str = "", timeout_s: float = 5.0) -> tuple[bool, str]:
    """(serving, description) for one Health/Check call on an insecure channel."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as e:
            return False, f"{address}: {e.code().name}: {e.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    return resp.status == health_pb2.HealthCheckResponse.SERVING, f"{address} service {service!r}: {status}"


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    environ = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", default=default_address(environ), help="host:port of the gRPC server")
    parser.add_argument("--service", default="", help='service name to check ("" = the whole server)')
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds before the check counts as failed")
    args = parser.parse_args(argv)
    ok, what = check(args.address, args.service, args.timeout)
    print(what, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
