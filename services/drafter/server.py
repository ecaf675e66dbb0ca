"""The drafter's gRPC servicer: one Session stream == one DFlash drafter session (either backend).

The stream IS the session: its context K/V cache is created at ``Open`` and freed when the stream ends, however it
ends. With ``--max-kv-bytes`` the bytes a Draft's context will hold are reserved before it extends it, so one client's
long context cannot take the drafter's memory. A Draft carries the newly committed positions' aux and the token opening
the block; the answer carries ``B - 1`` candidate ids (and, sampling, their proposals). A ``Predraft`` (deprecated)
only takes its new aux. After its first Draft, a session's Drafts may come in a ``DraftRound`` call. The drafter loads
only the target's embedding and LM head.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import grpc
import numpy as np

from kakeya.core.contract import SessionOptions, check_ranked
from kakeya.core.request import MAX_BLOCK_SIZE
from kakeya.drafter.session import DraftItem, LocalDrafterSession, draft_batch
from kakeya.runtime import bounds
from kakeya.runtime.admission import SessionEntry
from kakeya.runtime.lifecycle import RequestError, ServerSpec, check_token_ids, invalid, precondition, version
from kakeya.runtime.servicer import RoundSlot, RoundWire, SessionLimits, SessionServicer, serve_round
from kakeya.wire import codec
from kakeya.wire import convert as wire_contract
from kakeya.wire.kakeya.v1 import drafter_pb2 as pb
from kakeya.wire.kakeya.v1 import drafter_pb2_grpc

log = logging.getLogger("kakeya.drafter")

FLOAT_DTYPES = ("float32", "float16", "bfloat16")


@dataclass
class _Stream:
    """One Session stream's state between its messages (``SessionServicer._serve``)."""

    entry: SessionEntry
    session: LocalDrafterSession
    every: float  # seconds between Progress messages while a step waits (open.progress_ms)


