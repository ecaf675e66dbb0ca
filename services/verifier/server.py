"""The verifier's gRPC servicer: one Session stream == one :class:`VerifierSession`.

The stream IS the session: the KV cache is created at ``Open`` and freed when
the stream ends, however it ends (``Close``, half-close, cancellation,
deadline, broken connection) -- through ``context.add_callback`` and the
handler's ``finally``, both idempotent. Per block only token ids go down and
the target's choices plus the kept positions' aux come back, the aux encoded
by ``services/wire/codec.py`` in the model's own dtype; never logits. A
sampling session (``Open.sampling``) also takes the drafter's compact proposal
with each Verify and samples with its own seeded stream.

All model work runs on the process's single compute thread
(``services.serving.ComputeThread``); this module translates messages and
validates them, with errors that name the offending field.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Iterator, Sequence

import grpc

from services.serving import (
    ComputeThread,
    ServerSpec,
    session_stream,
    SessionRegistry,
    check_policy,
    check_token_ids,
    invalid,
    policy_from_request,
    precondition,
    version,
)
from services.metrics import ServerMetrics
from services.wire import codec
from services.wire import contract as wire_contract
from services.wire.kakeya.v1 import verifier_pb2 as pb, verifier_pb2_grpc


log = logging.getLogger("kakeya.verifier")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["VerifierService"].full_name


def _stats_proto(stats: dict, pending: int = 0) -> pb.SessionStats:
    kv = stats.get("kv_bytes", {})
    return pb.SessionStats(
        kv_bytes_sliding=int(kv.get("sliding", 0)),
        kv_bytes_full=int(kv.get("full", 0)),
        positions=int(stats.get("positions", 0)),
        pending=pending,
        bounded=bool(stats.get("bounded", False)),
    )


class VerifierServicer(verifier_pb2_grpc.VerifierServiceServicer):
    """Serves one loaded target (``LocalVerifier``) to many concurrent session streams."""

    def __init__(self, max_sessions: int = 0):
        self.compute = ComputeThread("verifier")
        self.registry = SessionRegistry(max_sessions)
        self.metrics = ServerMetrics("verifier")
        self.metrics.track_sessions(lambda: self.registry.live, lambda: self.registry.total)
        self.metrics.track_kv_bytes(lambda: {"sliding": 0, "full": 0} | self.registry.bytes_by_kind("full"))
        self.verifier = None  # LocalVerifier, set by load()
        self.ready = False
        self.aux_dtype = 0
        self.device = ""

    # -- loading -----------------------------------------------------------------------

    def load(self, target_dir: str | Path, aux_layers: Sequence[int] = (), backend: str = "mlx", **kwargs) -> str:
        """Load the target (``loader.local_verifier``) on the compute thread and warm it up."""
        from .loader import local_verifier

        def make():
            return local_verifier(str(target_dir), list(aux_layers), backend, **kwargs)

        return self.compute.run(self._setup, make, target_dir, tuple(aux_layers))

    def _setup(self, make, target_dir, aux_layers) -> str:
        self.verifier = make()
        backend = self.verifier.info.backend
        info = self.verifier.info
        warm_layers = aux_layers or (info.num_layers - 1,)
        session = self._new_session(warm_layers, self.verifier.policy)
        prompt = [i % info.vocab_size for i in range(1, 6)]
        _, aux = session.prefill(prompt)
        session.verify(prompt[:3])
        session.commit(1)
        session.close()
        self.aux_dtype = codec.to_proto(aux[:1]).dtype
        self.device = _device_name(self.verifier.target)
        return (
            f"target {target_dir} ({backend} on {self.device}, {info.num_layers} layers, vocab {info.vocab_size},"
            f" aux {codec.dtype_name(self.aux_dtype)})"
        )

    def _new_session(self, aux_layers, policy, sampling=None):
        from .session import VerifierSession

        return VerifierSession(self.verifier.target, aux_layers, policy, sampling)

    # -- RPCs ----------------------------------------------------------------------------

    def GetInfo(self, request, context):
        if not self.ready:
            context.abort(grpc.StatusCode.UNAVAILABLE, "verifier is loading its model")
        return self.info()

    def info(self) -> pb.VerifierInfo:
        i = self.verifier.info
        return wire_contract.verifier_info_to_proto(
            i,
            self.verifier.aux_layers,
            aux_dtype=self.aux_dtype,
            device=self.device,
            version=version(),
            default_cache_policy=wire_contract.policy_to_proto(self.verifier.policy.resolve(i.sliding_window)),
            max_block_size=self.verifier.policy.slack,
            live_sessions=self.registry.live,
            max_sessions=self.registry.max_sessions,
            live_kv_bytes=self.registry.live_bytes,
            total_sessions=self.registry.total,
        )

    def Session(self, request_iterator, context) -> Iterator[pb.VerifierResponse]:
        yield from session_stream("verifier", self.ready, self.registry, self._serve, request_iterator, context)

    def _serve(self, entry, requests) -> Iterator[pb.VerifierResponse]:
        vocab = self.verifier.info.vocab_size
        n_layers = self.verifier.info.num_layers
        session = None
        prefilled = False
        pending = 0
        policy = None
        for req in requests:
            kind = req.WhichOneof("request")
            t0 = time.perf_counter()
            if session is None:
                if kind != "open":
                    raise precondition(f"the first message of a session must be open, got {kind or 'an empty request'}")
                policy = policy_from_request(req.open.cache_policy, self.verifier.policy, "open.cache_policy")
                layers = list(req.open.target_layer_ids) or list(self.verifier.aux_layers)
                if not layers:
                    raise invalid("open.target_layer_ids: this verifier has no default aux layers: send them")
                bad = [i for i in layers if not 0 <= i < n_layers]
                if bad or len(set(layers)) != len(layers):
                    raise invalid(
                        f"open.target_layer_ids: {layers} must be distinct layers in [0, {n_layers})"
                    )
                check_policy(policy, self.verifier.info.sliding_window, "open.cache_policy")
                try:
                    sampling = wire_contract.sampling_from_proto(req.open.sampling, "open.sampling")
                except ValueError as exc:
                    raise invalid(str(exc)) from None
                session = entry.session = self.compute.run(self._new_session, layers, policy, sampling)
                resolved = session.policy
                resp = pb.VerifierResponse(
                    opened=pb.VerifierResponse.Opened(
                        info=self.info(), cache_policy=wire_contract.policy_to_proto(resolved), session_id=entry.id
                    )
                )
            elif kind == "prefill":
                if prefilled:
                    raise precondition("prefill: already prefilled (chunked prefill is not supported yet)")
                ids = check_token_ids(req.prefill.token_ids, vocab, "prefill.token_ids")
                next_token, aux, stats = self.compute.run(self._prefill, entry, session, ids)
                prefilled = True
                resp = pb.VerifierResponse(prefilled=pb.VerifierResponse.Prefilled(next_token=next_token, aux=aux, stats=stats))
            elif kind == "verify":
                if not prefilled:
                    raise precondition("verify: prefill the prompt first")
                if pending:
                    raise precondition("verify: commit the previous block first")
                ids = check_token_ids(req.verify.block_ids, vocab, "verify.block_ids")
                if len(ids) > session.policy.slack:
                    raise invalid(
                        f"verify.block_ids: {len(ids)} positions exceed this session's max block size {session.policy.slack}"
                    )
                proposal = self._proposal(session, req.verify, ids, vocab)
                choices = self.compute.run(session.verify, ids, proposal)
                pending = len(ids)
                resp = pb.VerifierResponse(verified=pb.VerifierResponse.Verified(choices=choices))
            elif kind == "commit":
                if not pending:
                    raise precondition("commit: no verified block is pending")
                n_keep = req.commit.n_keep
                if not 0 <= n_keep <= pending:
                    raise invalid(f"commit.n_keep must be in 0..{pending}, got {n_keep}")
                aux, stats = self.compute.run(self._commit, entry, session, n_keep)
                pending = 0
                resp = pb.VerifierResponse(committed=pb.VerifierResponse.Committed(aux=aux, stats=stats))
            elif kind == "close":
                stats = _stats_proto(self.compute.run(session.stats), pending)
                yield pb.VerifierResponse(closed=pb.VerifierResponse.Closed(stats=stats), elapsed_s=time.perf_counter() - t0)
                return
            elif kind == "open":
                raise precondition("open: the session is already open")
            else:
                raise invalid("request: no step set (open, prefill, verify, commit or close)")
            resp.elapsed_s = time.perf_counter() - t0
            yield resp

    @staticmethod
    def _proposal(session, verify, ids, vocab):
        """A sampling session's proposal for ``ids[1:]``, checked here so a bad one is INVALID_ARGUMENT."""
        if session.sampling is None or len(ids) == 1:
            return None
        if not verify.HasField("proposal"):
            raise invalid("verify.proposal: a sampling session needs the drafter's proposal for its candidates")
        try:
            proposal = wire_contract.proposal_from_proto(verify.proposal, len(ids) - 1, vocab, "verify.proposal")
            session._check_proposal(ids[1:], proposal)
        except ValueError as exc:
            raise invalid(str(exc).replace("proposal:", "verify.proposal:", 1)) from None
        return proposal

    # -- compute-thread steps --------------------------------------------------------------

    @staticmethod
    def _account(entry, stats: dict) -> None:
        kv = stats.get("kv_bytes", {})
        if not entry.closed:
            entry.kv_bytes = {"sliding": int(kv.get("sliding", 0)), "full": int(kv.get("full", 0))}
            entry.cache_bytes = sum(entry.kv_bytes.values())

    def _prefill(self, entry, session, ids):
        next_token, aux = session.prefill(ids)
        tensor = codec.to_proto(aux)  # evaluates; the model's own dtype
        stats = session.stats()
        self._account(entry, stats)
        return int(next_token), tensor, _stats_proto(stats)

    def _commit(self, entry, session, n_keep):
        aux = session.commit(n_keep)
        tensor = codec.to_proto(aux)
        stats = session.stats()
        self._account(entry, stats)
        return tensor, _stats_proto(stats)


def _device_name(target) -> str:
    if getattr(target, "device", None) is not None:
        return str(target.device)
    if target.backend == "mlx":
        import mlx.core as mx

        return str(mx.default_device())
    return target.backend


def server_spec(
    target_dir: str | Path, aux_layers: Sequence[int] = (), backend: str = "mlx", max_sessions: int = 0, **kwargs
) -> ServerSpec:
    servicer = VerifierServicer(max_sessions)

    def set_ready(flag: bool) -> None:
        servicer.ready = flag

    return ServerSpec(
        name="verifier",
        service_names=[SERVICE_NAME],
        add_to_server=lambda server: verifier_pb2_grpc.add_VerifierServiceServicer_to_server(servicer, server),
        load=lambda: servicer.load(target_dir, aux_layers, backend, **kwargs),
        set_ready=set_ready,
        max_workers=(max_sessions + 16) if max_sessions else 128,
        metrics=servicer.metrics,
    )
