"""Under load, a generation whose client has gone away still holds its place under ``--max-sessions`` until its run
ends (up to a round later): a load test with a pool of clients as large as ``--max-sessions``, each closing a stream
mid-way and sending its next request at once, got 429s (15 of 40 requests, colocated torch, 2 clients and
``--max-sessions 2``), though no more than ``--max-sessions`` clients ever had a request open. A request that finds
the server full of such leaving generations waits for one to end, and runs."""

from __future__ import annotations

import threading

import pytest

from kakeya.core.generation import Block
from kakeya.core.request import Request
from kakeya.orchestrator.assembly import build_local_engine
from kakeya.orchestrator.fronts.grpc_server import GenerationServicer
from kakeya.orchestrator.fronts.http_server import HttpCall
from kakeya.runtime.lifecycle import RequestError

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def servicer(tiny_pair):
    s = GenerationServicer(
        lambda: build_local_engine(str(tiny_pair.target), str(tiny_pair.draft), "torch"), colocated=True, max_sessions=1
    )
    s.load()
    s.ready = True
    return s


def _request(tag: int, max_tokens: int) -> Request:
    return Request([2, *range(40 + tag, 52 + tag)], max_tokens, 4, ignore_eos=True, request_id=f"r{tag}")


def _until(predicate, then) -> None:
    while not predicate() and not release_all.is_set():
        release_all.wait(0.01)
    then()


release_all = threading.Event()  # the test's end: no helper thread outlives it


def test_a_request_that_finds_the_server_full_of_leaving_generations_waits_for_one_to_end(servicer):
    held, release = threading.Event(), threading.Event()
    first, leaving = HttpCall("ipv4:127.0.0.1:1"), threading.Event()

    def old() -> None:  # a stream whose client closes it after its first block, while its next step waits
        for item in servicer.stream(_request(0, 400), first):
            if isinstance(item, Block) and not leaving.is_set():
                servicer.compute.submit(lambda: (held.set(), release.wait(60)))  # the model thread is busy
                held.wait(60)
                first.leave()
                leaving.set()

    t = threading.Thread(target=old)
    t.start()
    try:
        assert leaving.wait(120)
        assert servicer.active == 1  # its run has not ended yet: it cannot before the model thread is free
        # ... which it is again once the next request waits (before the fix: never, that request is refused at once)
        threading.Thread(target=lambda: _until(lambda: servicer._waiting, release.set)).start()
        out = list(servicer.stream(_request(1, 8), HttpCall("ipv4:127.0.0.1:2")))  # the client's next request
        assert sum(len(b.tokens) for b in out if isinstance(b, Block)) == 8
        assert out[-1].finish_reason == "length"
    finally:
        release.set()
        release_all.set()
        t.join(60)
    assert servicer.active == 0


def test_a_newcomer_is_not_refused_while_there_is_room_for_it_and_the_requests_queued_before_it(servicer):
    """Two clients, ``--max-sessions 2``, no ``--queue``: one's request waited for a leaving generation's place (the
    test above) and had been woken but not yet taken it, when the other's came: 429 "1 of 2 generations in flight",
    though the two places free held both. Queued requests go first (first come first served), but a newcomer is
    full only when the requests in flight and those queued before it fill ``--max-sessions``."""
    servicer.max_sessions = 2
    servicer._waiting.append(-1)  # a queued request woken by a freed place, about to take it (as it stood)
    try:
        out = list(servicer.stream(_request(2, 4), HttpCall("ipv4:127.0.0.1:3")))
        assert out[-1].finish_reason == "length"
        servicer._waiting.append(-2)  # now two ahead of it: with 2 places, it is full (and there is no --queue)
        with pytest.raises(RequestError, match="0 of 2 generations in flight and 2 queued before it"):
            list(servicer.stream(_request(3, 4), HttpCall("ipv4:127.0.0.1:4")))
    finally:
        servicer._waiting.clear()
        servicer.max_sessions = 1
