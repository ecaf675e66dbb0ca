"""The contract between the accept/trim loop and its backends: the ``Verifier``/``Drafter`` protocols and their
sessions, the facts a verifier publishes (``ModelInfo``), session options, what a draft and a verdict carry, and THE
acceptance rule. ``core`` imports nothing else from ``services``.

Aux hidden states are opaque to the loop: whatever the verifier returns (an ``mx.array``, a ``torch.Tensor``, an encoded
proto tensor) is handed to the drafter unchanged. Token ids are plain Python ints.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from kakeya.core.constraints import Constraint
from kakeya.core.request import CachePolicy, SamplingParams

# Attention layer kinds, as Hugging Face configs spell them in ``layer_types`` (Gemma-4, the DFlash drafter).
SLIDING = "sliding_attention"
FULL = "full_attention"


def check_layer_types(layer_types, num_layers: int) -> None:
    """A config's ``layer_types``: one known kind per layer (ValueError naming the problem)."""
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries, num_hidden_layers is {num_layers}")
    unknown = set(layer_types) - {SLIDING, FULL}
    if unknown:
        raise ValueError(f"unsupported layer_types {sorted(unknown)}")


Aux = Any  # [n_positions, len(target_layer_ids) * hidden] in the backend's own array type
Prefilling = Generator[int, None, tuple[int, Aux, int]]  # ``VerifierSession.prefill_steps``


def replica_lost(exc: BaseException) -> bool:
    """``exc`` is a replica's loss another replica of its role may take over (``decode/takeover.py``): only
    remote sessions raise such (``remote/streams.py``'s ``BackendError.replica_lost``)."""
    return bool(getattr(exc, "replica_lost", False))


def drained(exc: BaseException) -> bool:
    """``exc`` is a draining replica's hand-off (``BackendError.drained``): a loss to take over, not a failure."""
    return bool(getattr(exc, "drained", False))


# The most ids a drafter returns per candidate for a constrained request to choose among
# (``SessionOptions.ranked``, ``Draft.ranked``, ``orchestrator/proposers.py``).
MAX_RANKED = 16


def check_ranked(n: int, field: str = "ranked") -> int:
    if not 0 <= n <= MAX_RANKED:
        raise ValueError(f"{field} must be 0..{MAX_RANKED}, got {n}")
    return n


@dataclass(frozen=True)
class ModelInfo:
    """Facts about the target that the loop and the public API need."""

    name: str  # the checkpoint directory (or its display name)
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    hidden_size: int
    num_layers: int
    sliding_window: int
    backend: str  # "mlx" | "torch" | "grpc:<addr>"
    extra: dict = field(default_factory=dict)
    max_position_embeddings: int = 0  # the target's config; 0: not known
    max_context: int = 0  # positions one session may hold (a verifier server's --max-context); 0: no lower limit


# How many of its most probable tokens a drafter keeps per candidate under the rejection rule (its proposal q', the
# processed distribution truncated and renormalised): exact for any q' really sampled from; a smaller K only costs
# acceptance where the drafter's tail mattered.
PROPOSAL_TOP_K = 32


@dataclass(frozen=True)
class Proposal:
    """The distributions a drafter actually sampled its candidates from (compact, never full-vocabulary): row i is q'_i,
    ``ids`` [n, K] int32 and ``probs`` [n, K] float32 summing to 1 (numpy); ids outside a row have probability 0."""

    ids: Any
    probs: Any

    def __post_init__(self):
        if self.ids.shape != self.probs.shape or self.ids.ndim != 2:
            raise ValueError(f"proposal ids {self.ids.shape} and probs {self.probs.shape} must both be [n, K]")

    def __len__(self) -> int:
        return self.ids.shape[0]


