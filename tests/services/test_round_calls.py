"""Round calls on a real verifier server (torch, in process): one ``VerifyRound`` per round for N sessions.

Counted on the server (``round_calls``, ``kakeya_round_calls_total``) and through the Session streams'
own step counts; outputs checked against greedy AR; items fail alone (bad block, closed session, another
caller's id, a session busy on its stream).
"""

from __future__ import annotations

import importlib

import grpc
import pytest

importlib.import_module("torch")

from kakeya.core.contract import Draft, Verdict
from kakeya.orchestrator.remote import streams as remote
from kakeya.orchestrator.remote.streams import BackendError
from kakeya.orchestrator.remote.verifier import GrpcVerifier
from kakeya.wire.kakeya.v1 import verifier_pb2 as vpb
from kakeya.wire.kakeya.v1 import verifier_pb2_grpc

from ..policy_reference import torch_greedy
from .conftest import in_process_torch_verifier

pytestmark = [pytest.mark.timeout(300)]

N_SESSIONS = 5
N_TOKENS = 32


@pytest.fixture(scope="module")
def served(tiny_pair, aux_layers):
    yield from in_process_torch_verifier(tiny_pair, aux_layers, workers=32)


def _prompt(k: int, n: int = 12) -> list[int]:
    return [2] + [5 + (13 * i + 31 * k) % 500 for i in range(n - 1)]


def _cands(out: list[int], ref: list[int], k: int) -> list[int]:
    """Planted candidates: the reference's next tokens, every third one wrong, block sizes 1..8."""
    n = 1 + (len(out) + k) % 8
    return [t if (len(out) + j) % 3 else (t + 1) % 500 for j, t in enumerate(ref[len(out) : len(out) + n - 1])]


def _opened(client, n: int):
    sessions = [client.open_session() for _ in range(n)]
    return sessions, [s.prefill(_prompt(k))[0] for k, s in enumerate(sessions)]


def test_a_round_of_n_sessions_is_one_call_and_matches_greedy_ar(served):
    addr, v = served
    target = v.verifier.target
    refs = [torch_greedy(target, _prompt(k), N_TOKENS + 8) for k in range(N_SESSIONS)]
    client = GrpcVerifier(addr)
    sessions, firsts = _opened(client, N_SESSIONS)
    outs = [[f] for f in firsts]
    calls0, items0, expected = v.round_calls, v.round_items, 0
    while any(len(o) < N_TOKENS for o in outs):
        live = [k for k in range(N_SESSIONS) if len(outs[k]) < N_TOKENS]
        cands = {k: _cands(outs[k], refs[k], k) for k in live}
        verdicts = GrpcVerifier.decide_batch([(sessions[k], outs[k][-1], Draft(cands[k])) for k in live])
        expected += len(live) >= remote.ROUND_MIN  # a lone session's block goes on its own stream
        for k, verdict in zip(live, verdicts):
            assert isinstance(verdict, Verdict), verdict
            outs[k] += cands[k][: verdict.accepted] + [verdict.next_token]
        assert v.round_calls - calls0 == expected  # one call per round, whatever the number of sessions
        assert v.round_items - items0 >= expected * remote.ROUND_MIN
    for s in sessions:
        assert s.stats().wire.bytes_sent > 0
        s.close()
    for k in range(N_SESSIONS):
        assert outs[k][:N_TOKENS] == refs[k][:N_TOKENS], f"session {k} differs from greedy AR"
    assert expected >= 3
    assert v.metrics.registry.get_sample_value("kakeya_round_calls_total") == v.round_calls


def test_every_round_with_n_sessions_costs_exactly_one_call(served):
    addr, v = served
    client = GrpcVerifier(addr)
    sessions, firsts = _opened(client, 4)
    toks = list(firsts)
    for _ in range(3):
        calls, items = v.round_calls, v.round_items
        verdicts = GrpcVerifier.decide_batch([(s, toks[k], Draft((7, 8))) for k, s in enumerate(sessions)])
        assert (v.round_calls - calls, v.round_items - items) == (1, 4)
        toks = [d.next_token for d in verdicts]
    calls = v.round_calls
    verdict = GrpcVerifier.decide_batch([(sessions[0], toks[0], Draft((7,)))])[0]  # alone: its stream
    assert isinstance(verdict, Verdict) and v.round_calls == calls
    for s in sessions:
        s.close()


