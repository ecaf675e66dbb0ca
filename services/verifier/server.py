"""The verifier's gRPC servicer: one Session stream == one :class:`LocalVerifierSession`.

The stream IS the session: the KV cache is created at ``Open`` and freed when the stream ends, however it ends
(``runtime/servicer.py``). A block is one Verify: only token ids go down, and the verdict (the acceptance rule applied
here, the block committed) comes back with the kept positions' aux in the model's own dtype (``wire/codec.py``); never
logits. A sampling session samples with the request's seed: under the coupled rule from the candidates alone, under the
rejection rule with the drafter's proposal beside them. A ``VerifyRound`` call carries a round's blocks of many sessions
(``runtime/servicer.py``), each checked and answered as its stream's Verify. Model work runs on the process's one
compute thread; this module translates and validates messages, with errors that name the offending field.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from kakeya.core.constraints import ConstraintError
from kakeya.core.contract import Draft, VerifierStats
from kakeya.runtime import bounds
from kakeya.runtime.admission import SessionEntry
from kakeya.runtime.lifecycle import (
    ServerSpec,
    check_policy,
    check_token_ids,
    invalid,
    policy_from_request,
    precondition,
    version,
)
from kakeya.runtime.servicer import RoundSlot, RoundWire, SessionLimits, SessionServicer, serve_round
from kakeya.verifier.session import LocalVerifierSession, VerifyItem, check_proposal, decide
from kakeya.wire import codec
from kakeya.wire import convert as wire_contract
from kakeya.wire.kakeya.v1 import verifier_pb2 as pb
from kakeya.wire.kakeya.v1 import verifier_pb2_grpc
from kakeya.wire.limits import PUBLIC_MAX_RECEIVE_BYTES

log = logging.getLogger("kakeya.verifier")

ROUND_WIRE = RoundWire(pb.VerifyRoundResponse, "verify", "verified", pb.VerifierResponse.Progress)


def _stats_proto(stats: VerifierStats) -> pb.SessionStats:
    return pb.SessionStats(
        kv_bytes_sliding=stats.kv_bytes.sliding,
        kv_bytes_full=stats.kv_bytes.full,
        positions=stats.positions,
        bounded=stats.bounded,
    )


@dataclass
class _Stream:
    """One Session stream's state between its messages (``SessionServicer._serve``)."""

    entry: SessionEntry
    session: LocalVerifierSession
    max_positions: int  # the most positions it may hold (open.max_positions, --max-context)
    every: float  # seconds between Progress messages while a step waits (open.progress_ms)
    prefilled: bool = False


