"""The drafter server batches Draft requests of concurrent streams: each stream gets what it gets alone.

An in-process drafter servicer on loopback (torch and MLX), reached through the
orchestrator's own ``GrpcDrafter`` client by several concurrent streams (a
sampling one among them). Each step, the compute thread is held busy until
every stream's Draft has queued up behind it, so the step runs as one batch of
all streams -- deterministic, no timing -- and the counters say so.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from kakeya.core.request import COUPLED, REJECTION, SamplingParams
from kakeya.orchestrator.remote.deadlines import StepClock
from kakeya.orchestrator.remote.drafter import GrpcDrafter
from kakeya.runtime.servicer import SessionLimits
from kakeya.wire.kakeya.v1 import drafter_pb2_grpc
from kakeya.wire.limits import server_options

from .conftest import wait_until

pytestmark = pytest.mark.timeout(300)

BLOCKS = [2, 5, 8, 16]  # one stream each
SAMPLING = [None, SamplingParams(0.9, top_k=50, seed=17, rule=REJECTION), SamplingParams(0.8, seed=18), None]
STEPS = 4


def _drafter(backend: str, pair, **shared):
    from kakeya.drafter.local import MLXDrafter, TorchDrafter

    cls = MLXDrafter if backend == "mlx" else TorchDrafter
    return cls(pair.draft, pair.target, **shared)


@pytest.fixture(scope="module", params=["torch", "mlx"])
def server(request, tiny_pair):
    from kakeya.drafter.server import DrafterServicer

    backend = request.param
    d = DrafterServicer(SessionLimits(max_batch=8))
    d.compute.run(
        d._setup,
        lambda **shared: _drafter(backend, tiny_pair, **shared),
        str(tiny_pair.draft),
        str(tiny_pair.target),
        backend,
    )
    d.ready = True
    srv = grpc.server(ThreadPoolExecutor(16), options=server_options())
    drafter_pb2_grpc.add_DrafterServiceServicer_to_server(d, srv)
    addr = f"127.0.0.1:{srv.add_insecure_port('127.0.0.1:0')}"
    srv.start()
    yield backend, addr, d
    srv.stop(0).wait()
    d.compute.shutdown()


def _hold(compute) -> threading.Event:
    """Occupy the compute thread until the returned event is set (jobs queue up behind it)."""
    release, started = threading.Event(), threading.Event()
    compute.submit(lambda: (started.set(), release.wait(30)))
    assert started.wait(30)
    return release


def test_concurrent_streams_are_batched_and_draft_what_they_draft_alone(server, tiny_pair):
    backend, addr, d = server
    assert d.compute.max_batch == 8
    client = GrpcDrafter(addr, clock=StepClock(floor_s=60.0))
    local = _drafter(backend, tiny_pair)  # the reference: every stream's session drafting alone
    width, vocab = local.model.config.aux_width, local.model.target.vocab_size
    remote = [client.open_session(p) for p in SAMPLING]
    alone = [local.open_session(p) for p in SAMPLING]
    rng = np.random.default_rng(3)
    pool = ThreadPoolExecutor(len(BLOCKS))
    batched_steps = 0
    try:
        for step in range(STEPS):
            work = [(rng.standard_normal((int(rng.integers(1, 40)) if step == 0 else int(rng.integers(0, 9)), width)).astype(np.float32),
                     int(rng.integers(0, vocab)), b) for b in BLOCKS]  # fmt: skip
            held = step > 0  # the first step also opens the streams (plain jobs): let it run as it comes
            if held:
                release = _hold(d.compute)
                before = (d.compute.batches, d.compute.batched_items)
            futs = [pool.submit(s.draft, aux, last, b) for s, (aux, last, b) in zip(remote, work)]
            if held:
                wait_until(lambda: len(d.compute._jobs) >= len(BLOCKS), what="every stream's draft queued")
                release.set()
            got = [f.result(60) for f in futs]
            if held:
                assert (d.compute.batches - before[0], d.compute.batched_items - before[1]) == (1, len(BLOCKS))
                batched_steps += 1
            want = [s.draft(_local_aux(backend, aux), last, b) for s, (aux, last, b) in zip(alone, work)]
            for g, w, p in zip(got, want, SAMPLING):
                assert g.tokens == w.tokens, step
                if p is None or p.rule == COUPLED:  # greedy or coupled: candidates only
                    assert g.proposal is None and w.proposal is None
                else:
                    assert np.array_equal(g.proposal.ids, w.proposal.ids)
                    np.testing.assert_allclose(g.proposal.probs, w.proposal.probs, atol=1e-5)
    finally:
        for s in remote:
            s.close()
        pool.shutdown()
        client.close()
    assert batched_steps == STEPS - 1
    wait_until(lambda: d.registry.live == 0, what="sessions closed")


def _local_aux(backend: str, aux: np.ndarray):
    if backend == "mlx":
        import mlx.core as mx

        return mx.array(aux)
    return aux


def test_max_batch_flag_reaches_the_drafter_and_the_children_of_serve_all():
    from kakeya.app import flags as serve_flags
    from kakeya.app.main import build_parser
    from kakeya.drafter.server import DrafterServicer

    p = build_parser()
    assert p.parse_args(["serve", "drafter"]).max_batch == 16
    args = p.parse_args(["serve", "drafter", "--max-batch", "3"])
    d = DrafterServicer(serve_flags.session_limits(args))
    assert d.compute.max_batch == 3
    d.compute.shutdown()
    with pytest.raises(ValueError, match="--max-batch must be >= 1"):
        serve_flags.session_limits(p.parse_args(["serve", "drafter", "--max-batch", "0"]))
    argv = serve_flags.child_argv(p.parse_args(["serve", "all", "--max-batch", "1"]), "drafter", "token")
    assert argv[argv.index("--max-batch") + 1] == "1"


def test_a_rounds_drafts_travel_in_one_draft_round_call_and_draft_what_they_draft_alone(server, tiny_pair):
    backend, addr, d = server
    client = GrpcDrafter(addr, clock=StepClock(floor_s=60.0))
    local = _drafter(backend, tiny_pair)
    width, vocab = local.model.config.aux_width, local.model.target.vocab_size
    remote = [client.open_session(p) for p in SAMPLING]
    alone = [local.open_session(p) for p in SAMPLING]
    rng = np.random.default_rng(5)
    try:
        for step in range(STEPS):
            work = [(rng.standard_normal((int(rng.integers(1, 40)) if step == 0 else int(rng.integers(0, 9)), width)).astype(np.float32),
                     int(rng.integers(0, vocab)), b) for b in BLOCKS]  # fmt: skip
            calls, items = d.round_calls, d.round_items
            got = GrpcDrafter.draft_batch([(s, aux, last, b) for s, (aux, last, b) in zip(remote, work)])
            # the first drafts (the prompts' aux) go on the streams; every later round is one call for all
            assert (d.round_calls - calls, d.round_items - items) == ((0, 0) if step == 0 else (1, len(BLOCKS)))
            want = [s.draft(_local_aux(backend, aux), last, b) for s, (aux, last, b) in zip(alone, work)]
            for g, w in zip(got, want):
                assert g.tokens == w.tokens, step
    finally:
        for s in remote:
            s.close()
        client.close()
    wait_until(lambda: d.registry.live == 0, what="sessions closed")


def test_a_streams_first_draft_and_a_rounds_drafts_queued_together_share_one_forward(server, tiny_pair):
    """The split's mixed arrivals: a new stream's first draft (on its stream) queues beside a DraftRound of
    sessions already drafting. Both are kind "draft": they must run one runner (one batch), each answered
    as alone -- they once ran the round's runner for the stream's item (TypeError, the drafter lost)."""
    backend, addr, d = server
    client = GrpcDrafter(addr, clock=StepClock(floor_s=60.0))
    local = _drafter(backend, tiny_pair)
    width, vocab = local.model.config.aux_width, local.model.target.vocab_size
    rng = np.random.default_rng(11)

    def work(rows: int):
        return rng.standard_normal((rows, width)).astype(np.float32), int(rng.integers(0, vocab))

    older = [client.open_session(None) for _ in BLOCKS]  # first drafts done: they draft in rounds from now on
    older_alone = [local.open_session(None) for _ in BLOCKS]
    newcomer, newcomer_alone = client.open_session(None), local.open_session(None)
    pool = ThreadPoolExecutor(2)
    try:
        for s, a, b in zip(older, older_alone, BLOCKS):
            aux, last = work(12)
            assert s.draft(aux, last, b).tokens == a.draft(_local_aux(backend, aux), last, b).tokens
        for round_first in (True, False):  # the group's first job from either call site
            steps = [(*work(int(rng.integers(1, 6))), b) for b in BLOCKS]
            first = (*work(20), 4)
            newcomer._stream().wait(newcomer._opened, 60)  # its Open (a plain job) answered before the hold
            release = _hold(d.compute)
            before = (d.compute.batches, d.compute.batched_items, d.round_calls)
            if not round_first:
                first_f = pool.submit(newcomer.draft, *first)
                wait_until(lambda: len(d.compute._jobs) >= 1, what="the first draft queued")
            round_f = pool.submit(GrpcDrafter.draft_batch, [(s, *st) for s, st in zip(older, steps)])
            if round_first:
                wait_until(lambda: len(d.compute._jobs) >= len(BLOCKS), what="the round's drafts queued")
                first_f = pool.submit(newcomer.draft, *first)
            wait_until(lambda: len(d.compute._jobs) >= len(BLOCKS) + 1, what="both call sites' drafts queued")
            release.set()
            got_round, got_first = round_f.result(60), first_f.result(60)
            assert d.round_calls - before[2] == 1
            # one forward for both call sites, every item answered (no exception stands in for a draft)
            assert (d.compute.batches - before[0], d.compute.batched_items - before[1]) == (1, len(BLOCKS) + 1)
            want = [a.draft(_local_aux(backend, aux), last, b) for a, (aux, last, b) in zip(older_alone, steps)]
            assert [g.tokens for g in got_round] == [w.tokens for w in want]
            aux, last, b = first
            assert got_first.tokens == newcomer_alone.draft(_local_aux(backend, aux), last, b).tokens
            newcomer.close()
            newcomer, newcomer_alone = client.open_session(None), local.open_session(None)
    finally:
        for s in (*older, newcomer):
            s.close()
        pool.shutdown()
        client.close()
    wait_until(lambda: d.registry.live == 0, what="sessions closed")