def test_one_bad_or_closed_item_fails_alone(served):
    addr, v = served
    target = v.verifier.target
    client = GrpcVerifier(addr)
    sessions, firsts = _opened(client, 4)
    sessions[2].abort()  # cancelled: its stream is gone before the round
    vocab = v.verifier.info.vocab_size
    items = [(s, firsts[k], Draft((7, 8))) for k, s in enumerate(sessions)]
    items[1] = (sessions[1], firsts[1], Draft((vocab + 5,)))  # a candidate outside the vocabulary
    results = GrpcVerifier.decide_batch(items)
    assert isinstance(results[1], BackendError) and results[1].code == grpc.StatusCode.INVALID_ARGUMENT
    assert "verify.block_ids" in results[1].details and "items[" in results[1].details
    assert isinstance(results[2], BackendError) and results[2].code == grpc.StatusCode.CANCELLED
    for k in (0, 3):  # the others: verified, exactly as greedy AR would
        ref = torch_greedy(target, _prompt(k), 4)
        assert isinstance(results[k], Verdict)
        want = 0 if ref[1] != 7 else (1 if ref[2] != 8 else 2)
        assert results[k].accepted == want and results[k].next_token == ref[1 + want]
    # the session with the bad item is still open and still verifies on its own stream
    assert isinstance(sessions[1].decide(firsts[1], Draft((7,))), Verdict)
    for s in sessions:
        s.close()


def test_a_session_its_server_ends_during_the_round_is_a_lost_replica(served, monkeypatch):
    """A drain's last step (``end_all``) while a round holds the session's step: the item said CANCELLED, which the
    orchestrator reads as its own client's cancel, so the stream failed "cancelled" instead of moving to another
    replica (test_hosts' rolling restart, once in a suite run). It is UNAVAILABLE, a replica lost to the session:
    take-over moves it."""
    addr, v = served
    client = GrpcVerifier(addr)
    sessions, firsts = _opened(client, 2)
    start_many = v.compute.start_many

    def ending(*args):  # its server ends session 1 while the round's steps are in hand
        (victim,) = [e for e in v.registry._live.values() if e.id == sessions[1].session_id]
        v.registry.close(victim)
        return start_many(*args)

    monkeypatch.setattr(v.compute, "start_many", ending)
    results = GrpcVerifier.decide_batch([(s, firsts[k], Draft((7,))) for k, s in enumerate(sessions)])
    assert isinstance(results[0], Verdict)
    assert isinstance(results[1], BackendError) and results[1].replica_lost, results[1]
    for s in sessions:
        s.close()


def test_a_session_is_named_only_by_its_own_caller_and_only_once(served):
    addr, v = served
    client = GrpcVerifier(addr)
    (s,), (first,) = _opened(client, 1)
    stub = verifier_pb2_grpc.VerifierServiceStub(grpc.insecure_channel(addr))

    def round_of(*ids):
        req = vpb.VerifyRoundRequest()
        for i in ids:
            req.items.add(session_id=i).verify.block_ids.extend([first])
        return list(stub.VerifyRound(req, timeout=30))

    (done,) = round_of(s.session_id, "nosuchsession")
    assert done.done.items[0].WhichOneof("result") == "verified"
    err = done.done.items[1].error
    assert grpc.StatusCode.NOT_FOUND.value[0] == err.code and "items[1].session_id" in err.message
    (entry,) = [e for e in v.registry._live.values() if e.id == s.session_id]
    peer, entry.peer = entry.peer, "ipv4:10.9.9.9"  # as if another caller had opened it: this one cannot name it
    try:
        (done,) = round_of(s.session_id)
        assert done.done.items[0].error.code == grpc.StatusCode.NOT_FOUND.value[0]
    finally:
        entry.peer = peer
    with pytest.raises(grpc.RpcError) as exc:
        round_of(s.session_id, s.session_id)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "items.session_id" in exc.value.details()
    with pytest.raises(grpc.RpcError) as exc:
        round_of()
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "items" in exc.value.details()
    s.close()


def test_a_session_the_round_does_not_find_goes_on_its_stream_from_then_on(served):
    """As a session held by another replica would (a balanced channel spreads streams, a round call
    reaches one): NOT_FOUND sends its block on its own stream, and later rounds leave it out."""
    addr, v = served
    target = v.verifier.target
    client = GrpcVerifier(addr)
    sessions, firsts = _opened(client, 3)
    sessions[0].session_id = "elsewhere000"  # an id this server does not hold
    outs = [[f] for f in firsts]
    for step in range(2):
        calls, items = v.round_calls, v.round_items
        results = GrpcVerifier.decide_batch([(s, outs[k][-1], Draft((7,))) for k, s in enumerate(sessions)])
        assert (v.round_calls - calls, v.round_items - items) == (1, 3 if step == 0 else 2)
        for k, r in enumerate(results):
            assert isinstance(r, Verdict), r
            outs[k] += [7][: r.accepted] + [r.next_token]
    assert not sessions[0].round_ok and all(s.round_ok for s in sessions[1:])
    for k in range(3):  # on its stream or in the round: greedy AR all the same
        assert outs[k] == torch_greedy(target, _prompt(k), len(outs[k]))[: len(outs[k])]
    for s in sessions:
        s.close()
