"""Speculative decoding (greedy, or lossless sampling by either rule) as per-session state advanced in rounds.

Knows no backend and no transport: between a verifier session and a drafter session only ints and opaque aux move. A
:class:`Decode` is one generation's state; :func:`advance` runs one round over any number of them:

1. **draft**: each session asks its proposers in order (``orchestrator/proposers.py``); every drafter call of the round
   (a copy's too, so the drafter's context never has a gap) goes out as ONE batch (``draft_many``);
2. **verify**: every block ``[last, c1 .. c_{B-1}]`` goes to the verifier as ONE batch (``decide_many``), which keeps
   the accepted positions and trims the rest: every block commits 1..B of the target's own tokens;
3. **commit**: the verdict's next token opens the next block; its aux goes to the drafter with the next draft.

Sessions differ freely within a round (block sizes, rules, seeds, sources); one session's failure is its own.
:func:`run` decodes one session alone, the same rounds with a batch of one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from kakeya.core.contract import Draft, DrafterSession, Verdict, VerifierSession, replica_lost
from kakeya.core.generation import Block, Generation
from kakeya.core.request import MAX_BLOCK_SIZE
from kakeya.orchestrator.proposers import DRAFTER, FORCED, NGRAM, DraftState, Guide, NgramProposer, Proposal, Proposer

if TYPE_CHECKING:
    from kakeya.orchestrator.decode.block_sizing import BlockSizer

NO_DRAFT = Draft(())  # a block the drafter sits out: size 1, or the verifier decoding alone

DrafterCall = tuple[DrafterSession, Any, int, int]  # (session, new aux, last token, block size)
VerifierCall = tuple[VerifierSession, int, Draft]  # (session, last token, draft)


@dataclass(frozen=True)
class DecodeOptions:
    """How one session decodes, as the engine resolved it. ``block_size``: fixed, or a ``BlockSizer``; ``stop_ids``:
    tokens that end the generation (included); ``fallback``: a drafter failure leaves the verifier to finish alone (same
    tokens); ``ngram``: draft by copy where the context repeats; ``guide``: a constrained request's grammar, its forced
    tokens drafted without the drafter (``proposers.py``), up to ``max_block`` positions (the cache policy's
    rollback slack). ``ngram`` and ``guide`` never serve the rejection rule, which needs the drafter's distribution."""

    max_tokens: int
    block_size: int | BlockSizer = 1
    stop_ids: frozenset[int] = frozenset()
    fallback: bool = False
    ngram: bool = False
    guide: Guide | None = None
    max_block: int = MAX_BLOCK_SIZE
    takeover: bool = False  # a lost replica's failure parks the decode (``lost``) for its run to take over

    def __post_init__(self):  # the engine checked the request; these guard direct callers (tests, benchmarks)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if isinstance(self.block_size, int) and not 1 <= self.block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"block_size must be between 1 and {MAX_BLOCK_SIZE}, got {self.block_size}")


class DrafterProposer:
    """The last proposer, which always answers: a block of the chosen size drafted by the drafter (a sized
    block of 1 still hands it the new positions, or its context would have gaps later)."""

    def __init__(self, sized: bool):
        self.sized = sized

    def propose(self, state: DraftState) -> Proposal:
        size = min(state.size(False), state.room)
        ask = size if size > 1 or self.sized else 0
        return Proposal((), DRAFTER, f"no other source: the drafter drafts {size - 1}", ask)


