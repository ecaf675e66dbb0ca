"""What the accept/trim loop needs from a verifier and a drafter.

The loop (``loop.py``) only ever sees these protocols, so colocated (in-process)
and split (gRPC) deployments run the very same code: the difference is only
which implementation is handed to it.

Aux hidden states are opaque to the loop: whatever the verifier returns
(an ``mx.array``, a ``torch.Tensor``, an encoded proto tensor) is handed to the
drafter unchanged. Token ids are plain Python ints.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

Aux = Any  # [n_positions, len(target_layer_ids) * hidden] in the backend's own array type


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

    def open_session(self, policy=None) -> VerifierSession:
        """A new session; ``policy`` (a ``services.verifier.cache.CachePolicy``) overrides the default."""


class Drafter(Protocol):
    block_size: int  # the checkpoint's trained block size (the default)

    def open_session(self) -> DrafterSession: ...


def local_verifier(target_dir, aux_layers, backend: str = "mlx", **kwargs) -> Verifier:
    """The in-process verifier for ``backend`` (imported lazily: each backend is optional)."""
    if backend == "mlx":
        from services.verifier.session import mlx_verifier

        return mlx_verifier(target_dir, aux_layers, **kwargs)
    if backend == "torch":
        from services.verifier.model_torch import torch_verifier

        return torch_verifier(target_dir, aux_layers, **kwargs)  # policy=, device=, dtype=
    raise ValueError(f"unknown verifier backend {backend!r} (expected 'mlx' or 'torch')")


def local_drafter(draft_dir, target_dir, backend: str = "mlx", **kwargs) -> Drafter:
    """The in-process DFlash drafter for ``backend``."""
    from services.drafter.session import MLXDrafter, TorchDrafter

    if backend == "mlx":
        return MLXDrafter(draft_dir, target_dir, **kwargs)
    if backend == "torch":
        return TorchDrafter(draft_dir, target_dir, **kwargs)  # device=, dtype=
    raise ValueError(f"unknown drafter backend {backend!r} (expected 'mlx' or 'torch')")


def remote_verifier(addr: str, **kwargs) -> Verifier:
    """A verifier served by ``kakeya serve verifier`` at ``addr`` (HOST:PORT), over gRPC."""
    from .remote import GrpcVerifier

    return GrpcVerifier(addr, **kwargs)


def remote_drafter(addr: str, **kwargs) -> Drafter:
    """A drafter served by ``kakeya serve drafter`` at ``addr`` (HOST:PORT), over gRPC."""
    from .remote import GrpcDrafter

    return GrpcDrafter(addr, **kwargs)
