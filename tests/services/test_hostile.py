"""The issue's hostile-input table, one reproduction per finding (issue "Zero trust inside the cluster").

Real servers: a verifier, a drafter and a split orchestrator (with /metrics).
Each test is a finding the red team measured; it failed before its fix.
"""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest

from kakeya.wire.kakeya.v1 import sampling_pb2, verifier_pb2

from .conftest import ROOT, TINY, TINY_MLX, generate, request, start_all, verifier_stub

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPT = [2, 40, 41, 42, 43, 44, 45, 46]
V = verifier_pb2.VerifierRequest


@pytest.fixture(scope="module")
def servers(server_factory):
    v = server_factory("verifier", ["verifier", *TINY_MLX, "--grace", "1"])
    d = server_factory("drafter", ["drafter", *TINY_MLX, "--grace", "1"])
    start_all([v, d])
    o = server_factory("orchestrator", ["orchestrator", "--verifier", v.addr, "--drafter", d.addr, "--metrics-port", "0",
                                        "--max-tokens-limit", "4000", "--grace", "1"])  # fmt: skip
    start_all([o])
    return {"verifier": v, "drafter": d, "orchestrator": o}


def _code(fn):
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value.code(), err.value.details()


def _public_error_is_clean(details: str, servers) -> None:
    """A public error names public fields and limits: never a backend's address or an internal field."""
    for internal in (servers["verifier"].addr, servers["drafter"].addr, "grpc:", "open.", "verify.", "commit.", "prefill."):
        assert internal not in details, (internal, details)


# --------------------------------------------------------------------------- sampling values


@pytest.mark.parametrize("temperature", [1e-39, 1e-30, 5e-5])
def test_a_degenerate_temperature_is_invalid_argument(servers, temperature):
    """0 < temperature < 1e-4 used to reach the sampler: INTERNAL 'index -1 is out of bounds'."""
    code, details = _code(lambda: generate(servers["orchestrator"].addr, request(PROMPT, max_tokens=6, temperature=temperature)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "sampling_params.temperature" in details, details
    open_ = V.Open(sampling=sampling_pb2.Sampling(temperature=temperature, seed=1))  # the verifier on its own, too
    code, details = _code(lambda: list(verifier_stub(servers["verifier"].addr).Session(iter([V(open=open_)]), timeout=10)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "open.sampling.temperature" in details, details


def test_kakeya_generate_refuses_a_degenerate_temperature_without_a_traceback():
    cmd = [sys.executable, "-m", "kakeya.app.main", "generate", *TINY, "--max-tokens", "4", "--temperature", "1e-39"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2 and "temperature" in r.stderr and "Traceback" not in r.stderr, r.stderr
