"""The contract between the accept/trim loop and its backends.

Everything the loop, the sessions, the remote stubs, the servers and the
engine agree on lives here and nowhere else: the ``Verifier``/``Drafter``
protocols, the facts a verifier publishes (``ModelInfo``), the cache policy
and the options a session is opened with, the block-size limit, and the
request and stats types. It imports nothing from ``services``: every package
may depend on it, it depends on none of them. Its wire form is
``services/wire/convert.py``.

Aux hidden states are opaque to the loop: whatever the verifier returns
(an ``mx.array``, a ``torch.Tensor``, an encoded proto tensor) is handed to
the drafter unchanged. Token ids are plain Python ints.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Protocol, Sequence

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

# The largest block a loop drafts, a verifier verifies and a drafter drafts,
# and so the ring's rollback slack: one number for every layer.
MAX_BLOCK_SIZE = 16

Aux = Any  # [n_positions, len(target_layer_ids) * hidden] in the backend's own array type


def check_block_size(block_size: int) -> None:
    if not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"block_size must be between 1 and {MAX_BLOCK_SIZE}, got {block_size}")


MAX_PREDRAFT_ALTERNATIVES = 4  # the most next-likeliest tokens a pre-draft prepares for at each candidate


def check_alternatives(n: int, field: str = "alternatives") -> int:
    if not 0 <= n <= MAX_PREDRAFT_ALTERNATIVES:
        raise ValueError(f"{field} must be 0..{MAX_PREDRAFT_ALTERNATIVES}, got {n}")
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


@dataclass(frozen=True)
class CachePolicy:
    """How a session bounds its sliding-layer K/V. Full-attention layers always stay exact (S5).

    ``native``: the model's own sliding window, no sinks. Not bounded as a
    whole: full-attention layers still grow with the context.
    ``sink-window``: ``sink`` first positions are kept forever, plus a window of
    ``window`` positions (including the query itself).
    """

    kind: str = "native"
    sink: int = 0
    window: int | None = None  # None: the model's sliding_window
    slack: int = MAX_BLOCK_SIZE  # largest block that can be verified and rolled back exactly
    full_kv_bits: int = 0  # 0: exact full-attention K/V; 4 or 8: affine-quantized
    full_kv_group_size: int = 64  # capped at the full layers' head dim
    restore: str | None = None  # an f_theta directory: restore evicted sliding positions (sink-window only)

    def resolve(self, model_window: int) -> "CachePolicy":
        """Fill in the model's defaults and check the values; raise ValueError naming the field."""
        if self.kind not in ("native", "sink-window"):
            raise ValueError(f"cache policy kind must be 'native' or 'sink-window', got {self.kind!r}")
        if self.full_kv_bits not in (0, 4, 8):
            raise ValueError(f"full_kv_bits must be 0 (exact), 4 or 8, got {self.full_kv_bits}")
        if self.full_kv_group_size not in (32, 64, 128):
            raise ValueError(f"full_kv_group_size must be 32, 64 or 128, got {self.full_kv_group_size}")
        if not 1 <= self.slack <= MAX_BLOCK_SIZE:
            raise ValueError(f"slack must be 1..{MAX_BLOCK_SIZE} (the largest block), got {self.slack}")
        if self.restore is not None and (self.kind != "sink-window" or not str(self.restore)):
            raise ValueError("restore (an f_theta directory) needs kind 'sink-window': full layers stay exact (S5)")
        if self.kind == "native":
            if self.sink or self.window not in (None, model_window):
                raise ValueError("the native policy takes no sink/window: use kind 'sink-window'")
            return replace(self, sink=0, window=model_window)
        window = self.window if self.window is not None else model_window
        if window < 1 or self.sink < 0:
            raise ValueError(f"sink-window needs window >= 1 and sink >= 0 (got window={window}, sink={self.sink})")
        if self.restore is not None and window >= model_window:
            raise ValueError(
                f"restore needs a window smaller than the model's sliding window {model_window} "
                f"(got window={window}): nothing is evicted that the model would still attend to"
            )
        return replace(self, window=window)

    @property
    def label(self) -> str:
        """A short name for reports, e.g. ``sink-window(4+64)+kv8``."""
        name = self.kind if self.kind == "native" else f"sink-window({self.sink}+{self.window})"
        return name + (f"+kv{self.full_kv_bits}" if self.full_kv_bits else "") + ("+restore" if self.restore else "")


# How many of its most probable tokens a drafter keeps per candidate under the rejection rule: the
# proposal q' it samples from (and sends) is its processed distribution truncated to these and
# renormalised. The acceptance rule is exact for ANY proposal it was really sampled from; a
# smaller K only costs acceptance where the drafter's tail mattered.
PROPOSAL_TOP_K = 32

