"""The contract between the accept/trim loop and its backends.

Everything the loop, the sessions, the remote stubs, the servers and the
engine agree on lives here and nowhere else: the ``Verifier``/``Drafter``
protocols, the facts a verifier publishes (``ModelInfo``), the cache policy
a session is opened with, the block-size limit, and the request and stats
types. It imports nothing from ``services``: every package may depend on it,
it depends on none of them. Its wire form is ``services/wire/contract.py``.

Aux hidden states are opaque to the loop: whatever the verifier returns
(an ``mx.array``, a ``torch.Tensor``, an encoded proto tensor) is handed to
the drafter unchanged. Token ids are plain Python ints.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Protocol, Sequence

# The largest block a loop drafts, a verifier verifies and a drafter drafts,
# and so the ring's rollback slack: one number for every layer.
MAX_BLOCK_SIZE = 16

Aux = Any  # [n_positions, len(target_layer_ids) * hidden] in the backend's own array type


def check_block_size(block_size: int) -> None:
    if not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"block_size must be between 1 and {MAX_BLOCK_SIZE}, got {block_size}")


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


class VerifierSession(Protocol):
    """One generation's verifier state: its KV cache lives exactly as long as this object."""

    def prefill(self, prompt_ids: Sequence[int]) -> tuple[int, Aux]:
        """Run the prompt; return the target's greedy next token and the prompt's aux hidden states."""

    def verify(self, block_ids: Sequence[int]) -> list[int]:
        """Append ``block_ids`` to the cache in ONE forward.

        Returns the target's greedy choice after each block position
        (``len(block_ids)`` ints). The block stays pending until ``commit``.
        """

    def commit(self, n_keep: int) -> Aux:
        """Keep the first ``n_keep`` positions of the pending block, trim the rest exactly.

        Returns the aux hidden states of the kept positions (captured by the
        verify forward, never recomputed).
        """

    def stats(self) -> dict:
        """Live session facts, e.g. ``{"kv_bytes": {"sliding": n, "full": m}}``."""

    def close(self) -> None: ...


class DrafterSession(Protocol):
    """One generation's drafter state: the DFlash context K/V cache."""

    def draft(self, new_aux: Aux, last_token: int, block_size: int) -> list[int]:
        """Extend the context cache with ``new_aux`` and propose ``block_size - 1`` tokens.

        ``new_aux`` holds the aux of every position committed since the last
        call (the whole prompt on the first call). ``last_token`` is the newest
        committed token, which the verifier has not seen yet: it opens the block.
        """

    def close(self) -> None: ...


class Verifier(Protocol):
    info: ModelInfo

    def open_session(self, policy: CachePolicy | None = None) -> VerifierSession:
        """A new session; ``policy`` overrides the verifier's default."""


class Drafter(Protocol):
    block_size: int  # the checkpoint's trained block size (the default)

    def open_session(self) -> DrafterSession: ...


@dataclass
class Request:
    """One generation as the engine takes it (token ids; text is the engine's codec's job)."""

    prompt_ids: list[int]
    max_tokens: int = 128
    block_size: int = 0  # 0: the drafter's trained block size
    stop_ids: Sequence[int] = ()
    ignore_eos: bool = False
    cache_policy: CachePolicy | None = None  # None: the verifier's default


@dataclass
class Block:
    """What one step of the loop committed (the prefill's first token is a block of its own)."""

    tokens: list[int]
    drafted: int  # candidates proposed (0 for the prefill token and block size 1)
    accepted: int  # candidates accepted
    draft_s: float = 0.0
    verify_s: float = 0.0
    commit_s: float = 0.0
    total_s: float = 0.0


@dataclass
class Generation:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    blocks: list[Block] = field(default_factory=list)
    finish_reason: str = "length"  # "stop" | "length"
    prefill_s: float = 0.0
    decode_s: float = 0.0
    drafter_fallback: bool = False  # the drafter failed and the verifier finished alone
    verifier_stats: dict = field(default_factory=dict)  # the verifier session's stats() at the end

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
