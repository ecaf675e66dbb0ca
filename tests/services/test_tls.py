"""TLS, mutual TLS and a bearer token: ``serve all`` with every child on mTLS, the public API behind a token.

Certificates are made here with the ``openssl`` CLI (a throwaway CA, one
certificate for the servers, one for clients) and live in a temp directory:
no key is ever committed.
"""

from __future__ import annotations

import http.client
import json
import shutil
import ssl
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kakeya.wire.kakeya.v1 import generate_pb2, generate_pb2_grpc, verifier_pb2
from kakeya.wire.limits import channel_options

from .conftest import ROOT, TINY_ALL_MLX, TINY_MLX, start_all, verifier_stub

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI"),
]

TOKEN = "s3cret-token-0123456789abcdef"
PROMPT = [2, 40, 41, 42, 43]


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=kakeya-test-ca", cwd=d)  # fmt: skip
    for name, eku in (("server", "serverAuth,clientAuth"), ("client", "clientAuth")):
        (d / f"{name}.ext").write_text(f"subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage={eku}\n")
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN=kakeya-{name}", cwd=d)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)  # fmt: skip
    (d / "token").write_text(TOKEN + "\n")
    return d


@pytest.fixture(scope="module")
def secure(server_factory, pki):
    tls = ["--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"),
           "--tls-client-ca", str(pki / "ca.pem"), "--tls-ca", str(pki / "ca.pem")]  # fmt: skip
    s = server_factory("all", ["all", *TINY_ALL_MLX, *tls, "--auth-token-file", str(pki / "token"), "--grace", "2",
                               "--http-port", "0"])  # fmt: skip
    start_all([s])
    return s


def _creds(pki, client_cert=True):
    kw = {}
    if client_cert:
        kw = {"private_key": (pki / "client.key").read_bytes(), "certificate_chain": (pki / "client.pem").read_bytes()}
    return grpc.ssl_channel_credentials(root_certificates=(pki / "ca.pem").read_bytes(), **kw)


def _stub(addr, creds):
    return generate_pb2_grpc.GenerationStub(grpc.secure_channel(addr, creds, options=channel_options()))


def _request():
    req = generate_pb2.GenerateRequest(sampling_params=generate_pb2.SamplingParams(max_tokens=6, ignore_eos=True))
    req.tokenized.ids.extend(PROMPT)
    return req


def test_mtls_and_token_let_a_client_generate(secure, pki):
    out = list(
        _stub(secure.addr, _creds(pki)).Generate(
            _request(), timeout=60, metadata=[("authorization", f"Bearer {TOKEN}")]
        )
    )
    assert (
        out[-1].complete.completion_tokens == 6 and not out[-1].complete.stats.drafter_fallback
    )  # the backends over mTLS


@pytest.mark.parametrize("header", [None, "Bearer wrong-token-0123456789", f"Basic {TOKEN}", TOKEN])
def test_a_missing_or_wrong_token_is_unauthenticated(secure, pki, header):
    md = [("authorization", header)] if header else None
    stub = _stub(secure.addr, _creds(pki))
    for call in (lambda: list(stub.Generate(_request(), timeout=10, metadata=md)),
                 lambda: stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=10, metadata=md)):  # fmt: skip
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_health_needs_no_token(secure, pki):
    ch = grpc.secure_channel(secure.addr, _creds(pki))
    r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert r.status == health_pb2.HealthCheckResponse.SERVING


def test_without_a_client_certificate_or_without_tls_nothing_gets_through(secure, pki):
    for ch in (grpc.secure_channel(secure.addr, _creds(pki, client_cert=False)), grpc.insecure_channel(secure.addr)):
        with pytest.raises(grpc.RpcError) as err:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    backends = json.loads(secure.ready_file.read_text())
    with pytest.raises(grpc.RpcError) as err:  # the verifier, too, refuses a client without a certificate
        ch = grpc.secure_channel(backends["verifier"], _creds(pki, client_cert=False))
        health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_kakeya_client_speaks_mtls_with_a_token(secure, pki):
    base = [sys.executable, "-m", "kakeya.app.main", "client", "--addr", secure.addr,
            "--tls-ca", str(pki / "ca.pem"), "--tls-client-cert", str(pki / "client.pem"),
            "--tls-client-key", str(pki / "client.key")]  # fmt: skip
    gen = ["generate", "--prompt-ids", ",".join(map(str, PROMPT)), "--max-tokens", "5", "--json"]
    r = subprocess.run(
        [*base, "--auth-token-file", str(pki / "token"), *gen], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["token_ids"]) == 5
    r = subprocess.run([*base, *gen], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "UNAUTHENTICATED" in r.stderr


def test_a_health_port_answers_probes_in_plaintext_and_nothing_else(server_factory, pki):
    """Kubernetes' gRPC probes speak no TLS: with mutual TLS on its port a verifier answers them on --health-port."""
    tls = [
        "--tls-cert",
        str(pki / "server.pem"),
        "--tls-key",
        str(pki / "server.key"),
        "--tls-client-ca",
        str(pki / "ca.pem"),
    ]
    v = server_factory("verifier-health", ["verifier", *TINY_MLX, *tls, "--health-port", "0", "--grace", "1"])
    start_all([v])
    health = grpc.insecure_channel(f"127.0.0.1:{v.info['health_port']}")
    r = health_pb2_grpc.HealthStub(health).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert r.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as err:  # health only: no session through the probes' port
        verifier_stub(f"127.0.0.1:{v.info['health_port']}").GetInfo(verifier_pb2.GetVerifierInfoRequest(), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    with pytest.raises(grpc.RpcError) as err:  # the main port still wants a client certificate
        health_pb2_grpc.HealthStub(grpc.insecure_channel(v.addr)).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_http_api_has_the_grpc_servers_tls_and_token(secure, pki):
    """`--http-port`: HTTPS with the same certificate, client certificates and bearer token as the gRPC API."""
    body = json.dumps({"prompt": PROMPT, "max_tokens": 5, "ignore_eos": True})

    def post(client_cert: bool, token: str | None):
        ctx = ssl.create_default_context(cafile=str(pki / "ca.pem"))
        if client_cert:
            ctx.load_cert_chain(str(pki / "client.pem"), str(pki / "client.key"))
        conn = http.client.HTTPSConnection("127.0.0.1", secure.info["http_port"], context=ctx, timeout=60)
        headers = {"content-type": "application/json"} | ({"authorization": f"Bearer {token}"} if token else {})
        try:
            conn.request("POST", "/v1/completions", body, headers)
            r = conn.getresponse()
            return r.status, json.loads(r.read())
        finally:
            conn.close()

    status, out = post(True, TOKEN)
    assert status == 200 and len(out["kakeya"]["token_ids"]) == 5
    status, out = post(True, None)
    assert status == 401 and out["error"]["type"] == "authentication_error"
    with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
        post(False, TOKEN)
