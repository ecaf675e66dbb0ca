"""One scheduler per engine: every live request decoded together, in rounds.

Each round is :func:`loop.advance` over every joined decode: ONE batched draft and ONE batched verify, whatever their
block sizes, rules or sources. Requests join (after prefill) and leave at round boundaries. No thread of its own: the
request that needs a block and finds no round running drives the next one; the others get their blocks from it.

A newcomer waits half a round, not a whole one: work queued for the model thread during a round's draft (``queued``: a
prefill) goes before that round's verify; in the split, a round whose draft finds requests ``starting`` waits for their
prefill before it verifies. A decode's failure is its own; a cancelled request leaves before the next round and its
sessions are closed after it left, so a round never runs on a closed session.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from kakeya.core.generation import Block
from kakeya.orchestrator.decode.loop import Decode, Drafted, draft_round, verify_round


def here(fn, *args):
    """The default ``step``: model work on the calling thread."""
    return fn(*args)


class Scheduler:
    """``draft_many`` / ``decide_many``: the engine's drafter's and verifier's batch calls; ``step``: runs a
    round where model work runs (a colocated server's compute thread; by default the calling thread);
    ``queued``: how many jobs wait for that thread (None: no other work shares it)."""

    def __init__(
        self,
        draft_many: Callable,
        decide_many: Callable,
        step: Callable = here,
        on_round: Callable | None = None,
        queued: Callable[[], int] | None = None,
    ):
        self._draft_many, self._decide_many, self._step, self._queued = draft_many, decide_many, step, queued
        self._on_round = on_round  # on_round(sessions, rows, seconds) after each round (``block_sizing.RoundCosts``)
        self._cv = threading.Condition()
        self._live: dict[Decode, deque[Block]] = {}  # each joined decode and its blocks not yet taken
        self._driving = False
        self._in_round: frozenset[Decode] = frozenset()  # the decodes of the round in flight
        self._starting: set[object] = set()  # requests between arrival and their prefill's answer (``starting``)
        self._waited_for: set[object] = set()  # those a round has waited for already (each one round at most)
        self._round_s = 0.05  # the last round's draft + verify seconds: the most a round waits for them
        self.yields = 0  # rounds that waited for a starting request before their verify (no model thread)

    def join(self, decode: Decode) -> None:
        """``decode`` (prefilled) takes part from the next round on."""
        with self._cv:
            self._live[decode] = deque()

    def leave(self, decode: Decode) -> None:
        """``decode`` takes no part in any later round; returns once no round runs on it."""
        with self._cv:
            while decode in self._in_round:
                self._cv.wait()
            self._live.pop(decode, None)

    @contextmanager
    def starting(self) -> Iterator[None]:
        """Around a request's start (its sessions' opening and its prefill): see the module's text."""
        token = object()
        with self._cv:
            self._starting.add(token)
        try:
            yield
        finally:
            with self._cv:
                self._starting.discard(token)
                self._waited_for.discard(token)
                self._cv.notify_all()

    def _let_starters_in(self) -> None:
        """Wait for the requests starting now, at most one round's time, and for each only once."""
        deadline = time.monotonic() + self._round_s
        with self._cv:
            fresh = self._starting - self._waited_for
            self._waited_for |= fresh
            self.yields += bool(fresh)
            while fresh & self._starting and (left := deadline - time.monotonic()) > 0:
                self._cv.wait(left)

    def wake(self) -> None:
        """Let waiting requests look again (one was cancelled)."""
        with self._cv:
            self._cv.notify_all()

    def next_block(self, decode: Decode, stop: Callable[[], bool] = lambda: False) -> Block | None:
        """``decode``'s next block, running rounds when no one else is; None once done or ``stop()``."""
        with self._cv:
            while True:
                blocks = self._live.get(decode)
                if blocks:
                    return blocks.popleft()
                # a decode the round in flight finished is done before that round hands over its last block
                if blocks is None or stop() or (decode.done and decode not in self._in_round):
                    return None
                if self._driving:
                    self._cv.wait()
                    continue
                self._driving = True
                decodes = [d for d in self._live if not d.done]
                self._in_round = frozenset(decodes)
                self._cv.release()
                try:
                    results = self._round(decodes)
                finally:
                    self._cv.acquire()
                    self._driving, self._in_round = False, frozenset()
                for d, block in results:
                    if d in self._live:
                        self._live[d].append(block)
                self._cv.notify_all()

    def _advance(self, decodes: list[Decode]) -> tuple[Drafted, list | None]:
        """On the model thread: the round's draft, then its verify unless jobs were queued meanwhile (None)."""
        drafted = draft_round(decodes, self._draft_many)
        if self._queued is None:  # no model thread: a newcomer's prefill goes to the verifier before this verify
            self._let_starters_in()
        elif self._queued() > 0:
            return drafted, None
        return drafted, verify_round(drafted, self._decide_many)

    def _round(self, decodes: list[Decode]) -> list:
        try:
            drafted, results = self._step(self._advance, decodes)
            if results is None:  # work was queued meanwhile: it runs first, then this round's verify
                results = self._step(verify_round, drafted, self._decide_many)
        except Exception as exc:  # noqa: BLE001 - a failure of the round itself: every decode in it hears it
            for d in decodes:
                d.fail(exc)
            return []
        if results:
            block = results[0][1]  # every block of a round carries the round's draft and verify times
            self._round_s = block.draft_s + block.verify_s
            if self._on_round is not None:
                self._on_round(len(results), sum(b.drafted + 1 for _, b in results), self._round_s)
        return results
