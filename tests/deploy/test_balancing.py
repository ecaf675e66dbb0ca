"""The orchestrator's backend channel balances sessions over SERVING replicas only.

In-process gRPC servers that answer with their own name: a replica whose health says
NOT_SERVING (loading, or draining after SIGTERM) gets no new call; the others share them.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kakeya.orchestrator.remote.streams import backend_channel

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def replica(name: str):
    server = grpc.server(ThreadPoolExecutor(2))
    status = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(status, server)
    who = grpc.unary_unary_rpc_method_handler(lambda _req, _ctx: name.encode())
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Who", {"Name": who}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, status, f"127.0.0.1:{port}"


def test_round_robin_over_serving_replicas_only():
    replicas = [replica(n) for n in "ab"]
    try:
        (_, a, addr_a), (_, b, addr_b) = replicas
        a.set("", SERVING)
        b.set("", NOT_SERVING)  # still loading its model
        channel = backend_channel(f"ipv4:{addr_a},{addr_b}")
        name = channel.unary_unary("/test.Who/Name")

        def calls(n=6):
            return [name(b"", timeout=10, wait_for_ready=True).decode() for _ in range(n)]

        assert calls() == ["a"] * 6
        b.set("", SERVING)
        deadline = time.monotonic() + 60  # generous: only a real failure gets there
        while set(calls(2)) != {"a", "b"}:
            assert time.monotonic() < deadline, "b never joined the rotation"
        seen = calls()
        assert seen.count("a") == seen.count("b") == 3  # strict alternation
        a.set("", NOT_SERVING)  # draining: enter_graceful_shutdown
        deadline = time.monotonic() + 60  # the channel's health watch drops a once it hears NOT_SERVING
        while set(calls(2)) != {"b"}:
            assert time.monotonic() < deadline, "a never left the rotation"
        assert calls() == ["b"] * 6
        channel.close()
    finally:
        for server, _, _ in replicas:
            server.stop(0).wait()