@dataclass(frozen=True)
class TokenLogprobs:
    """One committed token's log-probability and the ``k`` most probable tokens at its position (``top``: ``(token,
    logprob)`` pairs, most probable first; ``k`` = ``Request.logprobs``). Always the target's RAW distribution there
    (after Gemma's final soft-capping, before any sampling filter), greedy and sampled alike, as vLLM returns by
    default; in float32 from the forward that decided the token."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Verdict:
    """What a verifier decided about one block: :func:`accept` applied to its choices, committed."""

    accepted: int  # candidates accepted (0 .. len(block) - 1)
    next_token: int  # the verifier's choice after them: opens the next block (not in the cache yet)
    aux: Aux  # aux of the kept positions (the block's first ``accepted + 1``): the drafter's new context
    # One per committed token (``accepted + 1``) when the session was opened with ``logprobs``; else None.
    logprobs: tuple[TokenLogprobs, ...] | None = None


@dataclass(frozen=True)
class Draft:
    """What a drafter proposes for one block: its candidate ids and, under the rejection rule, the :class:`Proposal` row
    each was drawn from (None: greedy or coupled candidates, which need nothing beside them).

    ``ranked``: a greedy session opened with ``SessionOptions.ranked`` = k gets, per candidate, the k likeliest ids of
    its row, the candidate first (no row depends on the ids chosen before it): a constrained request picks each
    position's best-ranked id its grammar allows (``orchestrator/proposers.py``)."""

    tokens: tuple[int, ...]
    proposal: Proposal | None = None
    ranked: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self):
        object.__setattr__(self, "tokens", tuple(self.tokens))  # any sequence of ids in, an immutable value out
        if self.proposal is not None and len(self.proposal) != len(self.tokens):
            why = f"a draft of {len(self.tokens)} candidates cannot carry {len(self.proposal)} proposal rows"
            raise ValueError(why)
        if self.ranked is not None:
            object.__setattr__(self, "ranked", tuple(tuple(int(t) for t in row) for row in self.ranked))
            if len(self.ranked) != len(self.tokens):
                why = f"a draft of {len(self.tokens)} candidates cannot carry {len(self.ranked)} ranked rows"
                raise ValueError(why)


def accept(candidates: Sequence[int], choices: Sequence[int]) -> tuple[int, int]:
    """THE acceptance rule, one definition for greedy and every sampling rule: ``(accepted, next_token)``.

    ``choices[i]`` is the verifier's token after block position ``i`` (one more than there are candidates). The leading
    run of candidates equal to their choice is accepted; the choice right after it is the next token (bonus or
    correction). A sampling rule's choices already encode its acceptance and draws (``VerifierSession.decide``)."""
    n = 0
    for candidate, choice in zip(candidates, choices):
        if candidate != choice:
            break
        n += 1
    return n, int(choices[n])


def session_rng(seed: int, stream: int):
    """The random stream of one rejection-rule session (``stream`` 0: the verifier, 1: the drafter): host-side
    numpy PCG64 from the request's seed, so every backend and deployment consumes identical uniforms."""
    import numpy as np

    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed, spawn_key=(stream,))))


VERIFIER_STREAM, DRAFTER_STREAM = 0, 1


class Cancellation:
    """A flag set once, from any thread (a client went away); ``on_cancel`` hooks run when it is, now if it already
    was (a remote session's: end its stream, so a cancelled request frees the backends' sessions at once)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._hooks: list[Callable[[], None]] = []
        self.cancelled = False

    def on_cancel(self, hook: Callable[[], None]) -> None:
        with self._lock:
            if not self.cancelled:
                self._hooks.append(hook)
                return
        hook()

    def cancel(self) -> None:
        with self._lock:
            if self.cancelled:
                return
            self.cancelled, hooks, self._hooks = True, self._hooks, []
        for hook in hooks:
            hook()


@dataclass(frozen=True)
class SessionOptions:
    """What one request tells the sessions it opens, beyond cache policy and sampling. A remote session uses all of it;
    an in-process one takes ``logprobs``, ``constraint`` and ``ranked`` (a cancelled run simply stops calling it)."""

    request_id: str = ""
    timeout: float | None = None  # seconds the session may live (the client's deadline); None: no bound
    max_positions: int = 0  # prompt + max_tokens: the most positions it will hold; 0: the server's limit
    cancel: Cancellation | None = None
    # A verifier session: each committed token's log-probability and top ``logprobs`` (``Request.logprobs``;
    # None: none, and the session pays nothing for them).
    logprobs: int | None = None
    constraint: Constraint | None = None  # what the output must match (the verifier's sessions enforce it)
    # A greedy drafter session: the ``ranked`` likeliest ids of each candidate's row with every draft
    # (``Draft.ranked``; a constrained request chooses among them); 0: none, and it pays nothing for them.
    ranked: int = 0
    # A remote session's caller reopens it on another replica when its replica is lost (``decode/takeover.py``):
    # a draining replica's session moves then; False: it finishes where it is, within that server's grace.
    movable: bool = False


@dataclass(frozen=True)
class KVBytes:
    """A verifier session's K/V memory: sliding-layer rings, full-attention layers, f_theta's latent ring."""

    sliding: int = 0
    full: int = 0
    restored: int = 0

    @property
    def total(self) -> int:
        return self.sliding + self.full + self.restored

    def as_dict(self) -> dict[str, int]:
        """As reports and ``verifier/memory.py``'s formula write it (``restored`` only where there is any)."""
        return {"sliding": self.sliding, "full": self.full} | ({"restored": self.restored} if self.restored else {})


