"""The image's HEALTHCHECK: exit 0 when the local kakeya server's gRPC health says SERVING.

Kubernetes uses its native gRPC probes instead; this is for plain ``docker run``.
The port is the one the container's ``kakeya serve ROLE`` was started with (its
``--health-port``, which answers health in plaintext when ``--port`` speaks TLS; else its
``--port``; else the role's default), read from PID 1's command line, so one
image serves every role; ``KAKEYA_HEALTH_ADDR`` overrides it. Imports only
grpc: a probe every 30 s must not load the model libraries.
"""

from __future__ import annotations

import os
import sys

DEFAULT_PORTS = {"orchestrator": 50051, "all": 50051, "verifier": 50061, "drafter": 50062}  # serve.DEFAULT_PORTS


def port_from_argv(argv: list[str]) -> int:
    """Where ``kakeya serve ROLE [... --port N ... --health-port H ...]`` answers plaintext health."""
    ports = {}
    for i, a in enumerate(argv):  # the last one wins, as in argparse
        name, eq, value = a.partition("=")
        if name in ("--port", "--health-port") and (eq or i + 1 < len(argv)):
            ports[name] = int(value if eq else argv[i + 1])
    if ports:
        return ports.get("--health-port", ports.get("--port"))
    role = next((a for a in argv if a in DEFAULT_PORTS), None)
    if role is None:
        raise ValueError(f"not a `kakeya serve ROLE` command line: {argv}")
    return DEFAULT_PORTS[role]


def main() -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    addr = os.environ.get("KAKEYA_HEALTH_ADDR")
    if not addr:
        with open("/proc/1/cmdline", "rb") as f:
            argv = [a.decode() for a in f.read().split(b"\0") if a]
        addr = f"127.0.0.1:{port_from_argv(argv)}"
    with grpc.insecure_channel(addr) as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=3)
        except grpc.RpcError as exc:
            print(f"{addr}: {exc.code().name}", file=sys.stderr)
            return 1
    print(f"{addr}: {health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)}")
    return 0 if r.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
