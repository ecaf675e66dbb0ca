"""A port already in use is refused (exit 2, one clear line); ``serve all`` passes --default-max-tokens on."""

from __future__ import annotations

import socket
import subprocess
import sys

import grpc
import pytest

from kakeya.wire.kakeya.v1 import generate_pb2

from .conftest import ROOT, TINY_ALL_MLX, generate, generation_stub, request, start_all

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _serve(*argv, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "kakeya.app.main", "serve", *argv],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def test_a_port_held_by_another_socket_is_refused():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = _serve("drafter", "--port", str(port))
    assert r.returncode == 2
    line = [x for x in r.stderr.splitlines() if x.startswith("kakeya: error:")]
    assert line == [f"kakeya: error: drafter: cannot listen on 127.0.0.1:{port}: port {port} is already in use"], (
        r.stderr
    )


def test_serve_all_default_max_tokens_and_a_second_serve_all_on_its_port(server_factory):
    first = server_factory(
        "all", ["all", *TINY_ALL_MLX, "--default-max-tokens", "7", "--max-tokens-limit", "100", "--grace", "2"]
    )
    start_all([first])
    stub = generation_stub(first.addr)
    info = stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=10)
    assert info.default_max_tokens == 7 and info.max_tokens_limit == 100
    req = request([2, 40, 41, 42], max_tokens=0)
    ids, _, complete, _ = generate(first.addr, req)
    assert len(ids) == 7 and complete.finish_reason == generate_pb2.FINISH_REASON_LENGTH
    with pytest.raises(grpc.RpcError) as err:
        generate(first.addr, request([2, 40, 41, 42], max_tokens=101))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    port = first.addr.rsplit(":", 1)[1]
    r = _serve("all", "--port", port, timeout=60)
    assert r.returncode == 2
    assert f"port {port} is already in use" in r.stderr and r.stderr.count("kakeya: error:") == 1, r.stderr
    assert len(generate(first.addr, request([2, 40, 41, 42], max_tokens=5))[0]) == 5  # the first one is untouched


def test_an_http_port_held_by_another_socket_is_refused_naming_it():
    """It said "cannot serve HTTP on 127.0.0.1 ([Errno 98] Address already in use)": which of its ports, and which
    flag sets it, were left to guess (the gRPC and metrics refusals name host:port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = _serve("orchestrator", "--backend", "mlx", "--port", "0", "--http-port", str(port))
    assert r.returncode == 2
    line = [x for x in r.stderr.splitlines() if x.startswith("kakeya: error:")]
    assert len(line) == 1 and f"127.0.0.1:{port}" in line[0] and "--http-port" in line[0], r.stderr


@pytest.mark.parametrize("flag", ["--port", "--metrics-port", "--health-port", "--http-port"])
def test_a_port_past_65535_is_refused_naming_its_flag(flag):
    """--health-port 99999 listened on port 34463 (gRPC took it modulo 65536, so a typo's probe found nothing there);
    --port, --metrics-port and --http-port 99999 ended in a traceback (OverflowError: bind(): port must be 0-65535)
    naming no flag, exit status 1."""
    r = _serve("orchestrator", "--backend", "mlx", "--port", "0", flag, "99999", timeout=30)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"argument {flag}: " in r.stderr and "65535" in r.stderr, r.stderr


@pytest.mark.parametrize("value", ["-1", "nan"])
def test_a_length_of_time_below_zero_is_refused_naming_its_flag(value):
    """--grace -1 was taken (a drain that waits for nothing), as was NaN: refused by argparse, exit status 2."""
    r = _serve("orchestrator", "--backend", "mlx", "--port", "0", "--grace", value, timeout=30)
    assert r.returncode == 2 and "argument --grace: a number of seconds >= 0" in r.stderr, r.stderr
