"""Speculative decoding (greedy, or lossless sampling by either rule): token ids in, token ids out.

Knows no backend and no transport: it is handed a verifier session and a
drafter session (``services/core/contract.py``) and only moves ints and opaque aux between
them. Per block:

1. the drafter extends its context with the aux of the positions committed
   last block and drafts ``B - 1`` candidates after ``last`` (one forward);
2. the verifier runs ``[last, c1 .. c_{B-1}]`` in one forward and returns its
   own greedy choice after every position;
3. the leading run of candidates equal to the target's choices is accepted,
   and the target's choice after that run is the bonus token, so every block
   commits between 1 and ``B`` tokens, all of them the target's greedy tokens
   (coupled sampling: the choices are the target's noisy argmax, so the tokens
   are those of AR sampling with the seed, whatever ``B``; rejection sampling:
   the choices already encode acceptance, the residual draw and the bonus
   draw, so the same rule commits exactly-p-distributed tokens; see
   ``VerifierSession.verify``);
4. the verifier keeps the positions it has seen that were accepted and trims
   the rest; the aux of the kept positions goes to the drafter next block.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Sequence

from kakeya.core.contract import (
    MAX_BLOCK_SIZE,
    Block,
    Draft,
    DrafterSession,
    Generation,
    VerifierSession,
    check_block_size,
)

if TYPE_CHECKING:
    from kakeya.orchestrator.adaptive import BlockSizer

__all__ = ["MAX_BLOCK_SIZE", "Block", "Generation", "check_block_size", "Decoding", "run"]

NO_DRAFT = Draft(())  # a block the drafter sits out: size 1, or the verifier decoding alone


def leading_matches(candidates: Sequence[int], choices: Sequence[int]) -> int:
    """How many candidates equal the target's choice at the position before them."""
    n = 0
    for c, t in zip(candidates, choices):
        if c != t:
            break
        n += 1
    return n


class Decoding:
    """One generation through the loop: an iterator of its committed blocks.

    ``generation`` is the record, kept as the blocks come: closing early keeps
    what was committed; once the iteration has ended it is complete.

    ``block_size`` is a fixed size or a :class:`~kakeya.orchestrator.adaptive.BlockSizer`
    that picks each block's size from what it has seen (``choose``/``observe``).
    ``drafter`` may be None (or ``block_size`` 1): the verifier then decodes
    autoregressively, with identical output. If ``on_drafter_error`` is given,
    a drafter exception is reported to it and the rest of the generation runs
    on the verifier alone instead of failing.
    """

    def __init__(
        self,
        verifier: VerifierSession,
        drafter: DrafterSession | None,
        prompt_ids: Sequence[int],
        max_tokens: int,
        block_size: "int | BlockSizer",
        stop_ids: Iterable[int] = (),
        on_drafter_error: Callable[[Exception], None] | None = None,
    ):
        self.generation = Generation(prompt_ids=list(prompt_ids))
        self._blocks = _decode(self.generation, verifier, drafter, max_tokens, block_size, stop_ids, on_drafter_error)

    def __iter__(self) -> "Decoding":
        return self

    def __next__(self) -> Block:
        return next(self._blocks)

    def close(self) -> None:
        self._blocks.close()


def _decode(
    gen: Generation,
    verifier: VerifierSession,
    drafter: DrafterSession | None,
    max_tokens: int,
    block_size: "int | BlockSizer",
    stop_ids: Iterable[int],
    on_drafter_error: Callable[[Exception], None] | None,
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
    first, new_aux = verifier.prefill(prompt_ids)
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
    last = first
    use_drafter = drafter is not None and (sizer is not None or block_size > 1)
    while not done:
        t_block = clock()
        # Never draft past max_tokens: a block commits at most B tokens.
        want = sizer.choose() if sizer is not None else block_size
        B = min(want, max_tokens - len(gen.token_ids)) if use_drafter else 1
        draft = NO_DRAFT
        # A sized block of 1 still hands the drafter the new positions (a draft of
        # size 1 only extends its context), or its context would have gaps later.
        if B > 1 or (sizer is not None and use_drafter):
            try:
                draft = drafter.draft(new_aux, last, B)
            except Exception as exc:  # the verifier alone produces the same tokens
                if on_drafter_error is None:
                    raise
                on_drafter_error(exc)
                gen.drafter_fallback, use_drafter, B = True, False, 1
        t_drafted = clock()
        # Rejection sampling: the draft carries the proposal its candidates were drawn from. Every
        # rule's choices follow the same accept-the-leading-run rule (services/core/sampling.py).
        candidates, proposal = list(draft.tokens), draft.proposal
        block_ids = [last] + candidates
        choices = verifier.verify(block_ids, proposal) if proposal is not None else verifier.verify(block_ids)
        t_verified = clock()
        n_ok = leading_matches(candidates, choices)
        tokens = candidates[:n_ok] + [choices[n_ok]]
        new_aux = verifier.commit(n_ok + 1)
        t_end = clock()
        done = emit(
            Block(
                tokens,
                drafted=len(candidates),
                accepted=n_ok,
                draft_s=t_drafted - t_block,
                verify_s=t_verified - t_drafted,
                commit_s=t_end - t_verified,
                total_s=t_end - t_block,
            )
        )
        if sizer is not None and use_drafter:
            sizer.observe(gen.blocks[-1])
        yield gen.blocks[-1]
        last = tokens[-1]
    gen.decode_s = clock() - t_decode


def run(verifier, drafter, prompt_ids, max_tokens, block_size, stop_ids=(), on_drafter_error=None) -> Generation:
    """Run a :class:`Decoding` to the end and return the whole generation."""
    decoding = Decoding(verifier, drafter, prompt_ids, max_tokens, block_size, stop_ids, on_drafter_error)
    for _ in decoding:
        pass
    return decoding.generation
