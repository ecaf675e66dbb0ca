"""Take-over on real processes: a verifier or drafter replica SIGKILLed mid-stream under several streams.

Two verifier replicas and two drafter replicas behind one orchestrator (``--verifier ipv4:A,B``, the
way a headless Service's DNS lists pods), and a second orchestrator over the same verifiers with its drafter in its own
process (MLX: its arrays live on the compute thread, a take-over's reopening included), started with the project's own commands on loopback. Each
test kills one replica while 6 greedy streams and one seeded-sampling stream run: every request
finishes (0 failed), every output equals the uninterrupted run's token for token, and the
orchestrator's metrics count the take-overs (``decode/takeover.py``). Last, with every verifier replica
gone, the error names the role. The tests run in this order (each restarts what it killed).
"""

from __future__ import annotations

import signal
import threading

import pytest

from kakeya.wire.kakeya.v1 import generate_pb2

from .conftest import TINY_MLX, generate, generation_stub, request, scrape, start_all, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # real processes: bounded, never hanging

PROMPTS = [[2, *range(40 + 7 * k, 60 + 7 * k)] for k in range(6)]
N = 160
SEEDED = {"temperature": 0.8, "seed": 1234}


@pytest.fixture(scope="module")
def cluster(server_factory):
    backends = {
        name: server_factory(name, [role, *TINY_MLX, "--grace", "2"])
        for name, role in (("v0", "verifier"), ("v1", "verifier"), ("d0", "drafter"), ("d1", "drafter"))
    }
    start_all(list(backends.values()))
    b = backends
    orch = server_factory(
        "orchestrator",
        ["orchestrator", "--verifier", f"ipv4:{b['v0'].addr},{b['v1'].addr}", "--drafter",
         f"ipv4:{b['d0'].addr},{b['d1'].addr}", "--metrics-port", "0", "--grace", "5"],
    )  # fmt: skip
    here = server_factory(
        "orchestrator_here",
        ["orchestrator", "--verifier", f"ipv4:{b['v0'].addr},{b['v1'].addr}", *TINY_MLX, "--metrics-port", "0",
         "--grace", "5"],
    )  # fmt: skip
    start_all([orch, here])
    return {**backends, "orchestrator": orch, "orchestrator_here": here}


def _requests():
    """The 6 greedy streams and the seeded-sampling one, each named."""
    reqs = {f"greedy-{k}": request(p, max_tokens=N) for k, p in enumerate(PROMPTS)}
    reqs["seeded"] = request(PROMPTS[0], max_tokens=N, **SEEDED)
    return reqs


@pytest.fixture(scope="module")
def reference(cluster, mlx_target):
    """Every request's uninterrupted output: the greedy ones mlx-lm's own greedy AR of the tiny target, in process
    (what every greedy path must equal, test_split.py's reference; ~0.6 s each where a run through the cluster cost
    ~2 s), the seeded one the cluster's run with all replicas up."""
    from kakeya.verifier.mlx_backend.reference import greedy_reference

    out = {f"greedy-{k}": greedy_reference(mlx_target.model, p, N)[0] for k, p in enumerate(PROMPTS)}
    ids, _, complete, _ = generate(cluster["orchestrator"].addr, _requests()["seeded"])
    assert complete.finish_reason == generate_pb2.FINISH_REASON_LENGTH and len(ids) == N
    out["seeded"] = ids
    assert set(out) == set(_requests()) and all(len(ids) == N for ids in out.values())
    return out


def _takeovers(cluster, role: str, orchestrator: str = "orchestrator") -> float:
    port = cluster[orchestrator].info["metrics_port"]
    return sum(
        v for (n, labels), v in scrape(port).items() if n == "kakeya_takeovers_total" and ("role", role) in labels
    )


