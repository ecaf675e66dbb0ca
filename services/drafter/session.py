"""One generation's drafter state, and several sessions' draft calls as one forward (backend-neutral).

Per ``draft`` call the new aux rows are projected to per-layer context K/V and appended to the session's cache (never a
rescan), then ONE forward runs over the block ``[last_token, mask * (B-1)]``. A sampling session's candidates follow
its rule (``core/sampling.py``) on q_i, the target's processing over the drafter's logits: coupled
(:class:`CoupledDrafts`, the verifier's noise, on the device) or rejection (:class:`RejectionDrafts`, drawn on the host
from q_i cut to its top-K, which the verifier tests min(1, p/q') against).

A draft alone is :func:`draft_together` of one session, the same code :func:`draft_batch` runs for several sessions of
one model. Each gets what it would alone up to the rounding of a matmul over more rows; drafts are proposals, so the
verifier's acceptance keeps the output exact. A session owns its cache; sessions share only the weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from kakeya.core import noise
from kakeya.core import sampling as lossless
from kakeya.core.contract import DRAFTER_STREAM, PROPOSAL_TOP_K, Draft, DrafterStats, check_ranked, session_rng
from kakeya.core.prefix import PrefixCache
from kakeya.core.request import COUPLED, MAX_BLOCK_SIZE, SamplingParams
from kakeya.drafter.backend import DraftModel, extend

WARM_BLOCK_SIZES = range(2, 17)  # every block size the loop drafts (it stops at 16)


class _Empty:
    """A closed session's cache."""

    length = nbytes = 0


NOTHING = Draft(())  # a block of size 1 drafts nothing (its call only extends the context)
CONTEXT = "context"  # the prefix cache's namespace: one drafter model per cache


class DraftItem(NamedTuple):
    """One session's draft call: extend its context by ``new_aux`` (unchecked: None, no new rows; checked,
    a ``DraftItem``: the model's own array), then draft ``block_size - 1`` tokens after ``last_token``."""

    session: LocalDrafterSession
    new_aux: Any
    last_token: int
    block_size: int


class CoupledDrafts:
    """A coupled-rule session's candidates: the noisy argmax of its processed logits."""

    def __init__(self, params: SamplingParams):
        self.params, self.keys = params, noise.session_keys(params.seed)

    def draft(self, logits, sampler, first_position: int) -> Draft:
        """Candidates for the ``logits`` rows [B-1, V] (device), row i at position ``first_position + i``."""
        return Draft(sampler.coupled_rows(logits, self.params, self.keys, first_position))


class RejectionDrafts:
    """A rejection-rule session's candidates, each drawn from the top-``PROPOSAL_TOP_K`` proposal it sends."""

    def __init__(self, params: SamplingParams):
        self.params, self.rng = params, session_rng(params.seed, DRAFTER_STREAM)

    def draft(self, logits, sampler, first_position: int) -> Draft:
        """Candidates for the ``logits`` rows [B-1, V] (device) and their proposal (positions play no part)."""
        ids, probs = sampler.proposal(logits, self.params, PROPOSAL_TOP_K)
        probs = probs / probs.sum(-1, keepdims=True)  # the top-k cut renormalised: each row a distribution
        tokens, proposal = lossless.draw_from_proposal(ids, probs, self.rng.random(ids.shape[0]))
        return Draft(tokens, proposal)


def session_rule(sampling: SamplingParams | None) -> CoupledDrafts | RejectionDrafts | None:
    """How a drafter session samples its candidates: None when greedy."""
    if sampling is None or sampling.check().greedy:
        return None
    if sampling.seed is None:
        raise ValueError("seed: a sampling session needs the request's seed (the engine draws one)")
    return CoupledDrafts(sampling) if sampling.rule == COUPLED else RejectionDrafts(sampling)