@dataclass(frozen=True)
class WireStats:
    """What a remote session's stream carried, and the backend's own time handling its steps."""

    bytes_sent: int = 0
    bytes_received: int = 0
    server_s: float = 0.0


@dataclass(frozen=True)
class VerifierStats:
    """A verifier session's live facts (``VerifierSession.stats``)."""

    cache_policy: str = ""  # the policy's label, e.g. "sink-window(4+64)+kv8"
    bounded: bool = False  # sliding-layer memory bounded (any policy but native)
    positions: int = 0
    kv_bytes: KVBytes = KVBytes()
    wire: WireStats | None = None  # a remote session's stream; None in this process


@dataclass(frozen=True)
class DrafterStats:
    """A drafter session's live facts (``DrafterSession.stats``)."""

    context_len: int = 0  # context positions cached
    cache_bytes: int = 0
    wire: WireStats | None = None  # a remote session's stream; None in this process


@runtime_checkable
class VerifierSession(Protocol):
    """One generation's verifier state: its KV cache lives exactly as long as this object.

    ``server_s``: the backend's own time handling this session's steps so far (a remote session's
    servers report it; None in this process, where all of a step's time is the backend's)."""

    server_s: float | None
    # The prefill's first token's :class:`TokenLogprobs` once it ran, for a session opened with ``logprobs``
    # (None before, or without); a block's are in its :class:`Verdict`.
    first_logprobs: TokenLogprobs | None

    def prefill(self, prompt_ids: Sequence[int]) -> tuple[int, Aux]:
        """Run the prompt; return the target's next token (greedy, or sampled from p when the
        session samples) and the prompt's aux hidden states."""

    def prefill_steps(self, prompt_ids: Sequence[int], reuse: Collection[int] | None = ()) -> Prefilling:
        """:meth:`prefill` one step per ``next()`` (a chunk of the prompt here; one round trip to a remote
        verifier), so whoever runs the model can run other sessions' steps between them. With ``reuse`` it starts
        from the verifier's prefix cache: its longest snapshot of a prefix whose length is in ``reuse`` (None: any
        length; empty: a cold prefill). Returns ``(first token, aux of the positions it ran, prefix resumed)``."""

    def decide(self, last_token: int, draft: Draft) -> Verdict:
        """Verify the block ``[last_token, *draft.tokens]`` in ONE forward and commit its outcome: :func:`accept`
        applied to the session's choice after every position.

        Greedy: the target's argmax. Coupled: the argmax of the noisy processed logits (AR sampling's token with this
        seed). Rejection (``draft.proposal`` holds q'_i): candidate i accepted with probability min(1, p_i(x)/q'_i(x)),
        at the first rejection a sample from norm(max(0, p_i - q'_i)), after all accepted a sample from p. The accepted
        positions stay in the cache, the rest is trimmed exactly; the :class:`Verdict` carries their aux."""

    def save(self, ids: Sequence[int]) -> bool:
        """Leave the state after exactly ``ids`` (the prompt, then committed tokens) in the prefix cache, the
        generation being over; False when nothing was kept (no prefix cache, out of the ring's reach, over budget)."""

    def stats(self) -> VerifierStats: ...

    def close(self) -> None:
        """End the session politely and free its cache (idempotent)."""

    def abort(self) -> None:
        """End it now, from any thread (a cancelled request): a remote session cancels its stream."""


