"""One generation's verifier state (prefill, verify a block in one forward, commit/trim), and several sessions' blocks
verified in one forward.

Backend-neutral (``backend.py``'s protocol). A session owns its caches and its ring layout (``layout.py``), the one
position counter: each forward gets an immutable plan from it, a trim only moves it back. One host sync per block.

:meth:`LocalVerifierSession.decide` is :meth:`~LocalVerifierSession.verify` then :meth:`~LocalVerifierSession.commit`.
:func:`decide_batch` / :func:`verify_batch` run many sessions' blocks as ONE forward, each session getting exactly what
its own ``verify`` returns or raises: rows meet only in row-wise operations; attention, caches, positions, masks, noise
and random streams stay their own.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Generator, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from kakeya.core import noise
from kakeya.core import sampling as lossless
from kakeya.core.constraints import Grammar
from kakeya.core.contract import (
    VERIFIER_STREAM,
    Draft,
    KVBytes,
    Proposal,
    TokenLogprobs,
    Verdict,
    VerifierStats,
    accept,
    session_rng,
)
from kakeya.core.prefix import PrefixCache
from kakeya.core.request import COUPLED, CachePolicy, SamplingParams
from kakeya.verifier import snapshot
from kakeya.verifier.backend import Forward, Segment, Target, cat, greedy_rows
from kakeya.verifier.layout import RestoreView, RingLayout, restore_mask

PREFILL_CHUNK = 512  # bounds prefill attention memory, like mlx-lm's prefill_step_size
PROPOSAL_SUM_TOLERANCE = 1e-3  # a proposal row's probabilities sum to 1 within this (float32 rounding: ~1e-6)


def check_proposal(candidates: Sequence[int], proposal: Proposal | None, rule: str) -> None:
    """The rejection rule's test is exact only against the distribution each candidate was drawn from,
    so a proposal must be one: per row, distinct ids and finite probabilities >= 0 summing to 1. The
    coupled rule takes candidates alone (a proposal beside them means the drafter ran another rule)."""
    if rule == COUPLED:
        if proposal is not None:
            raise ValueError("proposal: a coupled-rule session takes candidates only, no proposal")
        return
    if not candidates:
        return
    if proposal is None:
        raise ValueError("proposal: a sampling session needs the drafter's proposal for its candidates")
    if len(proposal) != len(candidates):
        raise ValueError(f"proposal: {len(proposal)} rows for {len(candidates)} candidates")
    ids, probs = proposal.ids, proposal.probs
    if not np.isfinite(probs).all() or (probs < 0).any():
        raise ValueError("proposal.probs: probabilities must be finite and >= 0")
    sums = probs.sum(-1, dtype=np.float64)
    if (np.abs(sums - 1.0) > PROPOSAL_SUM_TOLERANCE).any():
        row = int(np.argmax(np.abs(sums - 1.0)))
        raise ValueError(
            f"proposal.probs: row {row} sums to {sums[row]:.6g}; each row must sum to 1 (within {PROPOSAL_SUM_TOLERANCE:g})"
        )
    ordered = np.sort(ids, axis=-1)
    if (ordered[:, 1:] == ordered[:, :-1]).any():
        raise ValueError("proposal.ids: an id repeats within a row; each row lists distinct tokens")
    for i, c in enumerate(candidates):
        if not (ids[i] == c).any():
            raise ValueError(f"proposal: candidate {i + 1} ({c}) is outside its proposal's support")


class LocalVerifierSession:
    """``prefixes``: the prefix cache :meth:`resume` reads and :meth:`save` fills (None: none); ``logprobs``: k,
    each committed token's log-probability and top k from the forward that decided it (None: none);
    ``grammar``: a constrained request's state (None: none), every choice then from the logits it allows."""

    server_s = None  # in this process a step's whole time is the backend's (the contract's attribute)

    def __init__(
        self,
        target: Target,
        aux_layers: Sequence[int],
        policy: CachePolicy,
        sampling: SamplingParams | None = None,
        prefixes: PrefixCache | None = None,
        logprobs: int | None = None,
        grammar: Grammar | None = None,
    ):
        self.target = target
        self.prefixes = prefixes
        self.logprobs = logprobs
        self.first_logprobs: TokenLogprobs | None = None
        self.grammar = grammar
        # Seeded by the request: the coupled rule's noise from the seed's keys and the positions, the
        # rejection rule's uniforms from this session's host stream.
        self.sampling = None if sampling is None or sampling.check().greedy else sampling
        if self.sampling is not None:
            if sampling.seed is None:
                raise ValueError("seed: a sampling session needs the request's seed (the engine draws one)")
            if sampling.rule == COUPLED:
                self.noise_keys = noise.session_keys(sampling.seed)
            else:
                self.rng = session_rng(sampling.seed, VERIFIER_STREAM)
        self.aux_layers = tuple(aux_layers)
        self.policy = policy.resolve(target.args.sliding_window)
        self.layout = RingLayout(self.policy.sink, self.policy.window, self.policy.slack)
        self.cache = target.make_cache(self.layout, self.policy)
        self.restorer = self.latents = self.latent_layout = None
        if self.policy.restore:
            self._open_restore(target)
        # (block length, aux of the block, its logits rows when logprobs are asked) between verify and commit
        self._pending = None
        self.prompt: tuple[int, ...] = ()
        self.cached_tokens = 0  # prompt positions the prefill resumed from a snapshot instead of computing
        self.closed = False

    @property
    def offset(self) -> int:
        return self.layout.offset

    def _open_restore(self, target: Target) -> None:
        """f_theta restoration: a latent ring beside the K/V ring (same plan/applied/trim semantics) of the last
        ``Wn - 1 + slack`` positions' codes (``Wn``: the model's window): every position a query may see restored."""
        if not target.restores:
            raise ValueError(
                f"cache policy restore: f_theta restoration is not implemented on the {target.backend} backend"
            )
        self.restorer = target.restorer(self.policy.restore)
        missing = [i for i in self.restorer.config.target_layer_ids if i not in self.aux_layers]
        if missing:
            raise ValueError(
                f"cache policy restore: f_theta reads aux of layers {missing}, which this session does not capture"
            )
        self.latent_layout = RingLayout(0, target.args.sliding_window, self.policy.slack)
        self.latents = target.make_latent_ring(self.latent_layout, self.restorer)

    @property
    def max_forward(self) -> int:
        """Most positions one forward may hold (a restored position must precede its forward)."""
        return self.policy.window if self.restorer is not None else PREFILL_CHUNK

    def forward_plan(self, ids: Sequence[int]) -> Segment:
        """This session's next forward of ``ids`` for ``target.forward`` (then :meth:`forward_done`): the ring
        planned by the layout and, with f_theta, the restored positions each query sees."""
        plan = self.layout.plan(len(ids))
        if self.restorer is not None and plan.start > 0:  # from the second forward on: the whole latent ring
            p, positions = self.policy, self.latent_layout.positions
            mask = restore_mask(positions, plan.start, len(ids), p.sink, p.window, self.target.args.sliding_window)
            plan = replace(plan, restore=RestoreView(self.restorer, self.latents.data, positions, mask))
        return Segment(ids, self.cache, self.aux_layers, plan)

    def forward_done(self, segment: Segment, out: Forward) -> None:
        """``segment`` ran: the layout moves on (with f_theta, the forward's latent codes join the latent ring)."""
        self.layout.applied()
        if self.latents is not None:
            self.latents.write(
                self.latent_layout.plan(len(segment.ids)),
                self.target.encode_latents(self.restorer, out.aux, self.aux_layers),
            )
            self.latent_layout.applied()

    def _forward(self, ids: Sequence[int]) -> Forward:
        segment = self.forward_plan(ids)
        (out,) = self.target.forward([segment])
        self.forward_done(segment, out)
        return out

    def prefill(self, prompt_ids: Sequence[int]):
        """Run the prompt; ``(first token, aux of every prompt position)``."""
        return run_steps(self.prefill_steps(prompt_ids))[:2]

    def resume(self, prompt_ids: Sequence[int], reuse: Collection[int] | None = None):
        """:meth:`prefill_steps` run whole, its prefix-cache lookup counted as a hit or a miss."""
        return run_steps(self._prefill_steps(prompt_ids, reuse, count=True))

    def prefill_steps(
        self, prompt_ids: Sequence[int], reuse: Collection[int] | None = ()
    ) -> Generator[int, None, tuple]:
        """The prefill one chunk per ``next()`` (each its own compute job, so other sessions' steps run between
        a long prompt's chunks), yielding the positions done; returns ``(first token, aux of the positions it
        ran, the prefix length resumed)``. ``reuse``: the prefix lengths it may resume from (None: any; the
        default, none: a cold prefill, no prefix-cache lookup, counted as neither a hit nor a miss)."""
        return (yield from self._prefill_steps(prompt_ids, reuse, count=reuse != ()))

    def _prefill_steps(self, prompt_ids, reuse, count: bool) -> Generator[int, None, tuple]:
        self._check_open()
        if self.offset != 0:
            raise RuntimeError("prefill must be the first call of a session")
        if not prompt_ids:
            raise ValueError("prompt_ids is empty")
        self.prompt = tuple(prompt_ids)
        self.cached_tokens = snapshot.resume(self, reuse, count) if self.prefixes is not None else 0
        chunks = []
        step = min(PREFILL_CHUNK, self.max_forward)
        for start in range(self.cached_tokens, len(prompt_ids), step):
            if start > self.cached_tokens:
                self._check_open()  # a stream that ended between chunks closed the session
            out = self._forward(prompt_ids[start : start + step])
            chunks.append(out.aux)
            self.target.materialize(out, self.cache)  # never one huge graph for a long prompt
            if self.latents is not None:
                self.latents.materialize()
            if start + step < len(prompt_ids):
                yield start + step
        last = out.hidden[:, -1:]
        if self.sampling is None:
            first = self.target.greedy(last)[0] if self.grammar is None else self._argmax(last, ())[0]
        elif self.sampling.rule == COUPLED:  # the first token sits at position len(prompt)
            first = self._coupled(self._logits(last, ()), self.offset)[0]
        else:
            _, u = lossless.verify_uniforms(self.rng, 1)
            first = self.target.sampler.sample_next(self._logits(last, ()), self.sampling, float(u[0]))
        if self.logprobs is not None:  # the prefill's last row decided the first token (its raw distribution)
            (self.first_logprobs,) = self.target.sampler.logprobs(self.target.logits(last)[0], [first], self.logprobs)
        if self.grammar is not None:
            self.grammar.advance([first])
        return first, cat(self.target, chunks), self.cached_tokens

    def decide(self, last_token: int, draft: Draft) -> Verdict:
        """The contract's step: :meth:`verify` ``[last_token, *draft.tokens]``, then :func:`verdict`."""
        block_ids = [last_token, *draft.tokens]
        return verdict(self, block_ids, self.verify(block_ids, draft.proposal))

    def save(self, ids: Sequence[int]) -> bool:
        """Keep the state after exactly ``ids`` (the prompt, then the committed tokens) in the prefix cache
        (:func:`snapshot.save`; the generation must be over); False when nothing was kept."""
        return snapshot.save(self, ids)

    def verify(self, block_ids: Sequence[int], proposal: Proposal | None = None) -> list[int]:
        """Run ``block_ids`` in one forward; the choice after each position (see the contract's
        ``decide``; -1 after a sampling verify's first rejection). The block stays pending until :meth:`commit`."""
        self.check_block(block_ids, proposal)
        if self.target.static_verify and self.restorer is None and self.sampling is None and self.grammar is None:
            return self._verify_static(block_ids)
        return self.choose(block_ids, proposal, self._forward(block_ids))

    def _verify_static(self, block_ids: Sequence[int]) -> list[int]:
        """A greedy block through the target's static-shape step, at the (bucket) length it runs at:
        the padding is planned and written like draft tokens, then trimmed like rejected ones."""
        L = len(block_ids)
        n = self.target.static_length(L, self.layout.slack)
        choices, aux = self.target.verify_static(block_ids, self.cache, self.aux_layers, self.layout.plan(n))
        self.layout.applied()
        if n > L:
            self.layout.trim(n - L)
        # the rows the step's argmax read (``verify_static`` keeps them): no second LM head for logprobs
        self._pending = (L, aux, self.cache.last_logits if self.logprobs is not None else None)
        return choices

    def check_block(self, block_ids: Sequence[int], proposal: Proposal | None = None) -> None:
        """What :meth:`verify` refuses (ValueError / RuntimeError) before it touches the caches."""
        self._check_open()
        if self._pending is not None:
            raise RuntimeError("commit the previous block before verifying another")
        limit = min(self.policy.slack, self.max_forward)
        if not 1 <= len(block_ids) <= limit:
            why = " (f_theta restoration: at most the window)" if limit < self.policy.slack else ""
            raise ValueError(f"block length must be 1..{limit}{why}, got {len(block_ids)}")
        if self.sampling is not None:
            check_proposal(block_ids[1:], proposal, self.sampling.rule)

    def choose(
        self, block_ids: Sequence[int], proposal: Proposal | None, out, greedy: list[int] | None = None
    ) -> list[int]:
        """After the block's forward ``out``: the pending block for :meth:`commit`, and the choices
        (greedy: the argmax rows, ``greedy`` when a batched caller already took them; coupled: the
        noisy argmax rows; rejection: the acceptance test on this session's logits with its own uniforms)."""
        # the block's logits rows, kept for pending_logprobs when asked (the forward's own rows: no second forward)
        rows = self.target.logits(out.hidden)[0] if self.logprobs is not None else None
        self._pending = (len(block_ids), out.aux, rows)
        candidates = list(block_ids[1:])
        if self.sampling is None:
            if self.grammar is not None:
                return self._argmax(out.hidden, candidates)
            return greedy if greedy is not None else self.target.greedy(out.hidden)
        logits = self._logits(out.hidden, candidates)
        if self.sampling.rule == COUPLED:  # the block opened at offset - L; row i predicts the position after it
            return self._coupled(logits, self.offset - len(block_ids) + 1)
        u_acc, u_samp = lossless.verify_uniforms(self.rng, len(block_ids))
        accepted, samples = self.target.sampler.verify_rows(
            logits, candidates, proposal, self.sampling, u_acc[: len(candidates)], u_samp
        )
        return lossless.assemble(candidates, accepted, samples)

    def _logits(self, hidden, candidates: Sequence[int]):
        """The target's logits [L, V] after each row of ``hidden`` [1, L, H]; with a grammar, restricted to the
        tokens it allows after the committed prefix and the candidates before each row (``Grammar.bitmask``)."""
        logits = self.target.logits(hidden)[0]
        if self.grammar is None:
            return logits
        return self.target.sampler.restrict(logits, self.grammar.bitmask(candidates))

    def _argmax(self, hidden, candidates: Sequence[int]) -> list[int]:
        return self.target.sampler.argmax_rows(self._logits(hidden, candidates))

    def _coupled(self, logits, first_position: int) -> list[int]:  # row i predicts ``first_position + i``
        return self.target.sampler.coupled_rows(logits, self.sampling, self.noise_keys, first_position)

    def pending_logprobs(self, tokens: Sequence[int]) -> tuple[TokenLogprobs, ...] | None:
        """The pending block's logprobs of ``tokens``, the ones it commits (row i chose ``tokens[i]``): top-k on the
        device over those rows only (None: the session was not asked for logprobs)."""
        if self.logprobs is None:
            return None
        return tuple(self.target.sampler.logprobs(self._pending[2], tokens, self.logprobs))

    def commit(self, n_keep: int):
        self._check_open()
        if self._pending is None:
            raise RuntimeError("nothing to commit: verify a block first")
        n, aux, _ = self._pending
        if not 0 <= n_keep <= n:
            raise ValueError(f"n_keep must be 0..{n}, got {n_keep}")
        self.trim(n - n_keep)
        self._pending = None
        return aux[:n_keep]

    def stats(self) -> VerifierStats:
        kv = {"sliding": 0, "full": 0} if self.closed else self.cache.kv_bytes()
        restored = self.latents.nbytes if self.latents is not None else 0  # f_theta latent ring (constant)
        return VerifierStats(
            cache_policy=self.policy.label,
            bounded=self.policy.kind != "native",
            positions=self.offset,
            kv_bytes=KVBytes(kv["sliding"], kv["full"], restored),
        )

    def trim(self, n: int) -> None:
        """Forget the newest ``n`` positions (the latent ring's too, with f_theta)."""
        if n:
            self.layout.trim(n)
            if self.latent_layout is not None:
                self.latent_layout.trim(n)

    def abort(self) -> None:
        """Nothing to end from another thread in this process: a cancelled run stops calling the session and
        closes it on the thread its steps run on (the cache must not be freed under a running step)."""

    def close(self) -> None:
        if not self.closed:
            self.target.release_cache(self.cache)
        self.cache, self._pending, self.closed, self.latents = None, None, True, None

    def _check_open(self):
        if self.closed:
            raise RuntimeError("session is closed")


