"""A real verifier server under concurrent streams: batched verifies and chunked prefill (torch, in process).

Ordering is forced through the compute thread (a job that holds it while the
others queue up), never through sleeps or timing thresholds.
"""

from __future__ import annotations

import importlib
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

importlib.import_module("torch")

from kakeya.core.contract import Draft
from kakeya.core.request import CachePolicy
from kakeya.orchestrator.remote.verifier import GrpcVerifier
from kakeya.runtime.servicer import SessionLimits
from kakeya.verifier import server as verifier_server
from kakeya.verifier.session import PREFILL_CHUNK, LocalVerifierSession
from kakeya.wire.kakeya.v1 import verifier_pb2_grpc

from ..policy_reference import torch_greedy
from .conftest import in_process_torch_verifier, wait_until

pytestmark = [pytest.mark.timeout(300)]

N_STREAMS = 4
N_TOKENS = 40


@pytest.fixture(scope="module")
def served(tiny_pair, aux_layers):
    yield from in_process_torch_verifier(tiny_pair, aux_layers, workers=16)


def _hold(compute) -> threading.Event:
    """Occupy the compute thread until the returned event is set."""
    release, started = threading.Event(), threading.Event()
    compute.submit(lambda: (started.set(), release.wait(30)))
    assert started.wait(10)
    return release


def _queued(compute) -> int:
    with compute._cv:
        return compute.queued


def _prompt(k: int, n: int = 12) -> list[int]:
    return [2] + [5 + (13 * i + 31 * k) % 500 for i in range(n - 1)]


def _decode(session, first: int, reference: list[int], k: int) -> list[int]:
    """Speculative decoding with planted candidates (the reference's next tokens, every third one wrong)."""
    out, tok = [first], first
    while len(out) < N_TOKENS:
        L = 1 + (len(out) + k) % 8
        cands = [
            t if (len(out) + j) % 3 else (t + 1) % 500 for j, t in enumerate(reference[len(out) : len(out) + L - 1])
        ]
        verdict = session.decide(tok, Draft(cands))
        out += cands[: verdict.accepted] + [verdict.next_token]
        tok = out[-1]
    return out[:N_TOKENS]


def test_concurrent_streams_batch_and_match_greedy_ar(served):
    addr, v = served
    target = v.verifier.target
    refs = [torch_greedy(target, _prompt(k), N_TOKENS + 8) for k in range(N_STREAMS)]
    client = GrpcVerifier(addr)
    sessions = [client.open_session() for _ in range(N_STREAMS)]
    firsts = [s.prefill(_prompt(k))[0] for k, s in enumerate(sessions)]
    before = (v.compute.batches, v.compute.batched_items)
    release = _hold(v.compute)  # every stream's first verify queues up behind this
    with ThreadPoolExecutor(N_STREAMS) as ex:
        futs = [ex.submit(_decode, s, firsts[k], refs[k], k) for k, s in enumerate(sessions)]
        wait_until(lambda: _queued(v.compute) >= N_STREAMS, what="every stream's verify queued")
        release.set()
        outs = [f.result(120) for f in futs]
    for s in sessions:
        s.close()
    for k in range(N_STREAMS):
        assert outs[k] == refs[k][:N_TOKENS], f"stream {k} differs from greedy AR"
    batches, items = v.compute.batches - before[0], v.compute.batched_items - before[1]
    assert items - batches >= N_STREAMS - 1  # at least one batch carried every stream's verify
    assert v.metrics.registry.get_sample_value("kakeya_compute_batched_items_total") == v.compute.batched_items


def test_a_long_prefill_lets_another_streams_verify_run_between_its_chunks(served, monkeypatch):
    addr, v = served
    client = GrpcVerifier(addr, aux_like="torch")
    short = client.open_session()
    tok, _ = short.prefill(_prompt(1))
    long_prompt = _prompt(2, 4 * PREFILL_CHUNK + 100)  # five chunks
    events: list[str] = []  # what the compute thread ran, in order
    first_chunk = threading.Event()
    real_chunk, real_batch = v._prefill_chunk, verifier_server.decide

    def chunk(entry, session, steps):
        events.append("chunk")
        if not first_chunk.is_set():  # hold the first chunk until the short stream's verify is queued behind it
            first_chunk.set()
            wait_until(lambda: _queued(v.compute) >= 1, what="the short stream's verify queued")
        return real_chunk(entry, session, steps)

    def batch(items):
        events.append("verify")
        return real_batch(items)

    monkeypatch.setattr(v, "_prefill_chunk", chunk)
    monkeypatch.setattr(verifier_server, "decide", batch)
    long = client.open_session()
    with ThreadPoolExecutor(2) as ex:
        prefilled = ex.submit(long.prefill, long_prompt)
        assert first_chunk.wait(60)
        verdict = ex.submit(short.decide, tok, Draft([7, 8])).result(60)
        next_token, aux = prefilled.result(120)
    assert 0 <= verdict.accepted <= 2
    assert events == ["chunk", "verify", "chunk", "chunk", "chunk", "chunk"]  # the verify ran between chunks
    one_shot = LocalVerifierSession(v.verifier.target, v.verifier.aux_layers, CachePolicy())
    want_token, want_aux = one_shot.prefill(long_prompt)
    assert next_token == want_token
    assert torch.equal(aux, want_aux)
    for s in (short, long):
        s.close()


def test_a_prompt_beyond_the_sessions_positions_is_refused_before_any_chunk_runs(served, monkeypatch):
    from kakeya.wire.kakeya.v1 import verifier_pb2 as vpb

    addr, v = served
    chunks = []
    monkeypatch.setattr(v, "_prefill_chunk", lambda *a: chunks.append(a))
    stub = verifier_pb2_grpc.VerifierServiceStub(grpc.insecure_channel(addr))
    msgs = [
        vpb.VerifierRequest(open=vpb.VerifierRequest.Open(max_positions=10)),
        vpb.VerifierRequest(prefill=vpb.VerifierRequest.Prefill(token_ids=_prompt(0, 11))),
    ]
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Session(iter(msgs), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prefill.token_ids" in err.value.details() and "--max-context" in err.value.details()
    assert chunks == []


def test_max_batch_flag_reaches_the_verifier_and_serve_all_children():
    from kakeya.app import flags as serve_flags
    from kakeya.app.main import build_parser

    args = build_parser().parse_args(["serve", "verifier", "--max-batch", "3"])
    assert serve_flags.session_limits(args).max_batch == 3
    assert build_parser().parse_args(["serve", "verifier"]).max_batch == 16
    with pytest.raises(ValueError, match="--max-batch"):
        serve_flags.session_limits(build_parser().parse_args(["serve", "verifier", "--max-batch", "0"]))
    a = build_parser().parse_args(["serve", "all", "--max-batch", "1"])
    argv = serve_flags.child_argv(a, "verifier", "token")
    assert argv[argv.index("--max-batch") + 1] == "1"
    assert argv.count("--max-batch") == 1
    drafter_argv = serve_flags.child_argv(a, "drafter", "token")  # the drafter batches its block forwards too
    assert drafter_argv[drafter_argv.index("--max-batch") + 1] == "1"
    assert "--max-batch" not in serve_flags.child_argv(a, "orchestrator", "token")
    from kakeya.verifier.server import VerifierServicer

    s = VerifierServicer(SessionLimits(max_batch=1))
    assert s.compute.max_batch == 1
    s.compute.shutdown()
