"""One generation's verifier state: prefill, verify a block in one forward, commit/trim.

Backend-neutral: the target (``mlx_backend.target.TargetMLX`` or
``torch_backend.target.TargetTorch``) is driven only through the protocol in
``backend.py``; the session owns its caches and its ring layout (``layout.py``),
the one position counter: each forward gets an immutable plan from it, and a
trim only moves it back. Nothing is shared between sessions but the weights.
Per block there is one host sync (the target's choices as ints); aux hidden
states stay on the device and only the kept rows are handed on.

A block is :meth:`LocalVerifierSession.decide` (the contract's one step); its two
halves, :meth:`~LocalVerifierSession.verify` (the forward and the choices, the block
left pending) and :meth:`~LocalVerifierSession.commit` (keep a prefix, trim the rest),
are what the backend tests drive. The batch runner (``batch.py``) shares one
forward among sessions with :meth:`~LocalVerifierSession.forward_plan`,
:meth:`~LocalVerifierSession.forward_done` and :meth:`~LocalVerifierSession.choose`, the
pieces :meth:`~LocalVerifierSession.verify` is made of.
"""

from __future__ import annotations

from collections.abc import Collection, Generator, Sequence
from dataclasses import replace

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
from kakeya.verifier.backend import Forward, Segment, Target, cat
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
    """``prefixes``: the verifier's prefix cache (None: none), which :meth:`resume` reads and :meth:`save` fills;
    ``logprobs``: k, each committed token's log-probability and top k (``TokenLogprobs``) from the rows of the
    forward that decided it (None: none, nothing kept for them). ``grammar``: a constrained request's grammar
    state (None: unconstrained); every choice is then taken from the target's logits restricted to the tokens it
    allows there (``verifier/constrained.py``)."""

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
        # Sampling runs on the device (target.sampler). The coupled rule's noise is a function of
        # the seed's keys and the positions; the rejection rule's uniforms come from this
        # session's host stream. Both are seeded by the request.
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
        """f_theta restoration: a latent ring beside the K/V ring, same plan/applied/trim semantics.

        It holds one latent code per position for the last ``Wn - 1 + slack``
        positions (``Wn``: the model's window), enough for every position a
        query may see restored, even after a trim of up to ``slack``.
        """
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
        first, aux, _ = run_steps(self.prefill_steps(prompt_ids))
        return first, aux

    def resume(self, prompt_ids: Sequence[int], reuse: Collection[int] | None = None):
        """:meth:`prefill_steps` run whole, its prefix-cache lookup counted as a hit or a miss whatever ``reuse``
        allows: ``(first token, aux of the positions it ran, prefix length)``."""
        return run_steps(self._prefill_steps(prompt_ids, reuse, count=True))

    def prefill_steps(
        self, prompt_ids: Sequence[int], reuse: Collection[int] | None = ()
    ) -> Generator[int, None, tuple]:
        """The prefill one chunk per ``next()``; returns ``(first token, aux of the positions it ran, the prefix
        length resumed from the prefix cache)``.

        Yields the positions done after every chunk but the last (which also takes
        the first token). Whoever runs the model runs each ``next()`` as its own job, so
        other sessions' steps run between the chunks of a long prompt; the chunks
        are the same as a one-shot prefill's, so is the result. ``reuse``: the prefix
        lengths it may resume from (None: any; the default, none: a cold prefill,
        which is no prefix-cache lookup and counts as neither a hit nor a miss).
        """
        return (yield from self._prefill_steps(prompt_ids, reuse, count=reuse != ()))

    def _prefill_steps(self, prompt_ids, reuse, count: bool) -> Generator[int, None, tuple]:
        self._check_open()
        if self.offset != 0:
            raise RuntimeError("prefill must be the first call of a session")
        if not prompt_ids:
            raise ValueError("prompt_ids is empty")
        self.prompt = tuple(prompt_ids)
        self.cached_tokens = self._resume(reuse, count)
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
        """The contract's step: :meth:`verify` ``[last_token, *draft.tokens]``, then keep what the acceptance
        rule keeps (:func:`verdict`)."""
        block_ids = [last_token, *draft.tokens]
        return verdict(self, block_ids, self.verify(block_ids, draft.proposal))

    def _resume(self, reuse: Collection[int] | None, count: bool) -> int:
        """Resume from the longest snapshot ``reuse`` allows, or the longest prefix of one the prompt shares
        that the ring can trim back to exactly; the positions it holds (0: none, a cold prefill)."""
        if self.prefixes is None:
            return 0
        found = self.prefixes.find(self.policy, self.prompt, reuse, partial=True) if reuse is None or reuse else []
        for match in found:  # longest first
            if snapshot.restore(self, match.value, match.back):
                break
        if count:  # the verifier's lookup decides (a drafter only offers what it holds): it alone counts
            self.prefixes.count(self.offset)
        return self.offset

    def save(self, ids: Sequence[int]) -> bool:
        """Keep the state after exactly ``ids`` (the prompt, then the committed tokens) in the prefix cache.

        The generation must be over: the session is trimmed back to ``len(ids)``
        (only as far as the ring stays exact, ``RingLayout.can_trim``; else nothing
        is kept) and is only closed after.
        False when nothing was kept (no prefix cache, out of reach, over budget).
        """
        self._check_open()
        if self._pending is not None:
            raise RuntimeError("save: commit the pending block first")
        if tuple(ids[: len(self.prompt)]) != self.prompt or len(ids) < len(self.prompt):
            raise ValueError("save: ids must start with the session's prompt")
        back = self.offset - len(ids)
        if self.prefixes is None or not self.layout.can_trim(back):
            return False
        if back:
            self.layout.trim(back)
            if self.latent_layout is not None:
                self.latent_layout.trim(back)
        snap = snapshot.take(self)
        return self.prefixes.put(self.policy, ids, snap, snap.nbytes)

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
        self._pending = (len(block_ids), out.aux, self._logprob_rows(out.hidden))
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

    def _coupled(self, logits, first_position: int) -> list[int]:
        """The coupled rule's token after each row of ``logits`` [L, V], row i predicting ``first_position + i``."""
        return self.target.sampler.coupled_rows(logits, self.sampling, self.noise_keys, first_position)

    def _logprob_rows(self, hidden):
        """The block's logits rows, kept for :meth:`pending_logprobs` (None: no logprobs asked, nothing kept).
        The LM head over the forward's own final hidden rows: no second forward; the choices' arithmetic is
        left as it is."""
        return self.target.logits(hidden)[0] if self.logprobs is not None else None

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
        if n - n_keep:
            self.layout.trim(n - n_keep)
            if self.latent_layout is not None:
                self.latent_layout.trim(n - n_keep)
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

    def abort(self) -> None:
        """Nothing to end from another thread in this process: a cancelled run stops calling the session and
        closes it on the thread its steps run on (the cache must not be freed under a running step)."""

    def close(self) -> None:
        if not self.closed:
            self.target.release_cache(self.cache)
        self.cache, self._pending, self.closed = None, None, True
        self.latents = None

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
