"""Every implementation of a written protocol implements all of it: the contract's verifier and drafter
(in process on both backends, over gRPC, the drafter that sits out a backoff) and their sessions, and the
verifier's backend protocol with its capabilities, each declared by a flag and implemented where it is set."""

from __future__ import annotations

import inspect

import pytest

from kakeya.core import contract
from kakeya.core.request import CachePolicy
from kakeya.orchestrator.remote import drafter as remote_drafter
from kakeya.orchestrator.remote import verifier as remote
from kakeya.verifier import backend


def _methods(protocol) -> set[str]:
    return {n for n, v in vars(protocol).items() if not n.startswith("_") and inspect.isfunction(v)}


@pytest.mark.parametrize("backend_name", ["torch", "mlx"])
def test_in_process_verifier_drafter_and_their_sessions(tiny_pair, backend_name):
    from kakeya.orchestrator.assembly import build_local_engine

    engine = build_local_engine(str(tiny_pair.target), str(tiny_pair.draft), backend_name)
    assert isinstance(engine.verifier, contract.Verifier) and isinstance(engine.drafter, contract.Drafter)
    vs, ds = engine.verifier.open_session(), engine.drafter.open_session()
    try:
        assert isinstance(vs, contract.VerifierSession) and isinstance(ds, contract.DrafterSession)
        target = engine.verifier.target
        assert isinstance(target, backend.Target)
        assert isinstance(target, backend.StaticVerify) == target.static_verify
        assert isinstance(target, backend.Restores) == target.restores
        assert isinstance(vs.stats(), contract.VerifierStats) and isinstance(ds.stats(), contract.DrafterStats)
    finally:
        vs.close()
        ds.close()


@pytest.mark.parametrize(
    "cls, protocol",
    [
        (remote.GrpcVerifierSession, contract.VerifierSession),
        (remote_drafter.GrpcDrafterSession, contract.DrafterSession),
        (remote_drafter._SkippedDrafterSession, contract.DrafterSession),
        (remote.GrpcVerifier, contract.Verifier),
        (remote_drafter.GrpcDrafter, contract.Drafter),
    ],
)
def test_the_grpc_clients_implement_every_method(cls, protocol):
    missing = sorted(m for m in _methods(protocol) if not callable(getattr(cls, m, None)))
    assert missing == [], f"{cls.__name__} lacks {missing} of {protocol.__name__}"


def test_a_class_lacking_a_method_is_not_taken_for_a_session():
    """The check above can fail: a session without ``abort`` is no VerifierSession."""

    class Partial:
        server_s = None
        first_logprobs = None

        def prefill(self, ids): ...
        def prefill_steps(self, ids, reuse=()): ...
        def decide(self, last, draft): ...
        def save(self, ids): ...
        def stats(self): ...
        def close(self): ...

    assert not isinstance(Partial(), contract.VerifierSession)
    Partial.abort = lambda self: None
    assert isinstance(Partial(), contract.VerifierSession)


def test_a_local_verifier_session_takes_its_collaborators_at_construction(tiny_pair):
    """A prefix cache is handed to the verifier when it is built, never set on it afterwards."""
    from kakeya.core.prefix import PrefixCache
    from kakeya.orchestrator.assembly import build_local_engine

    cache = PrefixCache(1 << 20)
    engine = build_local_engine(str(tiny_pair.target), str(tiny_pair.draft), "torch", prefixes=cache)
    assert engine.verifier.prefixes is cache and engine.drafter.prefixes is cache
    session = engine.verifier.open_session(CachePolicy())
    assert session.prefixes is cache
    session.close()


def test_replica_lost_is_one_function_for_every_caller():
    """The loop, the engine and the take-over ask ``contract.replica_lost``: a remote BackendError that lost its
    replica says so; anything else (a refusal, our own end, a local error) is not a loss."""
    import grpc

    from kakeya.orchestrator.remote.streams import BackendError

    assert contract.replica_lost(BackendError("drafter", "a", grpc.StatusCode.UNAVAILABLE, "gone"))
    assert not contract.replica_lost(BackendError("drafter", "a", grpc.StatusCode.INVALID_ARGUMENT, "bad"))
    assert not contract.replica_lost(BackendError("verifier", "a", grpc.StatusCode.CANCELLED, "client"))
    assert not contract.replica_lost(ConnectionError("in process"))
