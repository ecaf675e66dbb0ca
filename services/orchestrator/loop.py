"""Speculative decoding (greedy, or lossless sampling by either rule): token ids in, token ids out.

Knows no backend and no transport: it is handed a verifier session and a
drafter session (``services/core/contract.py``) and only moves ints and opaque aux between
them. Per block:

1. the drafter extends its context with the aux of the positions committed
   last block and drafts ``B - 1`` candidates after ``last`` (one forward);
2. the verifier decides ``[last, c1 .. c_{B-1}]`` in one step
   (``VerifierSession.decide``): one forward, its own choice after every
   position, the acceptance rule (``core.contract.accept``: the leading run of
   candidates equal to its choices, then its choice after that run), the
   accepted positions kept and the rest trimmed. So every block commits between
   1 and ``B`` tokens, all of them the target's greedy tokens (coupled
   sampling: the choices are the target's noisy argmax, so the tokens are those
   of AR sampling with the seed, whatever ``B``; rejection sampling: the choices
   already encode acceptance, the residual draw and the bonus draw, so the same
   rule commits exactly-p-distributed tokens);
3. the verdict's next token opens the next block, and its aux (the kept
   positions') goes to the drafter with the next draft.

With ``predraft``, step 1 of the next block starts right after step 1 of this
one (``DrafterSession.predraft``): the drafter drafts it for the verdicts
likeliest to come (this block accepted in full and its guess of the next token;
with ``alternatives`` = k, also the likeliest rejections at a candidate with one
of its k next likeliest tokens there), and the next block takes the one the verdict
names, if it was prepared.

With ``ngram``, a block whose context ends in a run of tokens seen before is
drafted by copying what followed them (``ngram.py``); the drafter then only
extends its context (a draft of size 1), so it never falls behind.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, NamedTuple

from kakeya.core.contract import Draft, DrafterSession, Predrafts, Verdict, VerifierSession
from kakeya.core.generation import Block, Generation
from kakeya.core.request import MAX_BLOCK_SIZE, check_block_size
from kakeya.orchestrator.ngram import NgramIndex

if TYPE_CHECKING:
    from kakeya.orchestrator.adaptive import BlockSizer

__all__ = ["MAX_BLOCK_SIZE", "Block", "Decoding", "Generation", "check_block_size", "run"]

NO_DRAFT = Draft(())  # a block the drafter sits out: size 1, or the verifier decoding alone


class Decoding:
    """One generation through the loop: an iterator of its committed blocks.

    ``generation`` is the record, kept as the blocks come: closing early keeps
    what was committed; once the iteration has ended it is complete.

    ``block_size`` is a fixed size or a :class:`~kakeya.orchestrator.adaptive.BlockSizer`
    that picks each block's size from what it has seen (``choose``/``observe``).
    ``drafter`` may be None (or ``block_size`` 1): the verifier then decodes
    autoregressively, with identical output. If ``on_drafter_error`` is given,
    a drafter exception is reported to it and the rest of the generation runs
    on the verifier alone instead of failing. ``predraft``: while a block is
    verified, the drafter pre-drafts the next one (greedy sessions; it pays
    where the drafter works beside the verifier, a remote one). ``prefill``
    replaces the verifier's own (the engine's: resuming a cached prefix,
    ``engine.py``). ``ngram``: a block whose context ends in a run of tokens
    seen before copies what followed it instead of asking the drafter for
    candidates (greedy and coupled sampling; never the rejection rule, which
    needs the drafter's distribution). ``alternatives``: with ``predraft``, the drafter's next
    likeliest tokens a pre-draft may prepare for at each candidate (``DrafterSession.predraft``).

    ``unseen`` holds the aux the loop committed that the drafter has not been
    handed yet (chunks, in order): what a drafter's prefix snapshot still needs
    when the generation ends.
    """

    def __init__(
        self,
        verifier: VerifierSession,
        drafter: DrafterSession | None,
        prompt_ids: Sequence[int],
        max_tokens: int,
        block_size: int | BlockSizer,
        stop_ids: Iterable[int] = (),
        on_drafter_error: Callable[[Exception], None] | None = None,
        predraft: bool = False,
        prefill: Callable[[Sequence[int]], tuple] | None = None,
        ngram: bool = False,
        alternatives: int = 0,
    ):
        self.generation = Generation(prompt_ids=list(prompt_ids))
        self.unseen: list = []
        self._blocks = _decode(
            self.generation,
            verifier,
            drafter,
            max_tokens,
            block_size,
            stop_ids,
            on_drafter_error,
            predraft,
            prefill or verifier.prefill,
            self.unseen,
            ngram,
            alternatives,
        )

    def __iter__(self) -> Decoding:
        return self

    def __next__(self) -> Block:
        return next(self._blocks)

    def close(self) -> None:
        self._blocks.close()


class _Ahead(NamedTuple):
    """A pre-draft in flight: its result (the blocks it prepared, by the verdict each assumes), the
    candidates of the block being verified, and whether it prepared for their rejections too."""

    result: Callable[[], Predrafts]
    pending: int
    alternatives: bool


class _Drafts:
    """The drafter's side of one generation: the aux it has not been handed yet, the pre-draft in
    flight, the next block's size when it was chosen early (with that pre-draft), the n-gram index
    that drafts by copy, and the fallback to the verifier alone when the drafter fails."""

    def __init__(
        self,
        session,
        gen: Generation,
        sizer,
        block_size: int,
        predraft: bool,
        on_error,
        prompt_aux,
        unseen: list,
        ngram: bool = False,
        alternatives: int = 0,
    ):
        self.session, self.gen, self.sizer, self.block_size, self.on_error = session, gen, sizer, block_size, on_error
        self.active = session is not None and (sizer is not None or block_size > 1)
        self.predraft, self.alternatives = predraft, alternatives
        self.ngram = NgramIndex() if ngram else None
        self.stream = list(gen.prompt_ids)  # prompt + committed tokens: what the n-gram index reads
        self.new_aux = None  # the newest verdict's aux (the prompt's at first) until a drafter call takes it
        self.unseen = unseen  # every aux committed since a drafter call last took one (Decoding.unseen)
        self.committed(prompt_aux)
        self.ahead: _Ahead | None = None
        self.want: int | None = None
        self.copied = False  # the last block's candidates were the n-gram index's

    def committed(self, aux) -> None:
        """The aux of newly committed positions, for the next drafter call."""
        self.new_aux = aux
        self.unseen.append(aux)

    def _taken(self) -> None:
        """A drafter call took the new aux: its context now holds every committed position."""
        self.new_aux = None
        self.unseen.clear()

    def next(self, last: int, room: int, verdict: Verdict | None) -> tuple[Draft, bool]:
        """The draft of the block opened by ``last`` (at most ``room`` tokens) after ``verdict``: the
        pre-draft when it guessed right (True), else a fresh one."""
        ahead, self.ahead = self.ahead, None
        want, self.want = self.want, None
        self.copied = False
        if not self.active:
            return NO_DRAFT, False
        # Was this verdict prepared for? (Without alternatives only a full acceptance was: a remote
        # drafter's fresh draft is then sent at once, not after the pre-draft's answer.)
        if ahead is not None and (ahead.alternatives or verdict.accepted == ahead.pending):
            found = self._safely(ahead.result)
            prepared = None if found is None else found.after(verdict.accepted, last)
            if prepared is not None:
                return Draft(prepared[: room - 1]), True  # never past max_tokens
            if not self.active:
                return NO_DRAFT, False
        copy = self._copy() if want is None else ()
        if want is None and copy and self.sizer is not None:
            want = self.sizer.choose(copy=True)
            if want == 1:  # copies here break at once (their chain prices 1): draft instead
                copy, want = (), None
        if want is None:
            want = self.block_size if self.sizer is None else self.sizer.choose()
        B = min(want, room)  # never draft past max_tokens: a block commits at most B tokens
        # A sized block of 1 still hands the drafter the new positions (a draft of
        # size 1 only extends its context), or its context would have gaps later.
        if B == 1 and self.sizer is None:
            return NO_DRAFT, False
        if copy and B > 1:  # the drafter only takes the new positions; the candidates are the copy's
            if self._safely(self.session.draft, self.new_aux, last, 1) is not None:
                self._taken()
            self.copied = True
            return Draft(copy[: B - 1]), False
        draft = self._safely(self.session.draft, self.new_aux, last, B)
        if draft is None:
            return NO_DRAFT, False
        self._taken()
        return draft, False

    def _copy(self) -> tuple[int, ...]:
        """The n-gram index's candidates for the next block (the most any block takes), or ()."""
        if self.ngram is None:
            return ()
        self.stream.extend(self.gen.token_ids[len(self.stream) - len(self.gen.prompt_ids) :])
        return self.ngram.propose(self.stream, MAX_BLOCK_SIZE - 1)

    def predraft_after(self, last: int, draft: Draft) -> None:
        """Start pre-drafting the block after ``[last, *draft.tokens]`` (verified meanwhile): it takes the
        aux the drafter has not had, and the next block's size is chosen now."""
        if not (self.predraft and self.active and draft.tokens):
            return
        self.want = self.sizer.choose() if self.sizer is not None else self.block_size
        if self.want < 2:
            return
        result = self._safely(self.session.predraft, self.new_aux, [last, *draft.tokens], self.want, self.alternatives)
        if result is not None:
            self._taken()
            self.ahead = _Ahead(result, len(draft.tokens), self.alternatives > 0)
            self.gen.predrafts += 1

    def _safely(self, step, *args):
        """``step(*args)``; a drafter failure ends drafting (None) when the run falls back, else it is raised."""
        try:
            return step(*args)
        except Exception as exc:  # the verifier alone produces the same tokens
            if self.on_error is None:
                raise
            self.on_error(exc)
            self.gen.drafter_fallback, self.active, self.ahead = True, False, None
            return None


def _decode(
    gen: Generation,
    verifier: VerifierSession,
    drafter: DrafterSession | None,
    max_tokens: int,
    block_size: int | BlockSizer,
    stop_ids: Iterable[int],
    on_drafter_error: Callable[[Exception], None] | None,
    predraft: bool,
    prefill: Callable[[Sequence[int]], tuple],
    unseen: list,
    ngram: bool = False,
    alternatives: int = 0,
) -> Iterator[Block]:
    """:class:`Decoding`'s steps: record each committed block in ``gen`` and yield it."""
    sizer = None if isinstance(block_size, int) else block_size
    if sizer is None:
        check_block_size(block_size)
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    prompt_ids = gen.prompt_ids
    if not prompt_ids:
        raise ValueError("prompt is empty")
    stop = frozenset(stop_ids)
    clock = time.perf_counter

    t0 = clock()
    first, prompt_aux = prefill(prompt_ids)
    gen.prefill_s = clock() - t0
    t_decode = clock()

    def emit(block: Block) -> bool:
        """Record a block, cut it at a stop token; True when generation is over."""
        for i, tok in enumerate(block.tokens):
            if tok in stop:
                del block.tokens[i + 1 :]
                gen.finish_reason = "stop"
                break
        gen.blocks.append(block)
        gen.token_ids.extend(block.tokens)
        gen.decode_s = clock() - t_decode  # so far: a generation closed early has its time too
        return gen.finish_reason == "stop" or len(gen.token_ids) >= max_tokens

    done = emit(Block([first], 0, 0, total_s=gen.prefill_s))
    yield gen.blocks[-1]
    last, verdict = first, None
    drafts = _Drafts(
        drafter, gen, sizer, block_size, predraft, on_drafter_error, prompt_aux, unseen, ngram, alternatives
    )
    while not done:
        t_block = clock()
        draft, predrafted = drafts.next(last, max_tokens - len(gen.token_ids), verdict)
        t_drafted = clock()
        drafts.predraft_after(last, draft)  # a remote drafter works on it while the verifier verifies
        # Rejection sampling: the draft carries the proposal its candidates were drawn from. Every
        # rule's choices follow the same acceptance rule (core.contract.accept) inside decide.
        verdict = verifier.decide(last, draft)
        t_end = clock()
        drafts.committed(verdict.aux)
        tokens = list(draft.tokens[: verdict.accepted]) + [verdict.next_token]
        done = emit(
            Block(
                tokens,
                drafted=len(draft.tokens),
                accepted=verdict.accepted,
                draft_s=t_drafted - t_block,
                verify_s=t_end - t_drafted,
                total_s=t_end - t_block,
                predrafted=predrafted,
                copied=drafts.copied,
            )
        )
        if sizer is not None and drafts.active:
            sizer.observe(gen.blocks[-1])
        yield gen.blocks[-1]
        last = tokens[-1]
    gen.decode_s = clock() - t_decode


def run(
    verifier,
    drafter,
    prompt_ids,
    max_tokens,
    block_size,
    stop_ids=(),
    on_drafter_error=None,
    predraft=False,
    ngram=False,
    alternatives=0,
) -> Generation:
    """Run a :class:`Decoding` to the end and return the whole generation."""
    decoding = Decoding(
        verifier,
        drafter,
        prompt_ids,
        max_tokens,
        block_size,
        stop_ids,
        on_drafter_error,
        predraft,
        ngram=ngram,
        alternatives=alternatives,
    )
    for _ in decoding:
        pass
    return decoding.generation
