"""The Verifier protocol (``core/contract.py``) over gRPC (the Drafter's: ``remote/drafter.py``).

One bidirectional ``Session`` stream per session: opening starts it, ``close`` ends it politely, ``abort`` cancels it;
the server frees the session's cache either way. ``Open`` travels with ``Prefill``, so a block costs two round trips. A
scheduler's round sends every session's block to one backend in ONE ``VerifyRound`` call; a lone session's block, and
any the server does not find (another replica), travel on the session's stream.

Aux stays opaque: a wire ``Tensor`` is passed on as it came. Failures are ``streams.BackendError``s; a step fails only
after a deadline of silence (``remote/deadlines.py``): a hung backend is noticed within seconds, a slow one is not.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence

import grpc

from kakeya.core.contract import Draft, KVBytes, SessionOptions, Verdict, VerifierStats, WireStats
from kakeya.core.request import MAX_BLOCK_SIZE, CachePolicy, SamplingParams
from kakeya.orchestrator.remote.deadlines import StepClock
from kakeya.orchestrator.remote.streams import BackendError, RemoteBackend, Reply, Stream
from kakeya.wire import codec
from kakeya.wire import convert as wire_contract
from kakeya.wire.kakeya.v1 import verifier_pb2 as vpb
from kakeya.wire.kakeya.v1 import verifier_pb2_grpc
from kakeya.wire.kakeya.v1.tensor_pb2 import Tensor


class GrpcVerifierSession:
    """``VerifierSession`` over one Session stream."""

    def __init__(
        self,
        verifier: GrpcVerifier,
        policy: CachePolicy | None,
        sampling: SamplingParams | None,
        options: SessionOptions,
    ):
        self.verifier = self.client = verifier
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
            logprobs=options.logprobs,
            sampling=None if sampling is None or sampling.greedy else wire_contract.sampling_to_proto(sampling),
            cache_policy=None if policy is None else wire_contract.policy_to_proto(policy),
            constraint=None if options.constraint is None else wire_contract.constraint_to_proto(options.constraint),
        )
        self.logprobs = options.logprobs
        self.first_logprobs = None
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
        """One step, one round trip: the server chunks a long prompt itself and resumes its prefix cache."""
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
        if not self.verifier.serves_its_model(opened.info):  # a lost replica, as to take-over: another opens it
            why = f"replica serves another model ({opened.info.model_name}, its session {opened.session_id})"
            raise BackendError("verifier", self.verifier.addr, grpc.StatusCode.UNAVAILABLE, why)
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
        """Ask the server to keep this session's state after ``ids``; False without a prefix cache."""
        if not self.verifier.prefix_cache:
            return False
        self._s.post(vpb.VerifierRequest(save=vpb.VerifierRequest.Save(token_ids=list(ids))), "saved")
        return True

    def decide(self, last_token: int, draft: Draft) -> Verdict:
        return self._finish(self._post(last_token, draft))

    @staticmethod
    def _step_msg(last_token: int, draft: Draft) -> vpb.VerifierRequest.Verify:
        proposal = None if draft.proposal is None else wire_contract.proposal_to_proto(draft.proposal)
        return vpb.VerifierRequest.Verify(block_ids=[last_token, *draft.tokens], proposal=proposal)

    def _post(self, last_token: int, draft: Draft) -> tuple[float, Reply]:
        """Send the block now (a batch sends every session's before it waits for any)."""
        verify = vpb.VerifierRequest(verify=self._step_msg(last_token, draft))
        return time.perf_counter(), self._s.post(verify, "verified")

    def _finish(self, posted: tuple[float, Reply]) -> Verdict:
        t0, reply = posted
        resp = self._s.wait(reply, self.clock.timeout())
        self.clock.record(time.perf_counter() - t0)
        return self._answer(resp.verified, resp.elapsed_s)

    def _answer(self, r: vpb.VerifierResponse.Verified, elapsed_s: float) -> Verdict:
        self.server_s += elapsed_s
        self._stats = r.stats
        logprobs = None
        if self.logprobs is not None:
            if len(r.logprobs) != r.accepted + 1:
                raise ValueError(f"the verifier sent {len(r.logprobs)} logprobs for {r.accepted + 1} committed tokens")
            logprobs = tuple(wire_contract.logprobs_from_proto(m) for m in r.logprobs)
        return Verdict(r.accepted, r.next_token, self._aux(r.aux), logprobs)

    @property
    def in_rounds(self) -> bool:
        """Its blocks may travel in a round call: prefilled, stream open, not draining or found missing."""
        return bool(self.session_id) and self.round_ok and not self._s.done and not self._s.draining

    @property
    def ended(self) -> bool:
        return self._s.done

    @staticmethod
    def _fail(exc: BackendError) -> BackendError:
        return exc  # a verifier's failure ends nothing here: the loop (its take-over) decides

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


