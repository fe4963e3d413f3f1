"""Health check for the container: asks grpc.health.v1 on the local gRPC port about service
"" (or the one named after the port, e.g. "liveness").

Exit 0 when SERVING, 1 otherwise. Used by the image's HEALTHCHECK (plain `docker run`) and, in the
Helm chart, by the probes when TLS is on: the kubelet's native gRPC probes speak plaintext only.

Usage: healthcheck.py [PORT]   (default: $FERRUM_PORT, else 50051)

Environment:
  FERRUM_HEALTHCHECK_CA          PEM CA bundle: connect with TLS, verifying the server against it
  FERRUM_HEALTHCHECK_SERVER_NAME name to verify the server certificate against (default localhost)
  FERRUM_HEALTHCHECK_CLIENT_CERT / FERRUM_HEALTHCHECK_CLIENT_KEY
                                 client certificate for servers that require mutual TLS
"""

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def _read(name: str) -> bytes | None:
    path = os.environ.get(name)
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


def _channel(target: str) -> grpc.Channel:
    ca = _read("FERRUM_HEALTHCHECK_CA")
    if ca is None:
        return grpc.insecure_channel(target)
    creds = grpc.ssl_channel_credentials(root_certificates=ca,
                                         private_key=_read("FERRUM_HEALTHCHECK_CLIENT_KEY"),
                                         certificate_chain=_read("FERRUM_HEALTHCHECK_CLIENT_CERT"))
    name = os.environ.get("FERRUM_HEALTHCHECK_SERVER_NAME", "localhost")
    return grpc.secure_channel(target, creds, options=[("grpc.ssl_target_name_override", name)])


def main() -> int:
    port = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("FERRUM_PORT", "50051")
    service = sys.argv[2] if len(sys.argv) > 2 else ""  # "liveness" for a liveness probe
    target = f"127.0.0.1:{port}"
    try:
        with _channel(target) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=3)
    except (grpc.RpcError, OSError) as e:
        print(f"health check failed: {getattr(e, 'code', lambda: e)()}", file=sys.stderr)
        return 1
    print(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))
    return 0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