# The sampling rules (``services/core/sampling.py``). Coupled (the default): every token is
# argmax(processed logits + G(seed, position, token)), the drafter proposes with the same noise
# and the verifier keeps the candidates equal to its own choices, so the output is AR sampling
# with that seed, token for token, whatever the drafter or the block schedule. Rejection: the
# drafter samples from a proposal it sends and the verifier accepts with min(1, p/q'); exact in
# distribution, but its tokens depend on the drafter's proposals and the block sizes.
COUPLED, REJECTION = "coupled", "rejection"
SAMPLING_RULES = (COUPLED, REJECTION)

# The smallest temperature that samples (0 is greedy). Below it logits / temperature can leave
# float32's range (1e-39 makes every logit infinite): such a request is refused, naming the field.
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How the target's next-token distribution p is processed and sampled.

    p = softmax(logits / temperature) restricted by top-k, then top-p (the
    smallest most-probable set reaching ``top_p``; the top token always stays),
    then min-p (tokens with p >= ``min_p * max p``), renormalised. Temperature 0
    is greedy: argmax, no randomness, token-identical to greedy AR. ``seed``
    seeds the sampling (None: the engine draws one); ``rule`` is how
    speculative blocks sample (:data:`COUPLED` or :data:`REJECTION`).
    """

    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off
    seed: int | None = None
    rule: str = COUPLED

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def filtered(self) -> bool:
        """Whether top-k, top-p or min-p may cut p's support (else it is all of the vocabulary)."""
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0

    def check(self) -> "SamplingParams":
        """Raise ValueError naming the bad field; return self."""
        t = self.temperature
        if not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if 0 < t < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {t!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if not (isinstance(self.min_p, (int, float)) and 0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**64):
            raise ValueError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        if self.rule not in SAMPLING_RULES:
            raise ValueError(f"rule must be one of {', '.join(SAMPLING_RULES)}, got {self.rule!r}")
        return self

    def seeded(self) -> "SamplingParams":
        """These params with a seed: an unseeded sampling request draws one here (and reports it)."""
        if self.greedy or self.seed is not None:
            return self
        import secrets

        return replace(self, seed=secrets.randbits(63))

    @property
    def label(self) -> str:
        if self.greedy:
            return "greedy"
        parts = [f"temperature {self.temperature:g}"]
        parts += [f"top-k {self.top_k}"] if self.top_k else []
        parts += [f"top-p {self.top_p:g}"] if self.top_p < 1 else []
        parts += [f"min-p {self.min_p:g}"] if self.min_p > 0 else []
        return ", ".join(parts + [f"{self.rule} rule"])


GREEDY = SamplingParams()


@dataclass(frozen=True)
class Proposal:
    """The distributions a drafter actually sampled its candidates from (compact).

    Row i is candidate i's proposal q'_i: ``ids`` [n, K] (int32) and ``probs``
    [n, K] (float32, summing to 1 per row), numpy arrays. Tokens outside a row's
    ids have probability 0 under it. Never a full-vocabulary tensor.
    """

    ids: Any
    probs: Any

    def __post_init__(self):
        if self.ids.shape != self.probs.shape or self.ids.ndim != 2:
            raise ValueError(f"proposal ids {self.ids.shape} and probs {self.probs.shape} must both be [n, K]")

    def __len__(self) -> int:
        return self.ids.shape[0]


@dataclass(frozen=True)
class Verdict:
    """What a verifier decided about one block: :func:`accept` applied to its choices, committed."""

    accepted: int  # candidates accepted (0 .. len(block) - 1)
    next_token: int  # the verifier's choice after them: opens the next block (not in the cache yet)
    aux: Aux  # aux of the kept positions (the block's first ``accepted + 1``): the drafter's new context


@dataclass(frozen=True)
class Draft:
    """What a drafter proposes for one block: its candidate ids and, under the rejection rule, the
    :class:`Proposal` row each candidate was drawn from (None: greedy argmax, or coupled
    candidates, which are the drafter's noisy argmax and need nothing beside them)."""

    tokens: tuple[int, ...]
    proposal: Proposal | None = None

    def __post_init__(self):
        object.__setattr__(self, "tokens", tuple(self.tokens))  # any sequence of ids in, an immutable value out
        if self.proposal is not None and len(self.proposal) != len(self.tokens):
            raise ValueError(f"a draft of {len(self.tokens)} candidates cannot carry {len(self.proposal)} proposal rows")


@dataclass(frozen=True)
class Predrafts:
    """A pre-draft's blocks: each one's candidates, by the verdict ``(accepted, next_token)`` it assumes."""

    blocks: dict[tuple[int, int], tuple[int, ...]]

    def after(self, accepted: int, next_token: int) -> tuple[int, ...] | None:
        return self.blocks.get((accepted, next_token))  # None: a miss, draft afresh


def accept(candidates: Sequence[int], choices: Sequence[int]) -> tuple[int, int]:
    """THE acceptance rule, one definition for greedy and every sampling rule: ``(accepted, next_token)``.

    ``choices[i]`` is the verifier's token after block position ``i`` (one more
    than there are candidates). The leading run of candidates equal to their
    choice is accepted; the choice right after that run is the next token (the
    bonus after a full run, the correction at the first mismatch), so a block
    commits between 1 and ``len(candidates) + 1`` tokens. Greedy choices are the
    target's argmax; a sampling rule's choices already encode its acceptance and
    draws (``VerifierSession.decide``), so the same rule commits its tokens.
    """
    n = 0
    for candidate, choice in zip(candidates, choices):
        if candidate != choice:
            break
        n += 1
    return n, int(choices[n])


def session_rng(seed: int, stream: int):
    """The random stream of one rejection-rule session: ``stream`` 0 the verifier, 1 the drafter.

    Host-side numpy PCG64 from the request's seed, so every backend and every
    deployment (colocated, split, mixed) consumes identical uniforms.
    """
    import numpy as np

    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed, spawn_key=(stream,))))