class DrafterServicer(SessionServicer, drafter_pb2_grpc.DrafterServiceServicer):
    role = "drafter"
    kv_kinds = ("context",)
    steps = ("lookup", "draft", "predraft", "save")

    def __init__(self, limits: SessionLimits = SessionLimits()):
        # Draft requests of several streams that queue up while a batch runs go through ONE forward
        # (``session.draft_batch``); max_batch 1: each alone, in turn.
        super().__init__(limits)
        self.max_context = 0  # set by load(): --max-context, at most the model's max_position_embeddings
        self.drafter = None  # a LocalDrafter (either backend), set by load()
        self.backend = "mlx"
        self.names = ("", "")
        self.max_block_size = MAX_BLOCK_SIZE
        self.row_bytes = 0  # context K/V bytes per cache row of one layer, measured by load()

    def load(self, draft_dir: str | Path, target_dir: str | Path, backend: str = "mlx", **kwargs) -> str:
        """Load the drafter (``loader.local_drafter``) on the compute thread and warm it up."""
        from kakeya.drafter.loader import local_drafter

        def make(**shared):
            return local_drafter(str(draft_dir), str(target_dir), backend, **shared, **kwargs)

        return self.compute.run(self._setup, make, str(draft_dir), str(target_dir), backend)

    def _setup(self, make, draft_dir: str, target_dir: str, backend: str) -> str:
        self.drafter = make(prefixes=self.prefixes)  # its collaborators
        if self.drafter.backend != backend:
            raise ValueError(f"asked for a {backend} drafter, got a {self.drafter.backend} one")
        self.backend = backend
        self.names = (draft_dir, target_dir)
        model = self.drafter.model
        limit = int(model.config.max_position_embeddings or 131072)
        self.max_context = bounds.ContextLimits.of(limit, 0, self.max_context_flag).max_context
        self.aux_dtype = codec.DType.Value("DTYPE_" + str(model.dtype).rsplit(".", 1)[-1].upper())
        self.device = model.device_name
        self._inline_if_safe(backend)
        # Warm-up: every block size the loop drafts, the first context through the wire decoding path.
        aux = self._decode(codec.to_proto(np.zeros((3, model.config.aux_width), np.float32)))
        seconds = self.drafter.warm_up(aux=aux)
        self.row_bytes = self._measure_row_bytes()
        return (
            f"draft {draft_dir} + embedding/LM head of {target_dir} ({backend} on {self.device}, block"
            f" {self.drafter.block_size}, aux layers {list(self.drafter.target_layer_ids)}, {codec.dtype_name(self.aux_dtype)};"
            f" warm-up {seconds:.2f}s)"
        )

    def _measure_row_bytes(self) -> int:
        """Bytes of one context row of one layer, as this backend allocates them (one short session)."""
        probe = self.drafter.open_session()
        try:
            probe.draft(self.drafter.model.zeros_aux(1), 2, 1)
            return probe.cache.nbytes // probe.cache.rows_held
        finally:
            probe.close()

    def _context_bytes(self, session, new_rows: int) -> int:
        """Bytes ``session``'s context cache holds once ``new_rows`` more positions and a block are in
        (``rows_after``: host bookkeeping, nothing allocated)."""
        return session.cache.rows_after(new_rows) * self.row_bytes

    def _decode(self, tensor):
        """A wire Tensor as the backend's own array (the session casts it to the model's dtype)."""
        if self.backend == "torch":
            return codec.from_proto(tensor, like="torch", device=self.drafter.model.device)
        return codec.from_proto(tensor, like=self.backend)

    def info(self) -> pb.DrafterInfo:
        d = self.drafter
        cfg = d.model.config
        return pb.DrafterInfo(
            model_name=self.names[0],
            target_model=self.names[1],
            block_size=d.block_size,
            target_layer_ids=list(d.target_layer_ids),
            mask_token_id=d.mask_token_id,
            hidden_size=cfg.hidden_size,
            num_layers=cfg.num_hidden_layers,
            vocab_size=d.model.target.vocab_size,
            backend=self.backend,
            aux_dtype=self.aux_dtype,
            device=self.device,
            version=version(),
            max_block_size=self.max_block_size,
            **self.registry.info_counts(),
            max_context=self.max_context,
            prefix_cache_bytes=self.prefixes.budget if self.prefixes is not None else 0,
        )

    def _progress(self, waited_s: float) -> pb.DrafterResponse:
        return pb.DrafterResponse(progress=pb.DrafterResponse.Progress(waited_s=waited_s))

    def _open(self, entry, open_):
        try:
            sampling = wire_contract.sampling_from_proto(open_.sampling, "open.sampling")
            ranked = check_ranked(open_.ranked, "open.ranked")
        except ValueError as exc:
            raise invalid(str(exc)) from None
        if ranked and sampling is not None:
            raise invalid("open.ranked: the likeliest ids are for greedy sessions (open.sampling is set)")
        every = self._progress_every(open_)
        kw = {} if sampling is None else {"sampling": sampling}
        if ranked:
            kw["options"] = SessionOptions(ranked=ranked)
        session = entry.session = yield from self._compute(every, self.drafter.open_session, **kw)
        opened = pb.DrafterResponse.Opened(info=self.info(), session_id=entry.id)
        return _Stream(entry, session, every), pb.DrafterResponse(opened=opened)

    def _step_lookup(self, s: _Stream, lookup):
        if s.session.calls:
            raise precondition("lookup: only before the first draft")
        ids = check_token_ids(lookup.prompt_ids, self._vocab, "lookup.prompt_ids")
        positions = yield from self._compute(s.every, s.session.cached_prefixes, ids)
        return pb.DrafterResponse(found=pb.DrafterResponse.Found(positions=positions))

    def _step_save(self, s: _Stream, save):
        ids = check_token_ids(save.token_ids, self._vocab, "save.token_ids", allow_empty=True)
        for i, t in enumerate(save.unseen_aux):
            self._aux_shape(t, f"save.unseen_aux[{i}]")
        kept = yield from self._compute(s.every, self._save, s.entry, s.session, ids, list(save.unseen_aux))
        return pb.DrafterResponse(saved=pb.DrafterResponse.Saved(kept=kept))

    def _step_draft(self, s: _Stream, d):
        if d.resume_at:
            if s.session.calls:
                raise precondition("draft.resume_at: only on the first draft")
            try:
                yield from self._compute(s.every, s.session.resume, d.resume_at)
            except ValueError as exc:
                raise invalid(str(exc).replace("resume:", "draft.resume_at:", 1)) from None
        if s.entry.round is None:  # the first draft (the prompt's aux): on the stream only
            item = self._draft_item(s.entry, s.session, d)
            result = yield from self._compute_batch(s.every, "draft", item, self._draft_batch)
            s.entry.round = RoundSlot(partial(self._round_draft_item, s.entry, s.session))
        else:
            result = yield from self._round_step(s.entry, "draft", d, s.every, self._draft_batch)
        return pb.DrafterResponse(drafted=_drafted_proto(result))

    def _step_predraft(self, s: _Stream, p):
        """A deprecated Predraft (pre-drafting was removed): its aux is taken, the answer a miss (no block)."""
        slot = s.entry.round
        if slot is not None:
            slot.take("predraft")
        try:
            item = self._predraft_item(s.entry, s.session, p, self._vocab)
            _, stats = yield from self._compute_batch(s.every, "draft", item, self._draft_batch)
        finally:
            if slot is not None:
                slot.lock.release()
        return pb.DrafterResponse(predrafted=pb.DrafterResponse.Predrafted(stats=stats))

    def _close(self, s: _Stream):
        stats = yield from self._compute(s.every, self._stats, s.session)
        return pb.DrafterResponse(closed=pb.DrafterResponse.Closed(stats=stats))

    @property
    def _vocab(self) -> int:
        return self.drafter.model.target.vocab_size

    def DraftRound(self, request, context):
        # The streams' runner, its (draft, stats) results made protos after: a round's drafts and streams'
        # first drafts and pre-drafts share the kind "draft", so they must share its runner (``ComputeThread``).
        yield from serve_round(self, ROUND_WIRE, self._draft_batch, request, context)

    def _round_draft_item(self, entry, session, d) -> tuple:
        if d.resume_at:
            raise precondition("draft.resume_at: only on the first draft")
        return self._draft_item(entry, session, d)

    def _draft_item(self, entry, session, d) -> tuple:
        """A Draft step checked (errors name its fields) and made a ``_draft_batch`` item; on a stream or in a
        round call alike."""
        vocab = self.drafter.model.target.vocab_size
        shape = self._check_aux(d.new_aux, session, "draft.new_aux")
        if not 0 <= d.last_token < vocab:
            raise invalid(f"draft.last_token: {d.last_token} is outside the vocabulary [0, {vocab})")
        block = d.block_size or self.drafter.block_size
        if not 1 <= block <= self.max_block_size:
            raise invalid(f"draft.block_size must be 0 (default) or 1..{self.max_block_size}, got {d.block_size}")
        if self.registry.max_kv_bytes:  # a session that holds a context grows only if room is left now
            self.registry.reserve(entry, self._context_bytes(session, shape[0]), wait=session.cache.length == 0)
        return entry, DraftItem(session, d.new_aux, d.last_token, block)  # new_aux: decoded on the compute thread

    def _check_aux(self, tensor, session, field: str) -> tuple:
        """A Draft's or Predraft's new aux: a float [n, aux width] tensor within --max-context; its shape. Past it is
        OUT_OF_RANGE: the session outgrew this drafter (its client goes on without it), the drafter did not fail."""
        shape = self._aux_shape(tensor, field)
        if session.cache.length + shape[0] > self.max_context:
            raise RequestError(
                grpc.StatusCode.OUT_OF_RANGE,
                f"{field}: {shape[0]} rows on top of {session.cache.length} context positions exceed"
                f" this server's limit {self.max_context} (--max-context)",
            )
        if shape[0] == 0 and session.cache.length == 0:
            raise invalid(f"{field}: the first draft of a session needs the prompt's aux (n >= 1)")
        return shape

    def _aux_shape(self, tensor, field: str) -> tuple:
        """A wire aux tensor's shape, checked (``field`` names it): a floating type, ``[n, aux width]``."""
        try:
            name, shape, _ = codec.validate(tensor)
        except ValueError as exc:
            raise invalid(f"{field}: {exc}") from None
        if name not in FLOAT_DTYPES:
            raise invalid(
                f"{field}: dtype {name} is not a floating type (aux is sent in the target's dtype,"
                f" this drafter computes in {codec.dtype_name(self.aux_dtype)})"
            )
        width = self.drafter.model.config.aux_width
        if len(shape) != 2 or shape[1] != width:
            raise invalid(f"{field}: shape {list(shape)} must be [n, {width}] (n positions x aux width)")
        return shape

    def _predraft_item(self, entry, session, p, vocab: int) -> tuple:
        """A deprecated Predraft as a ``draft_batch`` item that only takes its new aux (a block of 1), so the
        older client's context has no gap when it drafts afresh."""
        if session.cache.length == 0:
            raise precondition("predraft: draft the session's first block first (it brings the prompt's aux)")
        if p.HasField("new_aux"):
            self._check_aux(p.new_aux, session, "predraft.new_aux")
        ids = list(p.block_ids)
        if not ids or not 0 <= ids[0] < vocab:
            raise invalid(f"predraft.block_ids: its first id must be in the vocabulary [0, {vocab})")
        return entry, DraftItem(session, p.new_aux if p.HasField("new_aux") else None, ids[0], 1)

    def _save(self, entry, session, ids, tensors) -> bool:
        kept = session.save(ids, [self._decode(t) for t in tensors])
        if not entry.closed:
            entry.cache_bytes = session.cache.nbytes
        return kept

    @staticmethod
    def _stats(session) -> pb.DrafterStats:
        return pb.DrafterStats(context_positions=session.cache.length, kv_bytes=session.cache.nbytes)

    def _draft_batch(self, items: list) -> list:
        """The Draft requests that queued up together (``(entry, DraftItem)`` each, its aux still the wire's), as
        one batch; one result (or exception) per item."""
        decoded = []
        for _, item in items:
            try:
                decoded.append(item._replace(new_aux=None if item.new_aux is None else self._decode(item.new_aux)))
            except Exception as exc:  # noqa: BLE001 -- this stream's own failure
                decoded.append(exc)
        drafted = iter(draft_batch([w for w in decoded if not isinstance(w, Exception)]))
        results = []
        for (entry, item), w in zip(items, decoded):
            draft = w if isinstance(w, Exception) else next(drafted)
            if isinstance(draft, Exception):
                results.append(draft)
                continue
            stats = self._stats(item.session)
            if not entry.closed:
                entry.cache_bytes = stats.kv_bytes
            results.append((draft, stats))
        return results