def _streams_while(cluster, kill, orchestrator: str = "orchestrator") -> dict:
    """Run every request at once; ``kill()`` once each stream has had two chunks. Each name's (ids, Complete,
    chunks after the kill)."""
    orch = cluster[orchestrator]
    results, started, killed = {}, threading.Barrier(len(_requests()) + 1, timeout=120), threading.Event()

    def one(name, req):
        ids, complete, after, chunks = [], None, 0, 0
        try:
            for resp in generation_stub(orch.addr).Generate(req, timeout=240):
                if resp.HasField("chunk"):
                    ids.extend(resp.chunk.token_ids)
                    chunks += 1
                    after += killed.is_set()
                    if chunks == 2:
                        started.wait()
                else:
                    complete = resp.complete
        finally:
            if chunks < 2:
                started.abort()
            results[name] = (ids, complete, after)

    threads = [threading.Thread(target=one, args=item) for item in _requests().items()]
    for t in threads:
        t.start()
    started.wait()
    kill()
    killed.set()
    for t in threads:
        t.join(300)
    return results


def _check(results, reference):
    assert set(results) == set(reference)
    for name, (ids, complete, _after) in results.items():
        assert complete is not None, f"{name}: no Complete"
        assert complete.finish_reason == generate_pb2.FINISH_REASON_LENGTH, (name, complete.error_message)
        assert ids == reference[name], f"{name}: output differs from the uninterrupted run"
    assert sum(after for _, _, after in results.values()) > len(results), "the kill came too late to test"


def _kill(server, restart: bool = False):
    """SIGKILL ``server``; ``restart``: start it again at once, as its supervisor would -- it loads while the
    streams finish on the other replica (the test waits for it to serve before the next; after the streams, that
    wait cost each test ~5-15 s)."""

    def kill():
        server.signal(signal.SIGKILL)
        server.wait(10)
        if restart:
            server.start()

    return kill


def test_a_verifier_replica_killed_mid_stream_is_taken_over(cluster, reference):
    before = _takeovers(cluster, "verifier")
    results = _streams_while(cluster, _kill(cluster["v0"], restart=True))
    _check(results, reference)
    assert _takeovers(cluster, "verifier") > before, "no stream was on the killed replica"
    assert not any(c.stats.drafter_fallback for _, c, _ in results.values())
    cluster["v0"].wait_ready()


def test_a_drafter_replica_killed_mid_stream_moves_to_the_other(cluster, reference):
    before = _takeovers(cluster, "drafter")
    results = _streams_while(cluster, _kill(cluster["d0"], restart=True))
    _check(results, reference)
    assert _takeovers(cluster, "drafter") > before, "no stream was on the killed replica"
    # another drafter replica took each one over: none fell back to the verifier alone
    assert not any(c.stats.drafter_fallback for _, c, _ in results.values())
    cluster["d0"].wait_ready()


def test_a_verifier_replica_killed_under_an_in_process_drafter_is_taken_over(cluster, reference):
    """The drafter in the orchestrator's process (``--target/--draft`` beside ``--verifier``): the reopened verifier
    session's aux rebuilds its context there; outputs equal the other orchestrator's uninterrupted run."""
    before = _takeovers(cluster, "verifier", "orchestrator_here")
    results = _streams_while(cluster, _kill(cluster["v1"], restart=True), "orchestrator_here")
    _check(results, reference)
    assert _takeovers(cluster, "verifier", "orchestrator_here") > before, "no stream was on the killed replica"
    assert not any(c.stats.drafter_fallback for _, c, _ in results.values())
    cluster["v1"].wait_ready()


def test_with_no_verifier_replica_left_the_error_names_the_role(cluster, reference):
    v0, v1 = cluster["v0"], cluster["v1"]
    wait_until(lambda: generate(cluster["orchestrator"].addr, request(PROMPTS[1], max_tokens=8))[0]
               == reference["greedy-1"][:8], what="the restarted replicas to serve")  # fmt: skip

    def kill_both():
        _kill(v0)()
        _kill(v1)()

    results = _streams_while(cluster, kill_both)
    for name, (ids, complete, _) in results.items():
        assert complete.finish_reason == generate_pb2.FINISH_REASON_ERROR, name
        assert complete.error_message.startswith("verifier unavailable"), complete.error_message
        assert ids == reference[name][: len(ids)], f"{name}: what came before the error differs"