VERIFIER_STREAM, DRAFTER_STREAM = 0, 1


class Cancellation:
    """A flag set once, from any thread (a client went away); ``on_cancel`` hooks run when it is.

    A remote session registers how to end its stream, so a cancelled request
    frees the backends' sessions at once, even while a step waits on one.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._hooks: list[Callable[[], None]] = []
        self.cancelled = False

    def on_cancel(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` when cancelled (now, if that already happened)."""
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
    """What one request tells the sessions it opens, beyond cache policy and sampling.

    A remote session uses all of it: the request id travels with its stream,
    the client's deadline bounds it, the verifier reserves ``max_positions``,
    and ``cancel`` ends the stream. An in-process session accepts the options
    and ignores them: its steps run on the caller's (or the compute) thread, so
    a cancelled run simply stops calling it and closes it.
    """

    request_id: str = ""
    timeout: float | None = None  # seconds the session may live (the client's deadline); None: no bound
    max_positions: int = 0  # prompt + max_tokens: the most positions it will hold; 0: the server's limit
    cancel: Cancellation | None = None


class VerifierSession(Protocol):
    """One generation's verifier state: its KV cache lives exactly as long as this object."""

    def prefill(self, prompt_ids: Sequence[int]) -> tuple[int, Aux]:
        """Run the prompt; return the target's next token (greedy, or sampled from p when the
        session samples) and the prompt's aux hidden states."""

    def decide(self, last_token: int, draft: Draft) -> Verdict:
        """Verify the block ``[last_token, *draft.tokens]`` in ONE forward and commit its outcome.

        The session takes its choice after every position of the block and applies
        :func:`accept` to them. Greedy: the target's argmax. Coupled sampling: the
        argmax of the noisy processed logits (no proposal), the very token AR
        sampling with this seed picks there. Rejection sampling (``draft.proposal``
        holds the drafter's q'_i of candidate i): candidate i if accepted
        (probability min(1, p_i(x)/q'_i(x))), at the first rejection a sample from
        norm(max(0, p_i - q'_i)), never the rejected candidate, after all accepted
        a sample from p at the last position. It keeps the accepted positions
        (``last_token`` and the accepted candidates) in its cache, trims the rest
        exactly, and returns the :class:`Verdict`, with the kept positions' aux
        (captured by the forward, never recomputed). One step, so a remote
        verifier costs one round trip.
        """

    def stats(self) -> dict:
        """Live session facts, e.g. ``{"kv_bytes": {"sliding": n, "full": m}}``."""

    def close(self) -> None: ...


class DrafterSession(Protocol):
    """One generation's drafter state: the DFlash context K/V cache."""

    def draft(self, new_aux: Aux, last_token: int, block_size: int) -> Draft:
        """Extend the context cache with ``new_aux`` and propose ``block_size - 1`` tokens.

        A greedy session's candidates are its argmax, a coupled one's the argmax
        of its noisy processed logits (the verifier's noise at the same
        positions); a rejection-rule session samples each candidate from its
        proposal q'_i and its :class:`Draft` carries the proposals.

        ``new_aux`` holds the aux of every position committed since the last
        call (the whole prompt on the first call). ``last_token`` is the newest
        committed token, which the verifier has not seen yet: it opens the block.
        """

    def predraft(self, new_aux: Aux | None, block_ids: Sequence[int], block_size: int,
                 alternatives: int = 0) -> Callable[[], Predrafts]:
        """Start drafting the block after ``block_ids`` (being verified now) for the likeliest verdicts:
        extend the context with ``new_aux`` as :meth:`draft` does (None: nothing new), then draft in one
        forward the next block for each verdict it prepares for (:class:`Predrafts`): all of ``block_ids``
        accepted and its guess of the next token; with ``alternatives`` = k, also the likeliest rejections
        at a candidate with one of its k next likeliest tokens there (capped). Their context lacks ``block_ids``' aux
        (the verdict's goes with the next call). Returns at once; the result waits. Greedy sessions only."""

    def close(self) -> None: ...


