"""One generation's drafter state, and the loaded drafter that hands sessions out (backend-neutral).

Per ``draft`` call the work is O(new positions + block): the new aux rows are
projected to per-layer context K/V and appended to the session's context cache
(never a rescan of the context), then ONE forward runs over the block
``[last_token, mask * (B-1)]`` and the argmax comes back in a single host sync
(a sampling session: its noisy argmax under the coupled rule, or the [B-1, K]
proposal each candidate is drawn from under the rejection rule; see
``sampling.py``).

A pre-draft (``predraft``, greedy sessions) drafts the block after one still
being verified, for the verdicts likeliest to come, all in one forward: the
whole block accepted (``[last_token, *pending candidates, mask * B]``, whose
first mask is the guess of the verifier's next token and the rest the
candidates after it), and, with ``alternatives`` = k, a rejection at a
candidate with one of the drafter's k next likeliest tokens there instead
(``[last_token, c1 .. c_n, alternative, mask * (B-1)]``): the likeliest such
verdicts, at most ``predraft_blocks`` blocks in all (``PREDRAFT_BLOCKS``). The alternatives, and how
likely each verdict is, come from the logits of the draft that proposed the
pending candidates, which the session keeps (its top k + 1 ids per row and
their log-probabilities, ``_record``) once it has been asked for alternatives:
"n accepted, then a" is rated q(c1) .. q(c_n) q(a), the drafter's own estimate
of the target that chose its candidates. The blocks' context lacks the pending block's aux (the
verifier has not answered yet); their tokens are proposals like any others.

A draft alone is :func:`draft_together` of one session, the same code
``batch.draft_batch`` runs for several (on torch: the same batched step, captured
in CUDA graphs when they are on). The model is a
``DraftModel`` (``backend.py``: the torch or MLX ``DFlashDraftModel``), asked
for nothing but what that protocol declares; the cache bookkeeping lives in
``context.py``. A session owns its cache; sessions share only the weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from kakeya.core.contract import Draft, DrafterStats, Predrafts, check_alternatives, check_ranked
from kakeya.core.prefix import PrefixCache
from kakeya.core.request import MAX_BLOCK_SIZE, SamplingParams
from kakeya.drafter.backend import DraftModel, extend
from kakeya.drafter.config import check_draft_args
from kakeya.drafter.sampling import session_rule

WARM_BLOCK_SIZES = range(2, 17)  # every block size the loop drafts (it stops at 16)
# The most blocks one pre-draft prepares (the full acceptance's and the likeliest rejections'): each is
# up to 2B rows of one drafter forward, which should end before the verifier answers.
PREDRAFT_BLOCKS = 4


def check_predraft_blocks(n: int, field: str = "predraft_blocks") -> int:
    """At least the full acceptance's block (1: no alternative ever), at most every verdict of a block of 16."""
    if not 1 <= n <= 2 * MAX_BLOCK_SIZE:
        raise ValueError(f"{field} must be 1..{2 * MAX_BLOCK_SIZE}, got {n}")
    return n


class _Empty:
    """A closed session's cache."""

    length = nbytes = 0


_EMPTY = _Empty()
NOTHING = Draft(())  # a block of size 1 drafts nothing (its call only extends the context)
CONTEXT = "context"  # the prefix cache's namespace: one drafter model per cache


