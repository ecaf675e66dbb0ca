"""The Drafter protocol (``core/contract.py``) over gRPC: ``GrpcDrafter`` and its sessions.

As ``remote/verifier.py``: one ``Session`` stream per session, opened with the first ``draft``. A drafter
that failed is skipped for a while (:class:`Backoff`) and then tried again; meanwhile its sessions draft
nothing (:class:`_SkippedDrafterSession`) and the verifier decodes alone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import grpc

from kakeya.core.contract import Draft, DrafterStats, SessionOptions, WireStats
from kakeya.core.request import SamplingParams
from kakeya.orchestrator.remote.deadlines import StepClock
from kakeya.orchestrator.remote.streams import BackendError, RemoteBackend, Reply, Stream
from kakeya.orchestrator.remote.verifier import _tensor
from kakeya.wire import convert as wire_contract
from kakeya.wire.kakeya.v1 import drafter_pb2 as dpb
from kakeya.wire.kakeya.v1 import drafter_pb2_grpc

log = logging.getLogger("kakeya.remote")


class Backoff:
    """After ``failure()``, ``ready()`` is False for 0.5 s, 1 s, 2 s ... up to ``maximum``."""

    def __init__(self, initial: float = 0.5, factor: float = 2.0, maximum: float = 10.0):
        self.initial, self.factor, self.maximum = initial, factor, maximum
        self.failures = 0
        self.until = 0.0
        self.last_error = ""
        self._lock = threading.Lock()

    def ready(self) -> bool:
        return time.monotonic() >= self.until

    def failure(self, error: str) -> float:
        with self._lock:
            self.failures += 1
            delay = min(self.maximum, self.initial * self.factor ** (self.failures - 1))
            self.until = time.monotonic() + delay
            self.last_error = error
            return delay

    def success(self) -> None:
        with self._lock:
            self.failures, self.until = 0, 0.0


class GrpcDrafterSession:
    """``DrafterSession`` over one Session stream, opened with the first ``draft``."""

    def __init__(self, drafter: GrpcDrafter, sampling: SamplingParams | None, options: SessionOptions):
        self.drafter = self.client = drafter
        self._timeout, self._request_id = options.timeout, options.request_id
        self._elsewhere = drafter.replicas.serving if options.movable else None  # a draining replica's session moves
        self._sampling = sampling if sampling is not None and not sampling.greedy else None
        self._ranked = options.ranked
        self._s: Stream | None = None
        self._broken = False
        self._failure: BackendError | None = None  # the drafter's own failure that broke the session
        self._first = True
        self._opened = None  # the Open's reply: the session id, read once the first draft is answered
        self.session_id = ""
        self.round_ok = True  # False once a round call did not find it (draft_batch sends it on its stream)
        self._resume_at = 0
        self.server_s = 0.0  # server-side time of the drafts (the steps on a block's critical path)
        self._stats = dpb.DrafterStats()  # the server's, as its last answer reported them
        if options.cancel is not None:
            options.cancel.on_cancel(self.abort)

    def cached_prefixes(self, prompt_ids: Sequence[int]) -> list[int]:
        """The server's snapshots of ``prompt_ids``' prefixes ([] without a prefix cache); opens the stream."""
        if not self.drafter.prefix_cache:
            return []
        req = dpb.DrafterRequest(lookup=dpb.DrafterRequest.Lookup(prompt_ids=list(prompt_ids)))
        r = self._guarded(lambda: self._stream().ask(req, "found", self.drafter.clock.timeout()))
        return list(r.found.positions)

    def resume(self, positions: int) -> None:
        self._resume_at = positions  # travels with the first Draft

    def save(self, ids: Sequence[int], unseen: Sequence) -> bool:
        """Ask the server to keep the context after ``ids`` (``unseen``: aux it lacks); False: not kept."""
        if not self.drafter.prefix_cache or self._broken:
            return False
        req = dpb.DrafterRequest(
            save=dpb.DrafterRequest.Save(token_ids=list(ids), unseen_aux=[_tensor(a) for a in unseen])
        )
        self._guarded(lambda: self._stream().post(req, "saved"))
        return True

    def _stream(self) -> Stream:
        if self._s is None:
            d = self.drafter
            self._s = Stream(d.stub.Session, "drafter", d.addr, self._timeout, self._request_id, self._elsewhere)
            sampling = None if self._sampling is None else wire_contract.sampling_to_proto(self._sampling)
            open_ = dpb.DrafterRequest.Open(
                request_id=self._request_id, progress_ms=d.clock.progress_ms, ranked=self._ranked, sampling=sampling
            )
            self._opened = self._s.post(dpb.DrafterRequest(open=open_), "opened")  # answered before the first draft's
        return self._s

    def _guarded(self, step):
        """``step()``; a failure breaks the session and, unless it is ours, counts against the drafter."""
        if self._broken:  # a failed prefix lookup stays the drafter's failure when the first draft reports it
            raise self._failure or BackendError(
                "drafter", self.drafter.addr, grpc.StatusCode.CANCELLED, "session failed earlier"
            )
        try:
            return step()
        except BackendError as exc:
            self._fail(exc)
            raise

    def _fail(self, exc: BackendError) -> BackendError:
        """``exc`` breaks the session and, unless it is ours, counts against the drafter; returned."""
        aborted_here = self._broken  # abort() from our side (client cancelled): not the drafter's fault
        self.abort()
        if not aborted_here and not exc.ended_by_caller:
            # no failure of the drafter, so no backoff for the others: a drain's hand-off, or this session outgrowing
            # it (OUT_OF_RANGE: past its --max-context or its whole K/V budget)
            if not exc.drained and exc.code != grpc.StatusCode.OUT_OF_RANGE:
                self.drafter.failed(exc)
            self._failure = exc
        return exc

    def draft(self, new_aux, last_token: int, block_size: int) -> Draft:
        return self._finish(self._post(new_aux, last_token, block_size))

    def _step_msg(self, new_aux, last_token: int, block_size: int) -> dpb.DrafterRequest.Draft:
        return dpb.DrafterRequest.Draft(
            new_aux=_tensor(new_aux), last_token=last_token, block_size=block_size, resume_at=self._resume_at
        )

    def _post(self, new_aux, last_token: int, block_size: int) -> tuple[float, int, Reply]:
        """Send the draft call now (a batch sends every session's before it waits for any)."""
        req = dpb.DrafterRequest(draft=self._step_msg(new_aux, last_token, block_size))
        shape = req.draft.new_aux.shape
        rows = int(shape[0]) if self._first and len(shape) else 0  # the first draft takes the prompt
        reply = self._guarded(lambda: self._stream().post(req, "drafted"))
        return time.perf_counter(), rows, reply

    def _finish(self, posted: tuple[float, int, Reply]) -> Draft:
        t0, rows, reply = posted
        clock = self.drafter.clock
        r = self._guarded(lambda: self._s.wait(reply, clock.timeout(prefill_tokens=rows)))
        clock.record(time.perf_counter() - t0, prefill_tokens=rows)
        if self._opened is not None and self._opened.response is not None:
            self.session_id = self._opened.response.opened.session_id
        return self._answer(r.drafted, r.elapsed_s)

    def _answer(self, d: dpb.DrafterResponse.Drafted, elapsed_s: float) -> Draft:
        self._first, self._resume_at = False, 0
        self.server_s += elapsed_s
        self.drafter.backoff.success()
        self._stats = d.stats
        k, ids, n = self._ranked, list(d.ranked_ids), len(d.token_ids)
        # k ids a candidate, row-major; ranks that are not (an older server's) leave the block to be cut
        if k and len(ids) == n * k and all(0 <= t < self.drafter.vocab_size for t in ids):
            return Draft(d.token_ids, ranked=[ids[i * k : (i + 1) * k] for i in range(n)])
        if not d.HasField("proposal"):
            return Draft(d.token_ids)
        proposal = wire_contract.proposal_from_proto(d.proposal, len(d.token_ids), self.drafter.vocab_size)
        return Draft(d.token_ids, proposal)

    @property
    def in_rounds(self) -> bool:
        """Its drafts may travel in a round call: past the first, no answer outstanding, not draining or missing."""
        s = self._s
        ok = bool(self.session_id) and self.round_ok and not self._broken
        return ok and not s.done and not s._replies and not s.draining

    @property
    def ended(self) -> bool:
        return self._broken

    def stats(self) -> DrafterStats:
        s = self._s
        wire = WireStats(s.bytes_sent if s else 0, s.bytes_received if s else 0, self.server_s)
        return DrafterStats(self._stats.context_positions, self._stats.kv_bytes, wire=wire)

    def close(self) -> None:
        if self._s is not None and not self._broken:
            self._s.finish(dpb.DrafterRequest(close=dpb.DrafterRequest.Close()), "closed", self.drafter.clock.timeout())

    def abort(self) -> None:
        self._broken = True
        if self._s is not None:
            self._s.abort()


class _SkippedDrafterSession:
    """Handed out while the drafter is backing off: fails at once, so the verifier decodes alone."""

    server_s = 0.0  # it never reaches the server

    def __init__(self, drafter: GrpcDrafter):
        self.drafter = drafter

    def cached_prefixes(self, prompt_ids) -> list[int]:
        return []  # it holds nothing: the run prefills cold

    def resume(self, positions: int) -> None:
        pass

    def save(self, ids, unseen) -> bool:
        return False

    def draft(self, new_aux, last_token, block_size):
        b = self.drafter.backoff
        wait = max(0.0, b.until - time.monotonic())
        why = f"backing off after {b.failures} failure(s), next try in {wait:.1f} s (last: {b.last_error})"
        raise BackendError("drafter", self.drafter.addr, grpc.StatusCode.UNAVAILABLE, why, skipped=True)

    _post = draft  # a batch's call fails alike, before anything is sent
    in_rounds = False

    def stats(self) -> DrafterStats:
        return DrafterStats()

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass


class GrpcDrafter(RemoteBackend):
    """``Drafter`` reached over gRPC, with failure backoff and automatic reconnection."""

    role, info_request, round_request = "drafter", dpb.GetDrafterInfoRequest, dpb.DraftRoundRequest
    round_rpc, step, answer = "DraftRound", "draft", "drafted"

    def __init__(
        self,
        addr: str,
        *,
        wait_s: float | None = None,
        channel=None,
        backoff: Backoff | None = None,
        tls=None,
        token: str | None = None,
        clock: StepClock | None = None,
    ):
        super().__init__(addr, drafter_pb2_grpc.DrafterServiceStub, wait_s, channel, tls, token, clock)
        self.backend = f"grpc:{addr}"
        self.block_size = self.remote.block_size
        self.target_layer_ids = tuple(self.remote.target_layer_ids)
        self.vocab_size, self.hidden_size = self.remote.vocab_size, self.remote.hidden_size
        self.model_name = self.remote.model_name
        self.prefix_cache = self.remote.prefix_cache_bytes > 0
        self.backoff = backoff or Backoff()

    def open_session(self, sampling: SamplingParams | None = None, options: SessionOptions | None = None):
        return self.open_session_now(sampling, options) if self.backoff.ready() else _SkippedDrafterSession(self)

    def open_session_now(self, sampling: SamplingParams | None = None, options: SessionOptions | None = None):
        """A session even while backing off: a take-over found a SERVING replica after one's loss."""
        return GrpcDrafterSession(self, sampling, options or SessionOptions())

    # A round's drafts: one DraftRound call per drafter (first drafts each on its stream; a session handed out
    # while backing off fails at once).
    draft_batch = staticmethod(RemoteBackend.batch)

    def failed(self, exc: Exception) -> None:
        delay = self.backoff.failure(str(exc))
        log.warning("drafter at %s failed (%s); skipping it for %.1f s", self.addr, exc, delay)

    @property
    def state(self) -> str:
        return "ok" if self.backoff.failures == 0 else ("backoff" if not self.backoff.ready() else "retrying")

    def status(self) -> dict[str, str]:
        """Its reconnection state: ``state`` (ok, backoff, retrying), ``failures`` in a row, ``last_error``."""
        b = self.backoff
        return {"state": self.state, "failures": str(b.failures)} | (
            {"last_error": b.last_error[:500]} if b.last_error else {}
        )