class VerifierServicer(SessionServicer, verifier_pb2_grpc.VerifierServiceServicer):
    """Serves one loaded target (``LocalVerifier``) to many concurrent session streams."""

    role = "verifier"
    kv_kinds = ("sliding", "full")
    steps = ("prefill", "verify", "save")

    def __init__(self, limits: SessionLimits = SessionLimits(), restore: bounds.RestoreSources | None = None):
        # concurrent sessions' Verify steps that queue up meanwhile run as one batched forward
        # (session.decide); a prefill runs one chunk per job, so verifies run between chunks.
        # Prefix snapshots live on the device beside the sessions' K/V, outside --max-kv-bytes.
        super().__init__(limits)
        self.verifier = None  # LocalVerifier, set by load()
        self.context_limits: bounds.ContextLimits | None = None  # set by load(), from the target's config
        self.kv_shape = None  # memory.KVShape: a session's worst-case bytes, before it allocates any
        self.restore = restore or bounds.RestoreSources()

    def load(self, target_dir: str | Path, aux_layers: Sequence[int] = (), backend: str = "mlx", **kwargs) -> str:
        """Load the target (``loader.local_verifier``) on the compute thread and warm it up."""
        from kakeya.verifier.loader import local_verifier

        def make():
            return local_verifier(str(target_dir), list(aux_layers), backend, **kwargs)

        return self.compute.run(self._setup, make, target_dir, tuple(aux_layers), kwargs.get("dtype"))

    def _setup(self, make, target_dir, aux_layers, dtype=None) -> str:
        from kakeya.checkpoints.config import load_target_config
        from kakeya.verifier.memory import DTYPE_BYTES, KVShape

        cfg = load_target_config(target_dir)
        self.verifier = make()
        info = self.verifier.info
        self.context_limits = bounds.ContextLimits.of(
            int(cfg.get("max_position_embeddings") or 131072), info.sliding_window, self.max_context_flag
        )
        self._check_restore_sources()
        dtype = str(dtype or self.verifier.target.dtype_name)
        self.kv_shape = KVShape.from_config(cfg, dtype if dtype in DTYPE_BYTES else None)
        backend = info.backend
        warm_layers = aux_layers or (info.num_layers - 1,)
        session = self._new_session(warm_layers, self.verifier.policy)
        prompt = [i % info.vocab_size for i in range(1, 6)]
        _, aux = session.prefill(prompt)
        session.decide(prompt[0], Draft(prompt[1:3]))
        session.close()
        self.aux_dtype = codec.to_proto(aux[:1]).dtype
        self.device = self.verifier.target.device_name
        self._inline_if_safe(backend)
        return (
            f"target {target_dir} ({backend} on {self.device}, {info.num_layers} layers, vocab {info.vocab_size},"
            f" aux {codec.dtype_name(self.aux_dtype)})"
        )

    def _check_restore_sources(self) -> None:
        """Load every configured f_theta now: a bad --restore is a startup error, never a request's."""
        target = self.verifier.target
        for name, path in self.restore.by_name.items():
            if not target.restores:
                raise ValueError(
                    f"--restore {name}: f_theta restoration is not implemented on the {self.verifier.info.backend} backend"
                )
            try:
                target.restorer(path)
            except (OSError, ValueError) as exc:
                raise ValueError(f"--restore {name}={path}: {exc}") from None

    def _new_session(self, aux_layers, policy, sampling=None, logprobs=None, grammar=None):
        return LocalVerifierSession(
            self.verifier.target, aux_layers, policy, sampling, self.prefixes, logprobs=logprobs, grammar=grammar
        )

    def _open_grammar(self, open_):
        """``open.constraint`` compiled for the session (None: unset); INVALID_ARGUMENT naming its field."""
        try:
            constraint, _ = wire_contract.constraint_from_proto(open_.constraint, "open.constraint")
            if constraint is None:
                return None
            if not self.verifier.constrains:
                raise ValueError("open.constraint: this verifier has no tokenizer to compile a constraint against")
            return self.verifier.open_grammar(constraint)
        except ValueError as exc:
            message = str(exc)
            raise invalid(message if message.startswith("open.") else f"open.{message}") from None

    def info(self) -> pb.VerifierInfo:
        i = self.verifier.info
        return wire_contract.verifier_info_to_proto(
            i,
            self.verifier.aux_layers,
            aux_dtype=self.aux_dtype,
            device=self.device,
            version=version(),
            default_cache_policy=self._wire_policy(self.verifier.policy.resolve(i.sliding_window)),
            max_block_size=self.verifier.policy.slack,
            constrains=self.verifier.constrains,
            **self.registry.info_counts(),
            max_position_embeddings=self.context_limits.max_position_embeddings,
            max_context=self.context_limits.max_context,
            max_kv_bytes=self.registry.max_kv_bytes,
            reserved_kv_bytes=self.registry.reserved_bytes,
            restore_sources=self.restore.names(),
            prefix_cache_bytes=self.prefixes.budget if self.prefixes is not None else 0,
        )

    def _progress(self, waited_s: float) -> pb.VerifierResponse:
        return pb.VerifierResponse(progress=pb.VerifierResponse.Progress(waited_s=waited_s))

    def _wire_policy(self, policy):
        """A policy as clients see it: restoration by source name, never by server path."""
        return wire_contract.policy_to_proto(self.restore.to_wire(policy))

    def _open_policy(self, open_, max_positions: int):
        """Open's cache policy, checked before anything is allocated: a window (or sink count) beyond the
        larger of the model's window and ``max_positions`` would only allocate slots that never fill."""
        field = "open.cache_policy"
        policy = policy_from_request(open_.cache_policy, self.verifier.policy, field)
        try:
            bounds.check_window(policy, max(self.context_limits.sliding_window, max_positions), field)
        except ValueError as exc:
            raise invalid(str(exc)) from None
        policy = check_policy(policy, self.verifier.info.sliding_window, field)
        if open_.cache_policy.kind:  # the client's own policy: its restoration source is a NAME
            try:
                policy = self.restore.to_server(policy, field)
            except ValueError as exc:
                raise invalid(str(exc)) from None
        return policy

    def _worst_case_bytes(self, policy, positions: int) -> int:
        """K/V bytes a session of ``positions`` may reach (full layers grow in steps of 256 positions)."""
        from kakeya.verifier.memory import session_bytes

        alloc = -(-(positions + policy.slack) // 256) * 256
        return int(session_bytes(self.kv_shape, policy, alloc)["total_bytes"])

    def _open(self, entry, open_):
        if open_.max_positions < 0:
            raise invalid(f"open.max_positions must be >= 0 (0: the server's max_context), got {open_.max_positions}")
        try:
            max_positions = self.context_limits.check_positions(
                open_.max_positions or self.context_limits.max_context, "open.max_positions"
            )
        except ValueError as exc:
            raise invalid(str(exc)) from None
        policy = self._open_policy(open_, max_positions)
        every = self._progress_every(open_)
        n_layers = self.verifier.info.num_layers
        layers = list(open_.target_layer_ids) or list(self.verifier.aux_layers)
        if not layers:
            raise invalid("open.target_layer_ids: this verifier has no default aux layers: send them")
        bad = [i for i in layers if not 0 <= i < n_layers]
        if bad or len(set(layers)) != len(layers):
            shown = f"{layers}" if len(layers) <= 8 else f"{layers[:8]} ... ({len(layers)} ids)"
            raise invalid(f"open.target_layer_ids: {shown} must be distinct layers in [0, {n_layers})")
        try:
            sampling = wire_contract.sampling_from_proto(open_.sampling, "open.sampling")
            logprobs = (
                wire_contract.check_logprobs(open_.logprobs, "open.logprobs") if open_.HasField("logprobs") else None
            )
        except ValueError as exc:
            raise invalid(str(exc)) from None
        grammar = self._open_grammar(open_)
        yield from self._queued(every, self.registry.reserve, entry, self._worst_case_bytes(policy, max_positions))
        session = entry.session = yield from self._compute(
            every, self._new_session, layers, policy, sampling, logprobs, grammar
        )
        opened = pb.VerifierResponse.Opened(
            info=self.info(), cache_policy=self._wire_policy(session.policy), session_id=entry.id
        )
        return _Stream(entry, session, max_positions, every), pb.VerifierResponse(opened=opened)

    def _step_prefill(self, s: _Stream, prefill):
        if s.prefilled:
            raise precondition("prefill: already prefilled (chunked prefill is not supported yet)")
        if len(prefill.token_ids) > s.max_positions:
            raise invalid(
                f"prefill.token_ids: {len(prefill.token_ids)} positions exceed this session's"
                f" max_positions {s.max_positions} (open.max_positions / --max-context)"
            )
        ids = check_token_ids(prefill.token_ids, self.verifier.info.vocab_size, "prefill.token_ids")
        reuse = None if prefill.reuse_any else tuple(prefill.reuse_positions)
        try:
            next_token, aux, stats = yield from self._prefill(s.entry, s.session, ids, reuse, s.every)
        except ConstraintError as exc:  # its grammar met llguidance's budget choosing the first token
            raise _unfollowable(exc) from None
        s.prefilled = True
        s.entry.round = RoundSlot(partial(self._verify_item, s.entry, s.session, s.max_positions))
        resp = pb.VerifierResponse(
            prefilled=pb.VerifierResponse.Prefilled(
                next_token=next_token, aux=aux, stats=stats, cached_tokens=s.session.cached_tokens
            )
        )
        if s.session.first_logprobs is not None:
            resp.prefilled.logprobs.CopyFrom(wire_contract.logprobs_to_proto(s.session.first_logprobs))
        return resp

    def _step_verify(self, s: _Stream, verify):
        if not s.prefilled:
            raise precondition("verify: prefill the prompt first")
        verified = yield from self._round_step(s.entry, "verify", verify, s.every, self._verify_batch)
        return pb.VerifierResponse(verified=verified)

    def _step_save(self, s: _Stream, save):
        if not s.prefilled:
            raise precondition("save: the session was never prefilled (save ends a generation)")
        ids = check_token_ids(save.token_ids, self.verifier.info.vocab_size, "save.token_ids")
        try:
            kept = yield from self._compute(s.every, s.session.save, ids)
        except ValueError as exc:
            raise invalid(str(exc).replace("save:", "save.token_ids:", 1)) from None
        return pb.VerifierResponse(saved=pb.VerifierResponse.Saved(kept=kept))

    def _close(self, s: _Stream):
        stats = _stats_proto((yield from self._compute(s.every, s.session.stats)))
        return pb.VerifierResponse(closed=pb.VerifierResponse.Closed(stats=stats))

    def VerifyRound(self, request, context):
        yield from serve_round(self, ROUND_WIRE, self._verify_batch, request, context)

    def _verify_item(self, entry, session, max_positions: int, verify) -> tuple:
        """A Verify step checked (errors name its fields) and made a ``_verify_batch`` item; on a stream or
        in a round call alike."""
        vocab = self.verifier.info.vocab_size
        ids = check_token_ids(verify.block_ids, vocab, "verify.block_ids")
        if len(ids) > session.policy.slack:
            raise invalid(
                f"verify.block_ids: {len(ids)} positions exceed this session's max block size {session.policy.slack}"
            )
        if session.offset + len(ids) > max_positions:
            raise invalid(
                f"verify.block_ids: {session.offset} + {len(ids)} positions exceed this session's"
                f" max_positions {max_positions} (open.max_positions / --max-context)"
            )
        return entry, VerifyItem(session, ids, self._proposal(session, verify, ids, vocab))

    @staticmethod
    def _proposal(session, verify, ids, vocab):
        """A rejection-rule session's proposal for ``ids[1:]``, checked here so a bad or missing one (or
        one sent to a coupled-rule session) is INVALID_ARGUMENT."""
        if session.sampling is None or len(ids) == 1:
            return None
        try:
            proposal = None
            if verify.HasField("proposal"):
                proposal = wire_contract.proposal_from_proto(verify.proposal, len(ids) - 1, vocab, "verify.proposal")
            check_proposal(ids[1:], proposal, session.sampling.rule)
        except ValueError as exc:
            msg = str(exc)  # check_proposal names "proposal...": the field is verify.proposal here
            raise invalid(f"verify.{msg}" if msg.startswith("proposal") else msg) from None
        return proposal

    @staticmethod
    def _account(entry, stats: VerifierStats) -> None:
        if not entry.closed:
            entry.kv_bytes = {"sliding": stats.kv_bytes.sliding, "full": stats.kv_bytes.full}
            entry.cache_bytes = sum(entry.kv_bytes.values())

    def _prefill(self, entry, session, ids, reuse=(), every: float = 0.0):
        """One compute job per prefill chunk (``session.prefill_steps``), so other sessions' steps run between
        a long prompt's chunks; a generator (``yield from`` it) sending Progress every ``every`` s."""
        steps = session.prefill_steps(ids, reuse)
        while (done := (yield from self._compute(every, self._prefill_chunk, entry, session, steps))) is None:
            pass
        return done

    def _prefill_chunk(self, entry, session, steps):
        try:
            next(steps)
            return None
        except StopIteration as finished:
            next_token, aux, _ = finished.value
        tensor = codec.to_proto(aux)  # evaluates; the model's own dtype
        stats = session.stats()
        self._account(entry, stats)
        return int(next_token), tensor, _stats_proto(stats)

    def _verify_batch(self, items: list) -> list:
        """The Verify requests that queued up together (``(entry, VerifyItem)`` each), decided as one batch
        (``session.decide``) and answered; one ``Verified`` (or exception) per item, each item's failure its own."""
        verdicts = decide([item for _, item in items])
        out = []
        for (entry, item), verdict in zip(items, verdicts):
            if isinstance(verdict, ConstraintError):  # the request's grammar met a budget: its own refusal
                verdict = _unfollowable(verdict)
            try:
                out.append(verdict if isinstance(verdict, Exception) else self._verified(entry, item.session, verdict))
            except Exception as exc:  # noqa: BLE001 - its own failure (its stream ended meanwhile), its result alone
                out.append(exc)
        return out

    def _verified(self, entry, session, verdict) -> pb.VerifierResponse.Verified:
        stats = session.stats()
        self._account(entry, stats)
        return pb.VerifierResponse.Verified(
            accepted=verdict.accepted,
            next_token=verdict.next_token,
            aux=codec.to_proto(verdict.aux),
            stats=_stats_proto(stats),
            logprobs=[wire_contract.logprobs_to_proto(lp) for lp in verdict.logprobs or ()],
        )


def _unfollowable(exc: ConstraintError):
    """A session's grammar that met llguidance's budgets as it ran: INVALID_ARGUMENT naming ``constraint`` (the
    request's, as at open; the orchestrator names its public field), never an INTERNAL error of the verifier."""
    return invalid(f"constraint: {exc}")


def server_spec(
    target_dir: str | Path,
    aux_layers: Sequence[int] = (),
    backend: str = "mlx",
    limits: SessionLimits = SessionLimits(),
    *,
    restore: bounds.RestoreSources | None = None,
    tls=None,
    token: str | None = None,
    **kwargs,
) -> ServerSpec:
    """A verifier server: ``limits`` its sessions' (``SessionLimits``), ``restore`` the f_theta sources
    sessions may name, ``token`` the bearer token callers must present (None: none), ``kwargs`` the
    loader's (``loader.local_verifier``)."""
    servicer = VerifierServicer(limits, restore)
    return servicer.spec(
        pb.DESCRIPTOR.services_by_name["VerifierService"],
        lambda: servicer.load(target_dir, aux_layers, backend, **kwargs),
        tls=tls,
        token=token,
        max_receive_bytes=PUBLIC_MAX_RECEIVE_BYTES,  # token ids only; answers may be big
    )
