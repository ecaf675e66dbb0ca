"""The Verifier protocol (``services/core/contract.py``) over gRPC (the Drafter's: ``remote/drafter.py``).

One bidirectional ``Session`` stream per session: opening a session starts the
stream, ``close`` ends it politely (``Close`` -> ``Closed``), ``abort`` cancels
it; the server frees the session's cache either way. Requests are pipelined
where the protocol allows it (``streams.py``: ``Open`` travels with ``Prefill``
/ the first ``Draft``; a ``Predraft`` is answered while the verifier verifies),
so a block costs two round trips: draft, and verify (which commits); one where
its pre-draft was used.

A scheduler's round (``decide_batch``; the drafter's ``draft_batch``) sends the blocks of every session
of one backend in ONE round call (``VerifyRound`` / ``DraftRound``, ``runtime/rounds.py``), named by
the session ids ``Opened`` returned, so the wire is paid per round, not per session; a lone session's
block, and any the server does not find (another replica), travel on the session's stream.

Aux hidden states stay opaque: a verifier session returns the wire ``Tensor``
as it came and a drafter session sends a ``Tensor`` as it is (an array is
encoded with ``services/wire/codec.py``), so split deployments never decode
aux in the orchestrator.

A session takes its request's ``SessionOptions``: the request id travels with
the stream, the client's deadline bounds it, and a cancelled request aborts it
at once (from whichever thread cancels).

Failures surface as ``streams.BackendError`` carrying the gRPC status code. The
drafter's side is ``remote/drafter.py`` (a failed drafter is skipped for a while and
tried again).
Every session asks its backend for Progress messages while a step waits
(``Open.progress_ms``), and a step fails only after a deadline of silence
(``remote/deadlines.py``): a hung backend is noticed within seconds, a slow one is not.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence

import grpc

from kakeya.core.contract import Draft, KVBytes, SessionOptions, Verdict, VerifierStats, WireStats
from kakeya.core.request import MAX_BLOCK_SIZE, CachePolicy, SamplingParams
from kakeya.orchestrator.decode.loop import each
from kakeya.orchestrator.remote.deadlines import StepClock
from kakeya.orchestrator.remote.streams import (
    BackendError,
    Replicas,
    Reply,
    Stream,
    backend_channel,
    backend_healthy,
    call_round,
    call_unary,
    fetch_info,
    round_deadline,
    status_code,
)
from kakeya.wire import codec
from kakeya.wire import convert as wire_contract
from kakeya.wire.kakeya.v1 import verifier_pb2 as vpb
from kakeya.wire.kakeya.v1 import verifier_pb2_grpc
from kakeya.wire.kakeya.v1.tensor_pb2 import Tensor

log = logging.getLogger("kakeya.remote")

ROUND_MIN = 2  # sessions of one verifier in a round before their blocks travel in one VerifyRound call
_ON_STREAM = object()  # a round item the server did not find: sent again on the session's own stream
# The round call itself found no replica (the one it reached died): each item goes on its own stream this round,
# so only the sessions that were on the lost replica fail (and are taken over), not every session in the call.
_RETRY_ON_STREAM = object()


def round_call_lost(exc: BackendError) -> bool:
    """A round call failed because the replica it reached is gone (not hung: a hung one answers no stream either)."""
    return exc.replica_lost and not exc.step_timeout


# --------------------------------------------------------------------------- verifier


class GrpcVerifierSession:
    """``VerifierSession`` over one Session stream."""

    def __init__(
        self,
        verifier: GrpcVerifier,
        policy: CachePolicy | None,
        sampling: SamplingParams | None,
        options: SessionOptions,
    ):
        self.verifier = verifier
        self.clock = verifier.clock
        elsewhere = verifier.replicas.serving if options.movable else None  # a draining replica's session moves
        self._s = Stream(
            verifier.stub.Session, "verifier", verifier.addr, options.timeout, options.request_id, elsewhere
        )
        if options.cancel is not None:
            options.cancel.on_cancel(self.abort)
        open_ = vpb.VerifierRequest.Open(
            request_id=options.request_id,
            target_layer_ids=list(verifier.aux_layers),
            max_positions=options.max_positions,
            progress_ms=self.clock.progress_ms,
        )
        if options.logprobs is not None:
            open_.logprobs = options.logprobs
        self.logprobs = options.logprobs
        self.first_logprobs = None
        if sampling is not None and not sampling.greedy:
            open_.sampling.CopyFrom(wire_contract.sampling_to_proto(sampling))
        if policy is not None:
            open_.cache_policy.CopyFrom(wire_contract.policy_to_proto(policy))
        if options.constraint is not None:
            open_.constraint.CopyFrom(wire_contract.constraint_to_proto(options.constraint))
        self._opened = self._s.post(vpb.VerifierRequest(open=open_), "opened")  # answered with the prefill
        self.session_id = ""
        self.cache_policy = ""
        self._stats = vpb.SessionStats()
        self.server_s = 0.0  # server-side time of all steps (the rest of a step's time is the wire)
        self.round_ok = True  # False once a round call did not find it (decide_batch sends it on its stream)

    def _aux(self, tensor: Tensor):
        like = self.verifier.aux_like
        return tensor if like is None else codec.from_proto(tensor, like=like)

    def _step(self, request, expect):
        t0 = time.perf_counter()
        resp = self._s.ask(request, expect, self.clock.timeout())
        self.clock.record(time.perf_counter() - t0)
        self.server_s += resp.elapsed_s
        return resp

    def prefill(self, prompt_ids: Sequence[int]):
        first, aux, _ = self._prefill(vpb.VerifierRequest.Prefill(token_ids=list(prompt_ids)))
        return first, aux

    def prefill_steps(self, prompt_ids: Sequence[int], reuse: Collection[int] | None = ()):
        """One step, one round trip: the server chunks a long prompt itself (its other sessions' steps run
        between the chunks there) and resumes what its prefix cache holds (``reuse``, as the contract says)."""
        p = vpb.VerifierRequest.Prefill(
            token_ids=list(prompt_ids), reuse_any=reuse is None, reuse_positions=reuse or ()
        )
        yield from ()
        return self._prefill(p)

    def _prefill(self, prefill: vpb.VerifierRequest.Prefill):
        n = len(prefill.token_ids)
        t0 = time.perf_counter()
        prefilled = self._s.post(vpb.VerifierRequest(prefill=prefill), "prefilled")
        opened = self._s.wait(self._opened, self.clock.timeout()).opened
        self.session_id = opened.session_id
        self.cache_policy = wire_contract.policy_from_proto(opened.cache_policy, CachePolicy()).label
        r = self._s.wait(prefilled, self.clock.timeout(prefill_tokens=n))
        ran = n - r.prefilled.cached_tokens  # a resumed prefix costs next to nothing: not a prefill time
        self.clock.record(time.perf_counter() - t0, prefill_tokens=max(ran, 1))
        self.server_s += r.elapsed_s
        self._stats = r.prefilled.stats
        if r.prefilled.HasField("logprobs"):
            self.first_logprobs = wire_contract.logprobs_from_proto(r.prefilled.logprobs)
        return r.prefilled.next_token, self._aux(r.prefilled.aux), r.prefilled.cached_tokens

    def save(self, ids: Sequence[int]) -> bool:
        """Ask the server to keep this session's state after ``ids``; sent now, answered before ``Closed``
        (the generation is over: nothing waits on it). False when the server keeps no prefix cache."""
        if not self.verifier.prefix_cache:
            return False
        self._s.post(vpb.VerifierRequest(save=vpb.VerifierRequest.Save(token_ids=list(ids))), "saved")
        return True

    def decide(self, last_token: int, draft: Draft) -> Verdict:
        return self._verdict(self._post_verify(last_token, draft))

    @staticmethod
    def _verify_msg(last_token: int, draft: Draft) -> vpb.VerifierRequest.Verify:
        v = vpb.VerifierRequest.Verify(block_ids=[last_token, *draft.tokens])
        if draft.proposal is not None:
            v.proposal.CopyFrom(wire_contract.proposal_to_proto(draft.proposal))
        return v

    def _post_verify(self, last_token: int, draft: Draft) -> tuple[float, Reply]:
        """Send the block now (a batch sends every session's before it waits for any)."""
        verify = vpb.VerifierRequest(verify=self._verify_msg(last_token, draft))
        return time.perf_counter(), self._s.post(verify, "verified")

    def _verdict(self, posted: tuple[float, Reply]) -> Verdict:
        t0, reply = posted
        resp = self._s.wait(reply, self.clock.timeout())
        self.clock.record(time.perf_counter() - t0)
        self.server_s += resp.elapsed_s
        return self._verified(resp.verified)

    def _verified(self, r: vpb.VerifierResponse.Verified) -> Verdict:
        self._stats = r.stats
        logprobs = None
        if self.logprobs is not None:
            if len(r.logprobs) != r.accepted + 1:
                raise ValueError(f"the verifier sent {len(r.logprobs)} logprobs for {r.accepted + 1} committed tokens")
            logprobs = tuple(wire_contract.logprobs_from_proto(m) for m in r.logprobs)
        return Verdict(r.accepted, r.next_token, self._aux(r.aux), logprobs)

    @property
    def in_rounds(self) -> bool:
        """Its blocks may travel in a round call: prefilled (the server knows its id), its stream open, its
        replica not draining (its next step decides on the stream whether it moves), and not found missing by
        an earlier round (a replica other than the one round calls reach)."""
        return bool(self.session_id) and self.round_ok and not self._s.done and not self._s.draining

    def stats(self) -> VerifierStats:
        s = self._stats
        return VerifierStats(
            cache_policy=self.cache_policy,
            bounded=s.bounded,
            positions=s.positions,
            kv_bytes=KVBytes(s.kv_bytes_sliding, s.kv_bytes_full),
            wire=WireStats(self._s.bytes_sent, self._s.bytes_received, self.server_s),
        )

    def close(self) -> None:
        r = self._s.finish(vpb.VerifierRequest(close=vpb.VerifierRequest.Close()), "closed", self.clock.timeout())
        if r is not None:
            self._stats = r.closed.stats

    def abort(self) -> None:
        self._s.abort()


class GrpcVerifier:
    """``Verifier`` reached over gRPC. ``info`` and the default ``policy`` come from the server's GetInfo.

    ``aux_layers``: the layers whose hidden states every session asks for (the
    drafter's, settled when the engine is assembled); none given: the server's
    default, or the last layer if it has none.
    """

    def __init__(
        self,
        addr: str,
        *,
        aux_layers: Sequence[int] = (),
        wait_s: float | None = None,
        aux_like: str | None = None,
        channel=None,
        tls=None,
        token: str | None = None,
        clock: StepClock | None = None,
    ):
        self.addr = addr
        self.channel = channel or backend_channel(addr, tls, token)
        self.replicas = Replicas(self.channel)
        self.clock = clock or StepClock()
        self.stub = verifier_pb2_grpc.VerifierServiceStub(self.channel)
        self.aux_like = aux_like  # None: aux stays a wire Tensor; "mlx"/"torch"/"numpy": decoded
        self.remote = fetch_info("verifier", addr, self.stub.GetInfo, vpb.GetVerifierInfoRequest(), wait_s)
        r = self.remote
        self.info = wire_contract.model_info_from_verifier(
            r,
            f"grpc:{addr}",
            {"remote_backend": r.backend, "device": r.device, "aux_dtype": codec.dtype_name(r.aux_dtype)},
        )
        self.aux_layers = tuple(aux_layers) or tuple(r.target_layer_ids) or (self.info.num_layers - 1,)
        # restoration sources stay named as the server publishes them: it maps the names to directories
        self.policy = wire_contract.policy_from_proto(
            r.default_cache_policy, CachePolicy(slack=r.max_block_size or MAX_BLOCK_SIZE)
        )
        self.prefix_cache = r.prefix_cache_bytes > 0  # the server resumes prefixes (and keeps what sessions save)
        self.constrains = r.constrains  # the server has the tokenizer its sessions compile constraints against
        self._usage = (-1e9, 0.0)  # (when read, kv_usage) of the last GetInfo (``kv_usage``)

    def healthy(self, timeout: float = 1.0) -> bool:
        return backend_healthy(self.channel, timeout)

    def kv_usage(self) -> float:
        """Its K/V budget in use (reserved over ``--max-kv-bytes``, 0..1), as one replica's GetInfo says, read at
        most once a second (a gateway's endpoint picker scrapes every few ms); the last figure while it fails."""
        now = time.monotonic()
        if now - self._usage[0] >= 1.0:
            try:
                r = self.get_info(timeout=0.5)
                self._usage = (now, min(1.0, r.reserved_kv_bytes / r.max_kv_bytes) if r.max_kv_bytes else 0.0)
            except BackendError:
                self._usage = (now, self._usage[1])
        return self._usage[1]

    def get_info(self, timeout: float = 5.0) -> vpb.VerifierInfo:
        return call_unary("verifier", self.addr, self.stub.GetInfo, vpb.GetVerifierInfoRequest(), timeout)

    def open_session(
        self,
        policy: CachePolicy | None = None,
        sampling: SamplingParams | None = None,
        options: SessionOptions | None = None,
    ) -> GrpcVerifierSession:
        return GrpcVerifierSession(self, policy, sampling, options or SessionOptions())

    @staticmethod
    def decide_batch(items: Sequence[tuple[GrpcVerifierSession, int, Draft]]) -> list[Verdict | Exception]:
        """A round's blocks: the sessions of one verifier travel in ONE ``VerifyRound`` call when there are
        ``ROUND_MIN`` or more of them (the wire paid per round, not per session), the rest each on its stream,
        sent before any answer is awaited; the server's compute thread verifies them all as one batch. Each
        session's failure its own."""
        groups: dict[GrpcVerifier, list[int]] = {}
        for k, (s, _, _) in enumerate(items):
            if s.in_rounds:
                groups.setdefault(s.verifier, []).append(k)
        rounds = [ks for ks in groups.values() if len(ks) >= ROUND_MIN]
        in_round = {k for ks in rounds for k in ks}
        alone = [k for k in range(len(items)) if k not in in_round]
        out: list = [None] * len(items)
        posted = dict(zip(alone, each(lambda s, last, draft: s._post_verify(last, draft), [items[k] for k in alone])))
        for ks in rounds:
            verdicts = items[ks[0]][0].verifier.verify_round([items[k] for k in ks])
            for k, v in zip(ks, verdicts):
                if v is _ON_STREAM or v is _RETRY_ON_STREAM:  # not on the replica the round reached: its stream
                    items[k][0].round_ok = v is _RETRY_ON_STREAM  # from now on, unless that replica died
                    posted[k] = each(lambda s, last, draft: s._post_verify(last, draft), [items[k]])[0]
                else:
                    out[k] = v
        for k, p in posted.items():
            out[k] = p if isinstance(p, Exception) else each(items[k][0]._verdict, [(p,)])[0]
        return out

    def verify_round(self, items: Sequence[tuple[GrpcVerifierSession, int, Draft]]) -> list:
        """One ``VerifyRound`` call for ``items`` (sessions of this verifier): a Verdict or an exception per
        item, or ``_ON_STREAM`` for a session the server that answered does not hold."""
        req = vpb.VerifyRoundRequest(progress_ms=self.clock.progress_ms)
        for s, last, draft in items:
            req.items.add(session_id=s.session_id).verify.CopyFrom(GrpcVerifierSession._verify_msg(last, draft))
        t0 = time.perf_counter()
        try:
            timeout = round_deadline([s._s for s, _, _ in items])
            resp = call_round(self.stub.VerifyRound, req, "verifier", self.addr, self.clock.timeout(), timeout)
        except BackendError as exc:  # the call itself failed (a hung verifier): every session in it hears it
            return [_RETRY_ON_STREAM if round_call_lost(exc) else exc] * len(items)
        self.clock.record(time.perf_counter() - t0)
        out = []
        for (s, _, _), sent, got in zip(items, req.items, resp.done.items):
            s._s.bytes_sent += sent.ByteSize()
            s._s.bytes_received += got.ByteSize()
            s.server_s += resp.elapsed_s
            if s._s.done:  # cancelled meanwhile: as its stream would say
                out.append(BackendError("verifier", self.addr, grpc.StatusCode.CANCELLED, "session is closed"))
            elif got.WhichOneof("result") == "verified":
                s._s.draining = s._s.draining or resp.draining
                out.append(s._verified(got.verified))
            elif got.error.code == grpc.StatusCode.NOT_FOUND.value[0]:
                out.append(_ON_STREAM)
            else:
                out.append(BackendError("verifier", self.addr, status_code(got.error.code), got.error.message))
        return out

    def close(self) -> None:
        self.channel.close()


# --------------------------------------------------------------------------- drafter


def _tensor(aux) -> Tensor:
    """Aux as the wire Tensor: a verifier's comes as one already (passed on, never decoded here)."""
    return aux if isinstance(aux, Tensor) else codec.to_proto(aux)