class LocalDrafterSession:
    """``prefixes``: the drafter's prefix cache (None: none): :meth:`cached_prefixes` and :meth:`resume`
    read it, :meth:`save` fills it. ``ranked``: the likeliest ids of each candidate's row every draft
    returns (``Draft.ranked``; greedy sessions; 0: none)."""

    server_s = None  # in this process a step's whole time is the backend's (the contract's attribute)

    def __init__(
        self,
        model: DraftModel,
        sampling: SamplingParams | None = None,
        prefixes: PrefixCache | None = None,
        ranked: int = 0,
    ):
        self.model = model
        self.rule = session_rule(sampling)  # None: greedy
        self.ranked = check_ranked(ranked)
        if ranked and self.rule is not None:  # a sampled candidate's rank says nothing of what the rule accepts
            raise ValueError("ranked: the likeliest ids are for greedy sessions (sampling is set)")
        self.cache = model.make_cache()
        self.prefixes = prefixes
        self._held: dict = {}  # positions -> snapshot found for this session's prompt, until it resumes
        self.calls = 0
        self._closed = False

    def cached_prefixes(self, prompt_ids: Sequence[int]) -> list[int]:
        """The lengths of the prompt prefixes this session can resume at, longest first: the prefix cache's
        snapshots of them, held for this session (an eviction meanwhile cannot take them) until :meth:`resume`."""
        found = self.prefixes.find(CONTEXT, prompt_ids, partial=True) if self.prefixes is not None else []
        self._held = {}
        for match in found:  # longest first, a whole snapshot before a trimmed one of the same length
            if match.positions not in self._held and (not match.back or match.value.truncatable):
                self._held[match.positions] = (match.value, match.back)
        return list(self._held)

    def resume(self, positions: int) -> None:
        """Start from the held snapshot of ``positions`` prompt tokens (0: from nothing); the first ``draft``'s
        ``new_aux`` then holds the positions after them."""
        if self.calls or self.cache.length:
            raise RuntimeError("resume: the session has drafted already")
        if positions:
            if positions not in self._held:
                raise ValueError(f"resume: no snapshot of {positions} prompt tokens is held (cached_prefixes first)")
            self.cache.restore(*self._held[positions])
        self._held = {}

    def save(self, ids: Sequence[int], unseen: Sequence) -> bool:
        """Keep the context after exactly ``ids`` (the prompt, then the committed tokens) in the prefix cache, the
        generation over: ``unseen``, the aux chunks committed after the last draft, extend it as far as ``ids``
        needs. False when nothing was kept (no prefix cache, too few rows, over budget)."""
        need = len(ids) - self.cache.length
        if self.prefixes is None or self._closed or need < 0:
            return False
        for chunk in unseen:
            if need <= 0:
                break
            rows = self.model.read_aux(chunk)[:need]
            extend(self.model, [self.cache], [rows])
            need -= rows.shape[0]
        if need:
            return False
        self.model.materialize([self.cache])
        snap = self.cache.snapshot()
        return self.prefixes.put(CONTEXT, ids, snap, snap.nbytes)

    def draft(self, new_aux, last_token: int, block_size: int) -> Draft:
        """Extend the context by ``new_aux`` and draft ``block_size - 1`` tokens after ``last_token``."""
        return draft_together([self.check(new_aux, last_token, block_size)])[0]

    def check(self, new_aux, last_token: int, block_size: int) -> DraftItem:
        """Validate one draft call's arguments (ValueError naming the field): the call, with ``new_aux``
        as the model's rows (None: no new rows)."""
        if self._closed:
            raise RuntimeError("drafter session is closed")
        check_draft_args(last_token, block_size, self.model.target.vocab_size)
        aux = self.model.zeros_aux(0) if new_aux is None else self.model.read_aux(new_aux)
        if self.cache.length + aux.shape[0] == 0:
            raise ValueError("new_aux must hold at least one position on the first draft call")
        return DraftItem(self, aux, last_token, block_size)

    def stats(self) -> DrafterStats:
        return DrafterStats(context_len=self.cache.length, cache_bytes=self.cache.nbytes)

    def abort(self) -> None:
        """Nothing to end from another thread in this process: a cancelled run stops calling the session and
        closes it on the thread its steps run on (the cache must not be freed under a running step)."""

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.model.release_cache(self.cache)
        self.cache = _Empty  # frees the K/V now (or hands it to the next session), not when collected