class Decode:
    """One generation's decoding state, advanced by :func:`advance`. ``generation``: the record, kept as the
    blocks come; ``unseen``: committed aux no drafter call has taken yet (what a drafter's prefix snapshot
    still needs); ``error``: why it failed; ``drafter_error``: why its drafter stopped, when it fell back."""

    def __init__(
        self,
        verifier: VerifierSession,
        drafter: DrafterSession | None,
        prompt_ids: Sequence[int],
        options: DecodeOptions,
    ):
        self.verifier, self.drafter, self.options = verifier, drafter, options
        self.sizer = None if isinstance(options.block_size, int) else options.block_size
        self.block_size = options.block_size if self.sizer is None else 0
        self.generation = Generation(prompt_ids=list(prompt_ids))
        self.unseen: list = []
        self.error: BaseException | None = None
        self.drafter_error: Exception | None = None
        # a replica's loss (``takeover``): the decode sits out the rounds until its run reopened its sessions
        self.lost: Exception | None = None
        self.lost_at = 0.0
        self.cancelled = False  # its request went away: it takes no part in later rounds
        # the drafter's side: active while it answers; the newest verdict's aux until a drafter call takes it
        self.drafting = drafter is not None and (self.sizer is not None or self.block_size > 1)
        sources = [options.guide, NgramProposer() if options.ngram else None, DrafterProposer(self.sizer is not None)]
        self.proposers: list[Proposer] = [p for p in sources if p is not None]
        self._new_aux = None
        self._last: int | None = None  # the newest committed token: it opens the next block
        # this round's block: its candidates and the proposal they came from (None: the drafter sits it out)
        self._draft, self.proposal = NO_DRAFT, None
        self._t_block = 0.0
        self._t_decode = 0.0

    @property
    def done(self) -> bool:
        gen = self.generation
        over = gen.finish_reason == "stop" or len(gen.token_ids) >= self.options.max_tokens
        return over or self.error is not None or self.cancelled or self.lost is not None

    @property
    def started(self) -> bool:
        return self._last is not None

    def prefilled(self, first: int, prompt_aux, seconds: float) -> Block:
        """The prompt ran (``seconds``): its first token is the first block, its aux the drafter's first context."""
        logprobs = self.verifier.first_logprobs
        block = Block([first], 0, 0, total_s=seconds, logprobs=None if logprobs is None else [logprobs])
        return self._opened(block, prompt_aux)

    def resumed(self, ids: Sequence[int], aux, seconds: float) -> Block:
        """A resumed stream's prefill ran: ``ids`` stand as its first block, never streamed again."""
        return self._opened(Block(list(ids), 0, 0, total_s=seconds), aux)

    def _opened(self, block: Block, aux) -> Block:
        self.generation.prefill_s = block.total_s
        self._t_decode = time.perf_counter()
        self._committed(aux)
        block = self._emit(block)
        self._last = block.tokens[-1]
        return block

    def fail(self, exc: BaseException) -> None:
        """This decode failed: it takes no part in later rounds. A replica's loss under ``takeover`` parks it
        instead (``lost``), nothing committed, for its run to reopen the sessions (``decode/takeover.py``)."""
        if self.options.takeover and replica_lost(exc) and self.lost is None:
            self.lost, self.lost_at = exc, time.perf_counter()
            return
        self.error = exc

    def reopened(self, verifier: VerifierSession, drafter: DrafterSession | None, aux) -> None:
        """Its sessions were reopened on all but the last committed token (``aux``: the drafter's context)."""
        self.verifier, self.drafter = verifier, drafter
        self.proposal = None
        self._last = self.generation.token_ids[-1]
        self._new_aux, self.unseen = aux, [aux]
        self.drafting = drafter is not None and (self.sizer is not None or self.block_size > 1)
        self.lost = None  # last: a round may include it from here on

    def plan_draft(self) -> DrafterCall | None:
        """Ask the proposers in order for this round's block; the drafter call it needs (None: none)."""
        self._t_block = time.perf_counter()
        self._draft, self.proposal = NO_DRAFT, None
        if not self.drafting:
            return None
        gen = self.generation
        room = self.options.max_tokens - len(gen.token_ids)  # a block commits at most B tokens
        state = DraftState(gen.prompt_ids, gen.token_ids, room, self.options.max_block, self._size)
        self.proposal = next(p for source in self.proposers if (p := source.propose(state)) is not None)
        return (self.drafter, self._new_aux, self._last, self.proposal.ask) if self.proposal.ask else None

    def _size(self, copy: bool) -> int:
        """The next block's size: the fixed one, or the sizer's choice (``copy``: for a block drafted by copy)."""
        return self.block_size if self.sizer is None else self.sizer.choose(copy=copy)

    def drafted(self, result: Draft | BaseException) -> None:
        """The drafter's answer to this round's call (an exception: it failed)."""
        if isinstance(result, BaseException):
            self._drafter_failed(result)
            return
        self._new_aux = None  # the call took it: the drafter's context holds every committed position
        self.unseen.clear()
        proposal = self.proposal
        if proposal.tokens:
            self._draft = Draft(proposal.tokens)
        elif proposal.ask > 1:
            self._draft = self._allowed(result)

    def verifier_call(self) -> VerifierCall:
        """This round's block for the verifier: ``[last, *candidates]``."""
        return (self.verifier, self._last, self._draft)

    def verified(self, verdict: Verdict | BaseException, draft_s: float, verify_s: float) -> Block | None:
        """The verifier's verdict on this round's block, committed: the block (None: the decode failed)."""
        if isinstance(verdict, BaseException):
            self.fail(verdict)
            return None
        self._committed(verdict.aux)
        draft = self._draft
        source = self.proposal.source if self.proposal is not None and draft.tokens else DRAFTER
        tokens = list(draft.tokens[: verdict.accepted]) + [verdict.next_token]
        block = self._emit(
            Block(
                tokens,
                drafted=len(draft.tokens),
                accepted=verdict.accepted,
                draft_s=draft_s,
                verify_s=verify_s,
                total_s=time.perf_counter() - self._t_block,
                copied=source == NGRAM,
                forced=source == FORCED,
                logprobs=None if verdict.logprobs is None else list(verdict.logprobs),
            )
        )
        if self.sizer is not None and self.drafting and not block.forced:  # the sizer prices the drafter's blocks
            self.sizer.observe(block)
        self._last = tokens[-1]
        return block

    def _committed(self, aux) -> None:
        """The aux of newly committed positions, for the next drafter call."""
        self._new_aux = aux
        self.unseen.append(aux)

    def _allowed(self, draft: Draft) -> Draft:
        """The drafter's block as the grammar allows it: best-ranked allowed ids, else cut at a refused one."""
        guide = self.options.guide
        if guide is None or not draft.tokens or draft.proposal is not None:
            return draft
        if draft.ranked is not None:
            return Draft(guide.choose(self.generation.token_ids, draft.ranked))
        n = guide.allowed_prefix(self.generation.token_ids, draft.tokens)
        return draft if n == len(draft.tokens) else Draft(draft.tokens[:n])

    def _drafter_failed(self, exc: BaseException) -> None:
        if self.options.takeover and replica_lost(exc):
            self.fail(exc)  # another drafter replica first; the verifier alone only if none is left
            return
        if not self.options.fallback or not isinstance(exc, Exception):
            self.fail(exc)
            return
        self.drafter_error = exc
        self.generation.drafter_fallback, self.drafting = True, False

    def _emit(self, block: Block) -> Block:
        """Record a block, cut at a stop token (which ends the generation)."""
        gen = self.generation
        for i, tok in enumerate(block.tokens):
            if tok in self.options.stop_ids:
                block.cut(i + 1)
                gen.finish_reason = "stop"
                break
        gen.blocks.append(block)
        gen.token_ids.extend(block.tokens)
        gen.decode_s = time.perf_counter() - self._t_decode  # so far: a decode ended early has its time too
        return block