class GrpcVerifier(RemoteBackend):
    """``Verifier`` reached over gRPC; ``info`` and ``policy`` from the server's GetInfo. ``aux_layers``: the
    layers whose hidden states every session asks for (none given: the server's default, or the last)."""

    role, info_request, round_request = "verifier", vpb.GetVerifierInfoRequest, vpb.VerifyRoundRequest
    round_rpc, step, answer = "VerifyRound", "verify", "verified"

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
        remote: vpb.VerifierInfo | None = None,  # its GetInfo, asked already: not asked again
    ):
        super().__init__(addr, verifier_pb2_grpc.VerifierServiceStub, wait_s, channel, tls, token, clock, remote)
        self.aux_like = aux_like  # None: aux stays a wire Tensor; "mlx"/"torch"/"numpy": decoded
        r = self.remote
        extra = {"remote_backend": r.backend, "device": r.device, "aux_dtype": codec.dtype_name(r.aux_dtype)}
        self.info = wire_contract.model_info_from_verifier(r, f"grpc:{addr}", extra)
        self.aux_layers = tuple(aux_layers) or tuple(r.target_layer_ids) or (self.info.num_layers - 1,)
        # restoration sources stay named as the server publishes them: it maps the names to directories
        default = CachePolicy(slack=r.max_block_size or MAX_BLOCK_SIZE)
        self.policy = wire_contract.policy_from_proto(r.default_cache_policy, default)
        self.prefix_cache = r.prefix_cache_bytes > 0  # the server resumes prefixes (and keeps what sessions save)
        self.constrains = r.constrains  # the server has the tokenizer its sessions compile constraints against
        self._usage = (-1e9, 0.0)  # (when read, kv_usage) of the last GetInfo (``kv_usage``)

    def serves_its_model(self, info: vpb.VerifierInfo) -> bool:
        """A replica of ``info`` serves the model this one was checked for: sessions go to any replica."""
        same = ("model_name", "vocab_size", "hidden_size", "num_layers")
        return [getattr(info, k) for k in same] == [getattr(self.remote, k) for k in same]

    def kv_usage(self) -> float:
        """Its K/V budget in use (0..1) per one replica's GetInfo, read at most once a second."""
        now = time.monotonic()
        if now - self._usage[0] >= 1.0:
            try:
                r = self.get_info(timeout=0.5)
                self._usage = (now, min(1.0, r.reserved_kv_bytes / r.max_kv_bytes) if r.max_kv_bytes else 0.0)
            except BackendError:
                self._usage = (now, self._usage[1])
        return self._usage[1]

    def open_session(self, policy=None, sampling=None, options: SessionOptions | None = None) -> GrpcVerifierSession:
        return GrpcVerifierSession(self, policy, sampling, options or SessionOptions())

    decide_batch = staticmethod(RemoteBackend.batch)  # a round's blocks: one VerifyRound call per verifier


def _tensor(aux) -> Tensor:
    """Aux as the wire Tensor: a verifier's comes as one already (passed on, never decoded here)."""
    return aux if isinstance(aux, Tensor) else codec.to_proto(aux)