@runtime_checkable
class DrafterSession(Protocol):
    """One generation's drafter state: the DFlash context K/V cache (``server_s``: as the verifier's)."""

    server_s: float | None

    def draft(self, new_aux: Aux, last_token: int, block_size: int) -> Draft:
        """Extend the context cache with ``new_aux`` (the aux of every position committed since the last call; the whole
        prompt on the first) and propose ``block_size - 1`` tokens after ``last_token``, the newest committed token,
        which opens the block. Greedy: the argmax; coupled: the argmax of the noisy processed logits (the verifier's
        noise); rejection: each candidate sampled from its proposal q'_i, which the :class:`Draft` carries."""

    def cached_prefixes(self, prompt_ids: Sequence[int]) -> list[int]:
        """The lengths of the prefixes of ``prompt_ids`` the drafter's prefix cache holds a snapshot of."""

    def resume(self, positions: int) -> None:
        """Start from the snapshot of the first ``positions`` prompt tokens (0: from nothing); the verifier
        resumed the same prefix, so the drafter's context has no gap."""

    def save(self, ids: Sequence[int], unseen: Sequence[Aux]) -> bool:
        """Leave the context after ``ids`` in the prefix cache, first extended by ``unseen`` (the aux the
        loop committed that no draft call took yet); False when nothing was kept."""

    def stats(self) -> DrafterStats: ...

    def close(self) -> None:
        """End the session politely and free its cache (idempotent)."""

    def abort(self) -> None:
        """End it now, from any thread (a cancelled request)."""


@runtime_checkable
class Verifier(Protocol):
    """A target that hands out sessions: in this process (``verifier/session.py``) or over gRPC
    (``orchestrator/remote/verifier.py``). What the public API needs of it is here: no caller asks which it holds."""

    info: ModelInfo  # also the limits: max_position_embeddings, max_context
    aux_layers: tuple[int, ...]  # the layers whose hidden states its sessions return (the drafter's)
    # Its sessions' default cache policy. A restoration source in it is named as this verifier's
    # clients name it: a directory in process, the source name the verifier server publishes over gRPC.
    policy: CachePolicy
    constrains: bool  # its sessions enforce ``SessionOptions.constraint``

    def open_session(self, policy: CachePolicy | None = None, sampling: SamplingParams | None = None,
                     options: SessionOptions | None = None) -> VerifierSession:  # fmt: skip
        """A new session; ``policy`` overrides the verifier's default; ``sampling`` None: greedy."""

    def healthy(self, timeout: float = 1.0) -> bool:
        """Whether it answers now (a remote one: its health check within ``timeout``)."""

    def decide_batch(self, items: Sequence[tuple[VerifierSession, int, Draft]]) -> list[Verdict | Exception]:
        """:meth:`VerifierSession.decide` of several of its sessions at once, each item ``(session, last token,
        draft)``: one forward for all of them where the backend can, the same verdicts as one by one. One
        result per item, in order; an item's failure is its result alone, never its batch-mates'."""


@runtime_checkable
class Drafter(Protocol):
    """A DFlash drafter that hands out sessions, in this process or over gRPC."""

    block_size: int  # the checkpoint's trained block size (the default)
    target_layer_ids: tuple[int, ...]  # the target layers whose hidden states it drafts from
    backend: str  # "mlx" | "torch" | "grpc:<addr>"

    def open_session(self, sampling: SamplingParams | None = None,
                     options: SessionOptions | None = None) -> DrafterSession: ...  # fmt: skip

    def open_session_now(self, sampling: SamplingParams | None = None,
                         options: SessionOptions | None = None) -> DrafterSession:  # fmt: skip
        """:meth:`open_session`, never refused for earlier failures: a take-over (``decode/takeover.py``) found a
        SERVING replica after one replica's loss put the whole drafter in backoff (in process: the same)."""

    def draft_batch(self, items: Sequence[tuple[DrafterSession, Aux, int, int]]) -> list[Draft | Exception]:
        """:meth:`DrafterSession.draft` of several of its sessions at once, each item ``(session, new aux, last
        token, block size)``: one forward where the backend can. One result per item, in order; an item's failure is
        its result alone."""

    def status(self) -> dict[str, str]:
        """What a server reports of it beyond its backend (a remote one: its reconnection state); may be empty."""
