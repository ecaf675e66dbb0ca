"""Error texts: bounded whatever a client sent, and public ones free of internal details (no servers)."""

from __future__ import annotations

import grpc

from kakeya.runtime.lifecycle import MAX_ERROR_CHARS, RequestError, bounded


def test_request_errors_are_bounded():
    long = "open.target_layer_ids: " + str(list(range(10_000)))
    err = RequestError(grpc.StatusCode.INVALID_ARGUMENT, long)
    assert len(err.message) == MAX_ERROR_CHARS and err.message.startswith("open.target_layer_ids: [0, 1, 2")
    assert err.message.endswith("(truncated)") and str(err) == err.message
    assert bounded("short") == "short"


def test_public_errors_use_public_names_and_never_a_backend_address():
    from kakeya.orchestrator.fronts.service import public_status
    from kakeya.orchestrator.remote.streams import BackendError

    addr = "10.1.2.3:50061"

    def public(code, details, **kw):
        got_code, message = public_status(BackendError("verifier", addr, code, details, **kw), "req-1")
        assert addr not in message and "grpc:" not in message, message
        return got_code, message

    code, msg = public(
        grpc.StatusCode.INVALID_ARGUMENT, "open.cache_policy.restore_path: unknown restoration source 'x'"
    )
    assert (
        code == grpc.StatusCode.INVALID_ARGUMENT
        and msg == "verifier: cache_policy.restore_path: unknown restoration source 'x'"
    )
    code, msg = public(grpc.StatusCode.INVALID_ARGUMENT, "open.sampling.temperature must be 0 (greedy) or ...")
    assert msg.startswith("verifier: sampling_params.temperature")
    code, msg = public(grpc.StatusCode.FAILED_PRECONDITION, "verify: commit the previous block first")
    assert (
        code == grpc.StatusCode.INTERNAL and "verify" not in msg
    )  # the session protocol: the orchestrator's own doing
    code, msg = public(
        grpc.StatusCode.INVALID_ARGUMENT, "verify.block_ids: 17 positions exceed this session's max block size 16"
    )
    assert (
        code == grpc.StatusCode.INTERNAL and "verify." not in msg and "16" not in msg
    )  # an internal step: no internals
    code, msg = public(
        grpc.StatusCode.UNAVAILABLE, f"failed to connect to all addresses; last error: ipv4:{addr}: refused"
    )
    assert code == grpc.StatusCode.UNAVAILABLE and msg.startswith("verifier unavailable")
    code, msg = public(grpc.StatusCode.UNAUTHENTICATED, "verifier: missing or wrong bearer token")
    assert code == grpc.StatusCode.UNAVAILABLE  # the backend refuses this orchestrator: not the caller's doing
    code, msg = public(grpc.StatusCode.DEADLINE_EXCEEDED, "no verified answer within 2.0 s", step_timeout=True)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and msg == "verifier did not answer in time"
    code, msg = public(
        grpc.StatusCode.RESOURCE_EXHAUSTED, "session limit reached: 3 of 3 sessions live (--max-sessions)"
    )
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-sessions" in msg
    code, msg = public(grpc.StatusCode.UNKNOWN, f"Exception calling application at {addr}")
    assert code == grpc.StatusCode.INTERNAL


def test_server_info_names_no_backend_address_and_no_backend_error():
    """GetServerInfo on the public port used to answer ``grpc:127.0.0.1:39335`` and the drafter's raw error
    text; now a remote backend is "grpc" and the drafter's state and failure count are all it says."""
    from types import SimpleNamespace

    from kakeya.orchestrator.fronts.grpc_server import GenerationServicer
    from kakeya.wire.kakeya.v1 import generate_pb2 as pb

    error = "<_InactiveRpcError: StatusCode.UNAVAILABLE failed to connect to ipv4:127.0.0.1:39336: Connection refused>"
    drafter = SimpleNamespace(
        backend="grpc:127.0.0.1:39336",
        status=lambda: {"state": "backoff", "failures": "3", "last_error": error},
    )
    servicer = GenerationServicer(lambda: None, colocated=False)
    servicer.engine = SimpleNamespace(verifier=SimpleNamespace(info=SimpleNamespace(backend="grpc:127.0.0.1:39335")),
                                      drafter=drafter)  # fmt: skip
    info = servicer.GetServerInfo(pb.GetServerInfoRequest(), None)
    public = str(info)
    for internal in ("127.0.0.1", "39335", "39336", "InactiveRpcError", "Connection refused", "grpc:"):
        assert internal not in public, (internal, public)
    assert (info.verifier_backend, info.drafter_backend, info.deployment) == ("grpc", "grpc", "split")
    assert dict(info.extra) == {"drafter_state": "backoff", "drafter_failures": "3"}
