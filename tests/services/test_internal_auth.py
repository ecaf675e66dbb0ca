"""A verifier or drafter serves only its orchestrators (issue "Zero trust inside the cluster").

The red team reached the internal ports with no credentials and ran whole
sessions. Now: a bearer token (``--auth-token-file``, sent by the
orchestrator's ``--backend-token-file``) or mutual TLS admits a caller;
health stays open for probes; an internal service refuses to listen beyond
loopback with neither, unless told ``--insecure``. ``serve all`` gives its
children a token of its own (``test_serve_all.py``); the rendered manifests
use mutual TLS (``tests/deploy``).
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kakeya.runtime.security.auth import bearer_ok, check_exposure, is_loopback, peer_of

from .conftest import ROOT, TINY_MLX, assert_unauthenticated, channel, generate, internal_rpcs, request, start_all

TOKEN = "internal-token-0123456789abcdef"
PROMPT = [2, 40, 41, 42, 43, 44]


# --------------------------------------------------------------------------- no servers


def test_an_internal_service_beyond_loopback_needs_client_authentication():
    for host in ("127.0.0.1", "127.0.0.5", "::1", "[::1]", "localhost"):
        assert (
            is_loopback(host)
            and check_exposure("verifier", host, mutual_tls=False, token=False, insecure=False) is None
        )
    for host in ("0.0.0.0", "[::]", "10.0.0.7", "verifier.internal"):
        assert not is_loopback(host)
        with pytest.raises(ValueError) as err:
            check_exposure("drafter", host, mutual_tls=False, token=False, insecure=False)
        assert all(flag in str(err.value) for flag in ("--tls-client-ca", "--auth-token-file", "--insecure"))
        assert check_exposure("drafter", host, mutual_tls=True, token=False, insecure=False) is None
        assert check_exposure("drafter", host, mutual_tls=False, token=True, insecure=False) is None
        assert "--insecure" in check_exposure("drafter", host, mutual_tls=False, token=False, insecure=True)


@pytest.mark.parametrize("role", ["verifier", "drafter"])
def test_serve_refuses_an_unauthenticated_internal_port_before_loading(role):
    cmd = [sys.executable, "-m", "kakeya.app.main", "serve", role, "--host", "0.0.0.0", "--port", "0"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 2 and "without client authentication" in r.stderr and "--insecure" in r.stderr, r.stderr


def test_the_bearer_check_and_peer_names():
    assert bearer_ok(f"Bearer {TOKEN}", TOKEN) and bearer_ok("", None)
    assert bearer_ok(f"bearer {TOKEN}", TOKEN) and bearer_ok(f"BEARER {TOKEN}", TOKEN)  # the scheme in any case
    for bad in ("", TOKEN, f"Bearer {TOKEN.upper()}", f"Bearer {TOKEN} ", f"Bearer {TOKEN[:-1]}", "Bearer"):
        assert not bearer_ok(bad, TOKEN), bad

    def ctx(peer):
        return SimpleNamespace(peer=lambda: peer)

    assert peer_of(ctx("ipv4:10.0.0.7:51234")) == peer_of(ctx("ipv4:10.0.0.7:40000")) == "ipv4:10.0.0.7"
    assert peer_of(ctx("ipv6:[::1]:51234")) == "ipv6:[::1]"
    assert peer_of(ctx("unix:/tmp/s")) == "unix:/tmp/s"


# --------------------------------------------------------------------------- real servers


@pytest.fixture(scope="module")
def guarded(server_factory, tmp_path_factory):
    token_file = tmp_path_factory.mktemp("token") / "token"
    token_file.write_text(TOKEN + "\n")
    auth = ["--auth-token-file", str(token_file), "--grace", "1"]
    v = server_factory("verifier", ["verifier", *TINY_MLX, *auth])
    d = server_factory("drafter", ["drafter", *TINY_MLX, *auth])
    start_all([v, d])
    o = server_factory("orchestrator", ["orchestrator", "--verifier", v.addr, "--drafter", d.addr,
                                        "--backend-token-file", str(token_file), "--grace", "1"])  # fmt: skip
    start_all([o])
    return {"verifier": v, "drafter": d, "orchestrator": o, "token_file": token_file}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("service", ["verifier", "drafter"])
@pytest.mark.parametrize("token", [None, "wrong-token-0123456789abcdef", "x"])
def test_without_the_token_every_internal_rpc_is_unauthenticated(guarded, service, token):
    assert_unauthenticated(service, guarded[service].addr, token)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("service", ["verifier", "drafter"])
def test_with_the_token_sessions_open_and_health_needs_none(guarded, service):
    addr = guarded[service].addr
    info, session, round_call = internal_rpcs(service, addr, TOKEN)
    assert info().vocab_size > 0
    assert session()[0].WhichOneof("response") == "opened"
    (done,) = round_call()  # admitted: its one item names no session of this caller
    assert done.done.items[0].error.code == grpc.StatusCode.NOT_FOUND.value[0]
    status = health_pb2_grpc.HealthStub(channel(addr)).Check(health_pb2.HealthCheckRequest(), timeout=5).status
    assert status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_orchestrator_with_the_token_speculates_and_one_without_cannot_start(guarded, server_factory):
    ids, _, complete, _ = generate(guarded["orchestrator"].addr, request(PROMPT, max_tokens=12))
    assert len(ids) == 12 and not complete.stats.drafter_fallback
    v, d = guarded["verifier"].addr, guarded["drafter"].addr
    stranger = server_factory(
        "stranger", ["orchestrator", "--verifier", v, "--drafter", d, "--backend-wait", "5"]
    ).start()
    assert stranger.wait(60) != 0
    assert "UNAUTHENTICATED" in stranger.log()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_orchestrator_with_a_wrong_token_is_told_which_flag(guarded, server_factory, tmp_path):
    wrong = tmp_path / "wrong-token"
    wrong.write_text("wrong-token-0123456789abcdef\n")
    v, d = guarded["verifier"].addr, guarded["drafter"].addr
    argv = ["orchestrator", "--verifier", v, "--drafter", d, "--backend-wait", "5", "--backend-token-file", str(wrong)]
    stranger = server_factory("wrong-token", argv).start()
    assert stranger.wait(60) != 0
    (error,) = [line for line in stranger.log().splitlines() if "UNAUTHENTICATED" in line]
    assert "--backend-token-file" in error