def _drafted_proto(result) -> pb.DrafterResponse.Drafted:
    """A ``_draft_batch`` result (draft, stats) as its wire answer."""
    draft, stats = result
    drafted = pb.DrafterResponse.Drafted(token_ids=draft.tokens, stats=stats)
    if draft.proposal is not None:
        drafted.proposal.CopyFrom(wire_contract.proposal_to_proto(draft.proposal))
    if draft.ranked is not None:
        drafted.ranked_ids.extend(t for row in draft.ranked for t in row)
    return drafted


ROUND_WIRE = RoundWire(pb.DraftRoundResponse, "draft", "drafted", pb.DrafterResponse.Progress, _drafted_proto)


def server_spec(
    draft_dir: str | Path,
    target_dir: str | Path,
    backend: str = "mlx",
    limits: SessionLimits = SessionLimits(),
    *,
    tls=None,
    token: str | None = None,
    **kwargs,
) -> ServerSpec:
    """A drafter server: ``limits`` its sessions' (``SessionLimits``), ``token`` the bearer token callers
    must present (None: none), ``kwargs`` the loader's (``loader.local_drafter``)."""
    servicer = DrafterServicer(limits)
    return servicer.spec(
        pb.DESCRIPTOR.services_by_name["DrafterService"],
        lambda: servicer.load(draft_dir, target_dir, backend, **kwargs),
        tls=tls,
        token=token,
    )