def each(call: Callable, items: Sequence) -> list:
    """``call(*item)`` for each item, an exception being that item's result alone."""
    out = []
    for item in items:
        try:
            out.append(call(*item))
        except Exception as exc:  # noqa: BLE001 - its own failure, its result alone
            out.append(exc)
    return out


def _batch(call: Callable[[Sequence], list], items: Sequence) -> list:
    """``call(items)``, one result per item; a failure of the call itself is every item's result."""
    try:
        results = call(items)
    except Exception as exc:  # noqa: BLE001 - the backend's batch failed as a whole: each item hears it
        return [exc] * len(items)
    if len(results) != len(items):
        return [RuntimeError(f"{len(results)} results for {len(items)} items")] * len(items)
    return results


def one_by_one_drafts(items: Sequence[DrafterCall]) -> list[Draft | Exception]:
    """``draft_many`` for sessions with no batch runner: each session's own ``draft``."""
    return each(lambda s, aux, last, size: s.draft(aux, last, size), items)


def one_by_one_verdicts(items: Sequence[VerifierCall]) -> list[Verdict | Exception]:
    """``decide_many`` for sessions with no batch runner: each session's own ``decide``."""
    return each(lambda s, last, draft: s.decide(last, draft), items)


class Drafted(NamedTuple):
    """A round between its two halves: the decodes it advances, drafted, and the draft's seconds."""

    live: list[Decode]
    draft_s: float