def draft_together(work: Sequence[DraftItem]) -> list[Draft]:
    """Checked draft calls of sessions of one model: ONE step (``DraftModel.draft_step``) extending every
    context and drafting every block, one host sync for the greedy ones (a sampling session's candidates
    come from its own logits rows, its own seed and positions)."""
    model = work[0].session.model
    caches = [call.session.cache for call in work]
    for call in work:
        call.session.calls += 1
    drafting = [call for call in work if call.block_size > 1]
    greedy = any(call.session.rule is None for call in drafting)
    # the top ids on the device, only k a row to the host: a constrained session's ranks
    top = max((call.session.ranked for call in drafting), default=0)
    mask = model.config.mask_token_id
    tokens, logits = model.draft_step(  # the greedy tokens: one host sync, which settles every cache too
        [(call.session.cache, call.new_aux) for call in work],
        [(call.session.cache, [call.last_token] + [mask] * (call.block_size - 1)) for call in drafting],
        greedy,
        keep_logits=bool(top) or not all(call.session.rule is None for call in drafting),
    )
    if not drafting:
        model.materialize(caches)
        return [NOTHING] * len(work)
    ranked = model.ranked(logits, top) if top else None  # the argmax and the next likeliest
    drafts, at = [], 0
    for call in work:
        n = call.block_size - 1
        if not n:
            drafts.append(NOTHING)
            continue
        at += n  # the block's rows: its positions 1..
        rows = slice(at - n, at)
        if call.session.rule is None:
            k = call.session.ranked
            drafts.append(Draft(tokens[rows], ranked=_ranks(tokens[rows], ranked[0][rows], k) if k else None))
        else:  # syncs on its candidates (coupled) or its [B-1, K] proposal (rejection)
            # The context now ends at last_token's position: candidate 1 is the next one.
            drafts.append(call.session.rule.draft(logits[rows], model.sampler, call.session.cache.length + 1))
    if not greedy:
        model.materialize(caches)
    return drafts


def _ranks(tokens: Sequence[int], rows: Sequence[Sequence[int]], k: int) -> list[tuple[int, ...]]:
    """Each candidate's ``k`` likeliest ids, the candidate first (a float tie may rank another id first)."""
    return [(tok, *[t for t in row if t != tok])[:k] for tok, row in zip(tokens, rows)]


def draft_batch(items: Sequence[DraftItem]) -> list[Draft | Exception]:
    """Several sessions' draft calls (``DraftItem`` or plain 4-tuples): one result per item, in order, its ``Draft`` or
    the exception it raised (for that item's caller alone). The sessions of each model draft together
    (:func:`draft_together`), or one by one when fewer than the model's ``min_batch``."""
    results: list[Any] = [None] * len(items)
    groups: dict[int, list] = {}  # sessions of one loaded model batch together
    seen: set[int] = set()
    for i, (session, new_aux, last_token, block_size) in enumerate(items):
        try:
            if id(session) in seen:
                raise ValueError("a session drafts at most once per batch (its next block needs this one's tokens)")
            call = session.check(new_aux, last_token, block_size)
        except Exception as exc:  # noqa: BLE001 -- this item's own failure, reported to its caller
            results[i] = exc
            continue
        seen.add(id(session))
        groups.setdefault(id(session.model), []).append((i, call))
    for group in groups.values():
        if len(group) >= group[0][1].session.model.min_batch:
            for (i, _), draft in zip(group, draft_together([call for _, call in group])):
                results[i] = draft
            continue
        for i, call in group:
            try:
                results[i] = draft_together([call])[0]
            except Exception as exc:  # noqa: BLE001 -- this item's own failure
                results[i] = exc
    return results


def check_draft_args(last_token, block_size, vocab_size: int) -> None:
    """Validate a draft call's scalars; ValueError naming the field (servers map it to INVALID_ARGUMENT)."""
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise ValueError(f"block_size must be an int, got {block_size!r}")
    if not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"block_size must be in 1..{MAX_BLOCK_SIZE}, got {block_size}")
    if isinstance(last_token, bool) or not isinstance(last_token, int):
        raise ValueError(f"last_token must be an int, got {last_token!r}")
    if not 0 <= last_token < vocab_size:
        raise ValueError(f"last_token must be in 0..{vocab_size - 1}, got {last_token}")