class DraftCall(NamedTuple):
    """One checked draft call: ``aux`` (new context rows, the model's own array) and the block drafted
    after ``[last_token, *pending]``. No ``pending``: a draft of ``block_size - 1`` candidates. Else one
    block of a pre-draft (``pending``: candidates still being verified): with ``guesses``, ``block_size``
    tokens, the guess of the verifier's next token (it opens the next block) and that block's
    candidates; without, ``pending`` ends with the verifier's next token it assumes, and the call
    drafts the ``block_size - 1`` candidates after it."""

    session: LocalDrafterSession
    aux: Any
    last_token: int
    block_size: int
    pending: tuple[int, ...] = ()
    guesses: bool = True

    @property
    def opening(self) -> list[int]:
        """The block's known tokens: the newest committed one, then the pending candidates."""
        return [self.last_token, *self.pending]

    @property
    def wanted(self) -> int:
        """Tokens this call drafts (0: it only extends the context)."""
        return self.block_size if self.pending and self.guesses else self.block_size - 1

    @property
    def verdict(self) -> tuple[int, int]:
        """A pre-draft block's key in :class:`Predrafts` without its guess: (accepted, next token)."""
        return len(self.pending) - 1, self.pending[-1]


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
        predraft_blocks: int = PREDRAFT_BLOCKS,
        ranked: int = 0,
    ):
        self.model = model
        self.predraft_blocks = check_predraft_blocks(predraft_blocks)
        self.rule = session_rule(sampling)  # None: greedy
        self.ranked = check_ranked(ranked)
        if ranked and self.rule is not None:  # a sampled candidate's rank says nothing of what the rule accepts
            raise ValueError("ranked: the likeliest ids are for greedy sessions (sampling is set)")
        self.cache = model.make_cache()
        self.prefixes = prefixes
        self._held: dict = {}  # positions -> snapshot found for this session's prompt, until it resumes
        self.calls = 0
        self._closed = False
        self.alternatives = 0  # next likeliest ids kept per drafted row (a pre-draft asked for them)
        # The last call's blocks: ((opening, *candidates), each candidate's log-probability, the next likeliest
        # (id, log-probability) pairs of each candidate's row).
        self._ranked: list[tuple[tuple[int, ...], list[float], list[list[tuple[int, float]]]]] = []

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

    def predraft(
        self, new_aux, block_ids: Sequence[int], block_size: int, alternatives: int = 0
    ) -> Callable[[], Predrafts]:
        """The contract's pre-draft, run now: in this process nothing runs beside the verifier."""
        calls = self.check_predraft(new_aux, block_ids, block_size, alternatives)
        found = predrafts(calls, draft_together(calls))
        return lambda: found

    def check_predraft(
        self, new_aux, block_ids: Sequence[int], block_size: int, alternatives: int = 0
    ) -> list[DraftCall]:
        """Validate a pre-draft's arguments (ValueError naming the field): its calls, the full acceptance's
        first (it takes ``new_aux``), then the likeliest rejections (a candidate and an alternative there)
        this session's record of the draft that proposed ``block_ids[1:]`` holds, ``predraft_blocks`` calls in
        all (none but the first without a record: a copied block, the first)."""
        if len(block_ids) < 2:
            raise ValueError("block_ids: a pre-draft follows a block with candidates (at least 2 ids)")
        check_alternatives(alternatives)
        full = self.check(new_aux, block_ids[0], block_size, tuple(block_ids[1:]))
        self.alternatives = alternatives  # kept from now on, for the next pre-draft
        calls, nothing = [full], self.model.zeros_aux(0)
        outcomes, before = [], 0.0  # (log-probability of the verdict, accepted, token there)
        for n, (logp, alts) in enumerate(zip(*self._alternatives_of(full.last_token, full.pending))):
            outcomes += [(before + alt_logp, n, a) for a, alt_logp in alts[:alternatives]]
            before += logp
        outcomes.sort(key=lambda o: -o[0])  # stable: a tie keeps the earlier position, the likelier alternative
        calls += [
            DraftCall(self, nothing, full.last_token, block_size, full.pending[:n] + (a,), False)
            for _, n, a in outcomes[: self.predraft_blocks - 1]
        ]
        return calls  # the longest block first: it plans the room every block's scratch rows need

    def _alternatives_of(
        self, opening: int, candidates: tuple[int, ...]
    ) -> tuple[list[float], list[list[tuple[int, float]]]]:
        """Per candidate, its log-probability and the next likeliest (id, log-probability) pairs of the row that
        drafted it (none without a record)."""
        key = (opening, *candidates)
        for drafted, logps, alts in self._ranked:
            if drafted[: len(key)] == key:  # a block cut to the room left is a prefix
                return logps[: len(candidates)], alts[: len(candidates)]
        return [], []

    def _record(
        self, call: DraftCall, tokens: Sequence[int], ids: Sequence[Sequence[int]], logps: Sequence[Sequence[float]]
    ) -> None:
        """Keep a drafted block, the token opening it first, with its candidates' log-probabilities and next
        likeliest ids (the argmax left out): a draft opens with its last token, a pre-draft's block with the
        verdict's token it assumes (a full acceptance's: its guess, its first drafted token)."""
        own, alts = [], []
        for tok, row, row_logp in zip(tokens, ids, logps):
            ranked = list(zip(row, row_logp))
            own.append(next((lp for t, lp in ranked if t == tok), ranked[0][1]))  # a tie may rank another first
            alts.append([(t, lp) for t, lp in ranked if t != tok][: self.alternatives])
        if call.pending and call.guesses:
            opening, tokens, own, alts = tokens[0], tokens[1:], own[1:], alts[1:]
        else:
            opening = call.pending[-1] if call.pending else call.last_token
        self._ranked.append(((opening, *tokens), own, alts))

    def run(self, call: DraftCall) -> Draft:
        """A call ``check`` returned: :func:`draft_together` of this one call."""
        return draft_together([call])[0]

    def check(self, new_aux, last_token: int, block_size: int, pending: tuple[int, ...] = ()) -> DraftCall:
        """Validate one draft call's arguments (ValueError naming the field): the call, with ``new_aux``
        as the model's rows (None: no new rows, a pre-draft's after a draft)."""
        if self._closed:
            raise RuntimeError("drafter session is closed")
        vocab = self.model.target.vocab_size
        check_draft_args(last_token, block_size, vocab)
        if pending:
            if self.rule is not None:
                raise ValueError(
                    "pending: pre-drafting is for greedy sessions (a sampled block is drawn once it opens)"
                )
            if block_size < 2 or len(pending) >= MAX_BLOCK_SIZE:
                raise ValueError(
                    f"a pre-draft needs block_size >= 2 and at most {MAX_BLOCK_SIZE - 1} pending candidates"
                )
            bad = [t for t in pending if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"pending: ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        aux = self.model.zeros_aux(0) if new_aux is None else self.model.read_aux(new_aux)
        if self.cache.length + aux.shape[0] == 0:
            raise ValueError("new_aux must hold at least one position on the first draft call")
        return DraftCall(self, aux, last_token, block_size, tuple(pending))

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
    come from its own logits rows, its own seed and positions). A pre-draft's calls all belong to one session."""
    model = work[0].session.model
    caches = [call.session.cache for call in work]
    for session in {id(call.session): call.session for call in work}.values():
        session.calls += 1
        session._ranked = []
    drafting = [call for call in work if call.wanted]
    greedy = any(call.session.rule is None for call in drafting)
    keep = max((call.session.alternatives for call in drafting if call.session.rule is None), default=0)
    # the top ids on the device, only k a row to the host: the pre-draft's alternatives and a constrained session's ranks
    top = max([keep + 1 if keep else 0, *(call.session.ranked for call in drafting)])
    mask = model.config.mask_token_id
    tokens, logits = model.draft_step(  # the greedy tokens: one host sync, which settles every cache too
        [(call.session.cache, call.aux) for call in work],
        [(call.session.cache, call.opening + [mask] * call.wanted) for call in drafting],
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
        at += len(call.opening) + call.wanted - 1  # the block's rows: its positions 1.., the drafted ones last
        rows = slice(at - call.wanted, at)
        if call.session.rule is None:
            k = call.session.ranked
            drafts.append(Draft(tokens[rows], ranked=_ranks(tokens[rows], ranked[0][rows], k) if k else None))
            if ranked is not None and call.session.alternatives:
                call.session._record(call, tokens[rows], ranked[0][rows], ranked[1][rows])
        else:  # syncs on its candidates (coupled) or its [B-1, K] proposal (rejection)
            # The context now ends at last_token's position: candidate 1 is the next one
            # (a sampling call has no pending candidates: pre-drafts are greedy).
            drafts.append(call.session.rule.draft(logits[rows], model.sampler, call.session.cache.length + 1))
    if not greedy:
        model.materialize(caches)
    return drafts


def _ranks(tokens: Sequence[int], rows: Sequence[Sequence[int]], k: int) -> list[tuple[int, ...]]:
    """Each candidate's ``k`` likeliest ids, the candidate first (a float tie may rank another id first)."""
    return [(tok, *[t for t in row if t != tok])[:k] for tok, row in zip(tokens, rows)]


def predrafts(calls: Sequence[DraftCall], drafts: Sequence[Draft]) -> Predrafts:
    """One pre-draft's blocks (``check_predraft``'s calls and what they drafted), keyed by the verdict each assumes."""
    blocks = {}
    for call, d in zip(calls, drafts):
        if call.guesses:  # the whole block accepted: its first token is the guess of the verifier's next one
            blocks[(len(call.pending), d.tokens[0])] = d.tokens[1:]
        else:
            blocks[call.verdict] = d.tokens
    return Predrafts(blocks)
