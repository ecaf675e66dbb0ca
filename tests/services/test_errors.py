"""Error texts: bounded whatever a client sent, and public ones free of internal details (no servers)."""

from __future__ import annotations

import grpc
import pytest

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
    code, msg = public(grpc.StatusCode.UNKNOWN, f"Exception calling application at {addr}")
    assert code == grpc.StatusCode.INTERNAL


def test_a_backends_capacity_refusal_says_what_helps_without_its_limits():
    """A verifier's or drafter's session limit, K/V budget and reclaims are the operator's business (its log has
    them whole); the caller learns whether to retry or to ask for less -- never the backend's figures or flags."""
    from kakeya.orchestrator.fronts.service import public_status
    from kakeya.orchestrator.remote.streams import BackendError

    def public(code, details, public_code=None):
        got, message = public_status(BackendError("verifier", "10.1.2.3:50061", code, details), "req-1")
        assert got == (public_code or code) and not any(c.isdigit() for c in message) and "--" not in message, message
        return message

    assert public(
        grpc.StatusCode.RESOURCE_EXHAUSTED, "session limit reached: 3 of 3 sessions live (--max-sessions)"
    ) == ("verifier: session limit reached; retry later")
    per_peer = "per-peer session limit reached: 2 of 2 sessions live from this caller (--max-sessions-per-peer)"
    assert public(grpc.StatusCode.RESOURCE_EXHAUSTED, per_peer) == "verifier: session limit reached; retry later"
    full = "K/V budget exhausted: 900 of 1000 bytes reserved, this session needs 200 (--max-kv-bytes)"
    assert public(grpc.StatusCode.RESOURCE_EXHAUSTED, full) == "verifier: K/V memory exhausted; retry later"
    never = ("K/V budget: this session may need 5000 bytes, more than the whole budget 1000 (--max-kv-bytes); ask for"
             " fewer positions or a bounded cache policy")  # fmt: skip
    msg = public(grpc.StatusCode.OUT_OF_RANGE, never)  # retrying never fits (runtime/admission.py): a 400
    assert msg == "verifier: the request outgrows its K/V memory; ask for fewer tokens (prompt + max_tokens)"
    reclaimed = ("session reclaimed after 31 s without a message from its client: a new session needed its room"
                 " (session limit reached; --reclaim-idle 30)")  # fmt: skip
    assert (
        public(grpc.StatusCode.ABORTED, reclaimed) == "verifier: its session was ended to make room for others; retry"
    )


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


def test_a_backends_refusal_of_a_request_value_names_none_of_its_flags():
    """A public client naming an unknown cache_policy.restore_path on a split deployment got the verifier's own
    text: "... (known: none configured (--restore NAME=DIR))", a flag of a process it cannot reach (colocated says
    "none configured"). The field and the client's value stay; the backend's flags stay in the orchestrator's log."""
    from kakeya.core.request import CachePolicy
    from kakeya.orchestrator.fronts.service import public_status
    from kakeya.orchestrator.remote.streams import BackendError
    from kakeya.runtime.bounds import ContextLimits, RestoreSources

    wire = CachePolicy(kind="sink-window", sink=4, window=16, restore="../../etc")
    refusals = []
    for refuse in (
        lambda: RestoreSources().to_server(wire, "open.cache_policy"),
        lambda: ContextLimits(64, 32, 16).check_positions(40, "open.max_positions"),
    ):
        with pytest.raises(ValueError) as err:
            refuse()
        refusals.append(str(err.value))
    assert "--restore" in refusals[0] and "--max-context" in refusals[1]  # the verifier's own words name them
    for details in refusals:
        code, message = public_status(
            BackendError("verifier", "10.1.2.3:50061", grpc.StatusCode.INVALID_ARGUMENT, details)
        )
        assert "--" not in message, message
    code, message = public_status(
        BackendError("verifier", "10.1.2.3:50061", grpc.StatusCode.INVALID_ARGUMENT, refusals[0])
    )
    assert (
        code == grpc.StatusCode.INVALID_ARGUMENT and "cache_policy.restore_path" in message and "'../../etc'" in message
    )
