"""Container HEALTHCHECK: ask grpc.health.v1 on the local gRPC port for the overall service ("").

Exit 0 when SERVING, 1 otherwise. Kubernetes does not use this (it has native gRPC probes); it is for
`docker run` / compose. Port from FERRUM_PORT (default 50051). Plaintext only: with --tls-cert set,
use a check that speaks TLS (or the Kubernetes probes, which do).
"""

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main() -> int:
    target = f"127.0.0.1:{os.environ.get('FERRUM_PORT', '50051')}"
    try:
        with grpc.insecure_channel(target) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=3)
    except grpc.RpcError as e:
        print(f"health check failed: {e.code().name}", file=sys.stderr)
        return 1
    ok = resp.status == health_pb2.HealthCheckResponse.SERVING
    print(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