class Verifier(Protocol):
    """A target that hands out sessions: in this process (``verifier/session.py``) or over gRPC
    (``orchestrator/remote.py``). What the public API needs of it is here, so no caller asks
    which one it holds."""

    info: ModelInfo  # also the limits: max_position_embeddings, max_context
    aux_layers: tuple[int, ...]  # the layers whose hidden states its sessions return (the drafter's)
    # Its sessions' default cache policy. A restoration source in it is named as this verifier's
    # clients name it: a directory in process, the source name the verifier server publishes over gRPC.
    policy: CachePolicy

    def open_session(
        self, policy: CachePolicy | None = None, sampling: SamplingParams | None = None, options: SessionOptions | None = None
    ) -> VerifierSession:
        """A new session; ``policy`` overrides the verifier's default; ``sampling`` None: greedy."""

    def healthy(self, timeout: float = 1.0) -> bool:
        """Whether it answers now (a remote one: its health check within ``timeout``)."""


class Drafter(Protocol):
    """A DFlash drafter that hands out sessions, in this process or over gRPC."""

    block_size: int  # the checkpoint's trained block size (the default)
    target_layer_ids: tuple[int, ...]  # the target layers whose hidden states it drafts from
    backend: str  # "mlx" | "torch" | "grpc:<addr>"

    def open_session(self, sampling: SamplingParams | None = None, options: SessionOptions | None = None) -> DrafterSession: ...

    def status(self) -> dict[str, str]:
        """What a server reports of it beyond its backend (a remote one: its reconnection state); may be empty."""


@dataclass
class Request:
    """One generation, as every front (CLI, public API, benchmarks) hands it to the engine.

    Token ids in: turning text into ids, and cutting the streamed text at
    ``stop_strings``, is the front's work with the engine's codec.
    """

    prompt_ids: list[int]
    max_tokens: int = 128
    block_size: int = 0  # 0: auto, sized block by block (``orchestrator/adaptive.py``)
    stop_ids: Sequence[int] = ()  # besides the model's EOS ids, unless ``ignore_eos``
    stop_strings: Sequence[str] = ()
    ignore_eos: bool = False
    cache_policy: CachePolicy | None = None  # None: the verifier's default
    sampling: SamplingParams = GREEDY  # unseeded: the engine draws the seed (and reports it)
    request_id: str = ""  # for logs and the backends' streams
    max_block_size: int = MAX_BLOCK_SIZE  # the largest block auto may pick (the cache policy may cap it lower)


@dataclass
class Block:
    """What one step of the loop committed (the prefill's first token is a block of its own)."""

    tokens: list[int]
    drafted: int  # candidates proposed (0 for the prefill token and block size 1)
    accepted: int  # candidates accepted
    draft_s: float = 0.0
    verify_s: float = 0.0  # the verifier's one step: verify and commit
    total_s: float = 0.0
    predrafted: bool = False  # its candidates were pre-drafted while the block before it was verified
    copied: bool = False  # its candidates were copied from earlier in the context (``orchestrator/ngram.py``)


@dataclass
class Generation:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    blocks: list[Block] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens resumed from a prefix cache's snapshot instead of prefilled
    finish_reason: str = "length"  # "stop" | "length"
    prefill_s: float = 0.0
    decode_s: float = 0.0
    drafter_fallback: bool = False  # the drafter failed and the verifier finished alone
    predrafts: int = 0  # pre-drafts started (the blocks with ``predrafted`` set are the ones used)
    verifier_stats: dict = field(default_factory=dict)  # the verifier session's stats() at the end
    sampling: SamplingParams = GREEDY  # as run: with the seed used when sampling

    @property
    def acceptance_lengths(self) -> list[int]:
        """Tokens committed per speculative block (the prefill token is not a block)."""
        return [len(b.tokens) for b in self.blocks[1:]]

    @property
    def mean_acceptance(self) -> float:
        lengths = self.acceptance_lengths
        return sum(lengths) / len(lengths) if lengths else 0.0

    @property
    def decode_tok_s(self) -> float:
        """Tokens after the first one, per second of decoding (the first comes from prefill)."""
        n = len(self.token_ids) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0
