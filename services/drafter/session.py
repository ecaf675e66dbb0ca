"""One generation's drafter state, and the loaded drafter that hands sessions out (backend-neutral).

Per ``draft`` call the work is O(new positions + block): the new aux rows are
projected to per-layer context K/V and appended to the session's context cache
(never a rescan of the context), then ONE forward runs over the block
``[last_token, mask * (B-1)]`` and the argmax comes back in a single host sync
(a sampling session: its noisy argmax under the coupled rule, or the [B-1, K]
proposal each candidate is drawn from under the rejection rule; see
``sampling.py``).

A draft alone is :func:`draft_together` of one session, the same code
``batch.draft_batch`` runs for several (on torch: the same batched step, captured
in CUDA graphs when they are on). The model is a
``DraftModel`` (``backend.py``: the torch or MLX ``DFlashDraftModel``), asked
for nothing but what that protocol declares; the cache bookkeeping lives in
``context.py``. A session owns its cache; sessions share only the weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from kakeya.core.contract import Draft, DrafterStats, check_ranked
from kakeya.core.prefix import PrefixCache
from kakeya.core.request import SamplingParams
from kakeya.drafter.backend import DraftModel, extend
from kakeya.drafter.config import check_draft_args
from kakeya.drafter.sampling import session_rule

WARM_BLOCK_SIZES = range(2, 17)  # every block size the loop drafts (it stops at 16)


class _Empty:
    """A closed session's cache."""

    length = nbytes = 0


_EMPTY = _Empty()
NOTHING = Draft(())  # a block of size 1 drafts nothing (its call only extends the context)
CONTEXT = "context"  # the prefix cache's namespace: one drafter model per cache


class DraftCall(NamedTuple):
    """One checked draft call: ``aux`` (new context rows, the model's own array) and the ``block_size - 1``
    candidates drafted after ``last_token``."""

    session: LocalDrafterSession
    aux: Any
    last_token: int
    block_size: int

    @property
    def wanted(self) -> int:
        """Tokens this call drafts (0: it only extends the context)."""
        return self.block_size - 1


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
        """Keep the context after exactly ``ids`` (the prompt, then the committed tokens) in the prefix cache.

        ``unseen``: the aux the loop committed after this session's last draft (a list of chunks, in order);
        the context is extended by as many of their rows as ``ids`` needs. The generation must be over.
        False when nothing was kept (no prefix cache, too few rows, over budget).
        """
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
        return self.run(self.check(new_aux, last_token, block_size))

    def run(self, call: DraftCall) -> Draft:
        """A call ``check`` returned: :func:`draft_together` of this one call."""
        return draft_together([call])[0]

    def check(self, new_aux, last_token: int, block_size: int) -> DraftCall:
        """Validate one draft call's arguments (ValueError naming the field): the call, with ``new_aux``
        as the model's rows (None: no new rows)."""
        if self._closed:
            raise RuntimeError("drafter session is closed")
        vocab = self.model.target.vocab_size
        check_draft_args(last_token, block_size, vocab)
        aux = self.model.zeros_aux(0) if new_aux is None else self.model.read_aux(new_aux)
        if self.cache.length + aux.shape[0] == 0:
            raise ValueError("new_aux must hold at least one position on the first draft call")
        return DraftCall(self, aux, last_token, block_size)

    def stats(self) -> DrafterStats:
        return DrafterStats(context_len=self.cache.length, cache_bytes=self.cache.nbytes, draft_calls=self.calls)

    def abort(self) -> None:
        """Nothing to end from another thread in this process: a cancelled run stops calling the session and
        closes it on the thread its steps run on (the cache must not be freed under a running step)."""

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.model.release_cache(self.cache)
        self.cache = _EMPTY  # frees the K/V now (or hands it to the next session), not when collected


def draft_together(work: Sequence[DraftCall]) -> list[Draft]:
    """Checked draft calls of sessions of one model: ONE step (``DraftModel.draft_step``) extending every
    context and drafting every block, one host sync for the greedy ones (a sampling session's candidates
    come from its own logits rows, its own seed and positions)."""
    model = work[0].session.model
    caches = [call.session.cache for call in work]
    for call in work:
        call.session.calls += 1
    drafting = [call for call in work if call.wanted]
    greedy = any(call.session.rule is None for call in drafting)
    # the top ids on the device, only k a row to the host: a constrained session's ranks
    top = max((call.session.ranked for call in drafting), default=0)
    mask = model.config.mask_token_id
    tokens, logits = model.draft_step(  # the greedy tokens: one host sync, which settles every cache too
        [(call.session.cache, call.aux) for call in work],
        [(call.session.cache, [call.last_token] + [mask] * call.wanted) for call in drafting],
        greedy,
        keep_logits=bool(top) or not all(call.session.rule is None for call in drafting),
    )
    if not drafting:
        model.materialize(caches)
        return [NOTHING] * len(work)
    ranked = model.ranked(logits, top) if top else None  # the argmax and the next likeliest
    drafts, at = [], 0
    for call in work:
        if not call.wanted:
            drafts.append(NOTHING)
            continue
        at += call.wanted  # the block's rows: its positions 1..
        rows = slice(at - call.wanted, at)
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