def run_steps(steps: Generator):
    """A step generator run to its end: its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def verdict(session: LocalVerifierSession, block_ids: Sequence[int], choices: Sequence[int]) -> Verdict:
    """A verified block (its ``choices``, pending in ``session``) decided by THE acceptance rule
    (``core.contract.accept``): its accepted run kept, the rest trimmed exactly."""
    accepted, next_token = accept(block_ids[1:], choices)
    logprobs = session.pending_logprobs([*block_ids[1 : accepted + 1], next_token])
    aux = session.commit(accepted + 1)
    if session.grammar is not None:  # what the block committed: the accepted candidates and the next token
        session.grammar.advance([*block_ids[1 : accepted + 1], next_token])
    return Verdict(accepted, next_token, aux, logprobs)


@dataclass(frozen=True, slots=True)
class VerifyItem:
    """One session's block: its newest committed token then the draft's candidates, and the ``proposal``
    they were drawn from (a rejection-rule session's, else None)."""

    session: LocalVerifierSession
    block_ids: Sequence[int]
    proposal: Proposal | None = None


@dataclass
class BatchCounts:
    """Blocks :func:`verify_batch` ran, by how (process-wide, since start; a server exports them)."""

    forwards: int = 0  # batched forwards run
    batched: int = 0  # blocks verified in them
    alone_policy: int = 0  # blocks verified alone: their session cannot join a batched forward (:func:`batchable`)
    alone_few: int = 0  # blocks verified alone: fewer than ``min_batch`` of their group were queued


_COUNTS, _COUNTS_LOCK = BatchCounts(), threading.Lock()


def counts() -> dict[str, int]:
    with _COUNTS_LOCK:
        return asdict(_COUNTS)


def _count(**add: int) -> None:
    with _COUNTS_LOCK:
        for k, v in add.items():
            setattr(_COUNTS, k, getattr(_COUNTS, k) + v)


def verify_batch(items: Sequence[VerifyItem]) -> list[Any]:
    """One result per item, in order: its choices, or the exception its ``verify`` would raise. The good
    items of one target and one ``cache.batch_key`` run as one forward; a lone item, fewer than
    ``target.min_batch`` of a group, or one :func:`batchable` refuses runs ``session.verify``."""
    results: list[Any] = [None] * len(items)
    groups: dict[tuple, list[int]] = {}
    alone: list[int] = []
    seen: set[int] = set()
    for i, (session, block_ids, proposal) in enumerate((it.session, it.block_ids, it.proposal) for it in items):
        try:
            session.check_block(block_ids, proposal)
            if id(session) in seen:  # a session has one step in flight; never two in one forward
                raise RuntimeError("commit the previous block before verifying another")
        except (ValueError, RuntimeError) as exc:
            results[i] = exc
            continue
        seen.add(id(session))
        if batchable(session):
            groups.setdefault((id(session.target), session.cache.batch_key), []).append(i)
        else:
            alone.append(i)
    _count(alone_policy=len(alone))
    for group in groups.values():
        if len(group) < items[group[0]].session.target.min_batch:
            alone += group
            _count(alone_few=len(group))
            continue
        _count(forwards=1, batched=len(group))
        try:
            for i, r in zip(group, _together([items[i] for i in group])):
                results[i] = r
        except Exception as exc:  # noqa: BLE001 - the forward itself failed: every session in it hears why
            for i in group:
                results[i] = exc
    for i in alone:
        try:
            results[i] = items[i].session.verify(items[i].block_ids, items[i].proposal)
        except Exception as exc:  # noqa: BLE001 - its own failure, its result alone
            results[i] = exc
    return results


def decide_batch(items: Sequence[tuple[LocalVerifierSession, int, Draft]]) -> list[Verdict | Exception]:
    """The contract's ``Verifier.decide_batch``: :meth:`LocalVerifierSession.decide` of each
    ``(session, last_token, draft)``, their blocks verified together (:func:`decide`)."""
    return decide([VerifyItem(s, [last, *d.tokens], d.proposal) for s, last, d in items])


def decide(items: Sequence[VerifyItem]) -> list[Verdict | Exception]:
    """One :func:`verify_batch`, then each verified block kept as the acceptance rule keeps it."""
    out: list[Verdict | Exception] = []
    for item, c in zip(items, verify_batch(items)):
        try:
            out.append(c if isinstance(c, Exception) else verdict(item.session, item.block_ids, c))
        except Exception as exc:  # noqa: BLE001 - its own failure, its result alone
            out.append(exc)
    return out


def batchable(session: LocalVerifierSession) -> bool:
    """Whether ``session`` may join a batched forward: not with f_theta restoration (MLX: it writes a latent
    ring from each forward's aux and attends over restored K/V), nor with caches the backend's batched
    forward cannot take (MLX: quantized full-attention caches)."""
    return session.restorer is None and session.cache.batchable


def _together(items: Sequence[VerifyItem]) -> list[list[int]]:
    target = items[0].session.target
    segments = [it.session.forward_plan(it.block_ids) for it in items]
    wanted = [it.session.sampling is None and it.session.grammar is None for it in items]  # the argmax serves these
    if target.static_verify:  # the batched step takes every greedy row's choice itself
        outs, greedy = target.verify_segments(segments, wanted)
    else:
        outs = target.forward(segments)
        greedy = greedy_rows(target, outs, wanted)
    for it, segment, out in zip(items, segments, outs):
        it.session.forward_done(segment, out)
    out = []
    for it, o, g in zip(items, outs, greedy):
        try:
            out.append(it.session.choose(it.block_ids, it.proposal, o, g))
        except Exception as exc:  # noqa: BLE001 - its own failure (a sampling session's), its result alone
            out.append(exc)
    return out