def draft_round(
    decodes: Iterable[Decode], draft_many: Callable[[Sequence[DrafterCall]], list] = one_by_one_drafts
) -> Drafted:
    """A round's first half: ONE batched draft for every started, unfinished decode."""
    live = [d for d in decodes if d.started and not d.done]
    for d in live:
        if d.sizer is not None:
            d.sizer.sharing = len(live)  # a batched round prices a block's rows, not only its share of the round
    t0 = time.perf_counter()
    calls = [(d, call) for d in live if (call := d.plan_draft()) is not None]
    if calls:
        for (d, _), result in zip(calls, _batch(draft_many, [c for _, c in calls])):
            d.drafted(result)
    return Drafted(live, time.perf_counter() - t0)


def verify_round(
    drafted: Drafted, decide_many: Callable[[Sequence[VerifierCall]], list] = one_by_one_verdicts
) -> list[tuple[Decode, Block]]:
    """A round's second half: ONE batched verify of every drafted decode still unfinished."""
    live = [d for d in drafted.live if not d.done]
    t0 = time.perf_counter()
    verdicts = _batch(decide_many, [d.verifier_call() for d in live]) if live else []
    verify_s = time.perf_counter() - t0
    blocks = [(d, d.verified(verdict, drafted.draft_s, verify_s)) for d, verdict in zip(live, verdicts)]
    return [(d, block) for d, block in blocks if block is not None]


def advance(
    decodes: Iterable[Decode],
    draft_many: Callable[[Sequence[DrafterCall]], list] = one_by_one_drafts,
    decide_many: Callable[[Sequence[VerifierCall]], list] = one_by_one_verdicts,
) -> list[tuple[Decode, Block]]:
    """One round over every started, unfinished decode: the blocks, by decode (a failed decode gets none:
    its ``error`` says why). The scheduler runs the two halves as two model-thread jobs."""
    return verify_round(draft_round(decodes, draft_many), decide_many)


def run(
    verifier: VerifierSession,
    drafter: DrafterSession | None,
    prompt_ids: Sequence[int],
    max_tokens: int,
    block_size: int | BlockSizer,
    stop_ids: Iterable[int] = (),
    on_drafter_error: Callable[[Exception], None] | None = None,
    ngram: bool = False,
) -> Generation:
    """Decode one session alone to the end (its prefill, then rounds of one) and return the generation.
    ``on_drafter_error``: fall back to the verifier alone when the drafter fails, telling it why."""
    options = DecodeOptions(max_tokens, block_size, frozenset(stop_ids), on_drafter_error is not None, ngram)
    decode = Decode(verifier, drafter, prompt_ids, options)
    for _ in alone(decode):
        pass
    if decode.drafter_error is not None:
        on_drafter_error(decode.drafter_error)
    return decode.generation


def alone(decode: Decode) -> Iterator[Block]:
    """``decode`` decoded by itself: its prefill's block, then one block per round of one; its failure raised."""
    t0 = time.perf_counter()
    first, aux = decode.verifier.prefill(decode.generation.prompt_ids)
    yield decode.prefilled(first, aux, time.perf_counter() - t0)
    while not decode.done:
        for _, block in advance([decode]):
            yield block
    if decode.error is not None:
        raise decode.error
