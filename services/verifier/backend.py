"""The verifier's backend protocols: everything a session and the batch runner call on a target.

``TargetMLX`` and ``TargetTorch`` implement :class:`Target`. What only one backend has is a capability
declared as data, never probed for: ``static_verify`` (torch, :class:`StaticVerify`), ``restores`` (MLX,
:class:`Restores`: f_theta), and ``min_batch`` with ``SessionCaches.batchable`` / ``batch_key``. Every
forward is :meth:`Target.forward` over one or more :class:`Segment`: a session's own is a batch of one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol, runtime_checkable

from kakeya.core.contract import SLIDING
from kakeya.core.request import CachePolicy
from kakeya.verifier.layout import ForwardPlan, RingLayout


class SessionCaches:
    """A session's caches, in layer order, one per layer with its own K/V (``kinds``: each one's type): a ring on
    sliding layers, a full-attention cache on the others. They hold arrays only: no position counter (the ``RingLayout``
    is the one) and no plan. ``batchable``: whether a batched forward may take this set; ``batch_key``: sets of one key
    may share one."""

    batch_key: object = None

    def __init__(self, layers: list, kinds: Sequence[str], batchable: bool = True):
        self.layers = layers
        self.kinds = list(kinds)
        self.rings = [c for c, kind in zip(layers, kinds) if kind == SLIDING]
        self.fulls = [c for c, kind in zip(layers, kinds) if kind != SLIDING]
        self.batchable = batchable

    def arrays(self) -> list:
        return [a for c in self.layers for a in c.arrays()]

    def kv_bytes(self) -> dict:
        return {"sliding": sum(c.nbytes for c in self.rings), "full": sum(c.nbytes for c in self.fulls)}

    def copy(self, positions: int, copy: Callable) -> list[list]:
        """Every layer's arrays as they hold positions ``< positions``, each through the backend's ``copy``:
        a ring whole (its slots hold what the layout says), a full-attention cache's first ``positions``
        (its buffers may be longer). What a prefix snapshot keeps (``verifier/snapshot.py``)."""
        return [
            [copy(a) if kind == SLIDING else copy(a[:, :, :positions]) for a in layer.arrays()]
            for layer, kind in zip(self.layers, self.kinds)
        ]


@dataclass(frozen=True)
class Segment:
    """One session's block in a forward: its ids, its caches and aux layers, and its plan."""

    ids: Sequence[int]
    caches: SessionCaches
    aux_layers: tuple[int, ...]
    plan: ForwardPlan


@dataclass
class Forward:
    """What a forward hands back per segment (no LM head: logits are taken only where needed)."""

    hidden: Any  # final-norm hidden states [1, L, hidden]
    aux: Any  # the aux layers' outputs [L, len(aux_layers) * hidden], or None without aux layers


class ModelShape(Protocol):
    """The hyper-parameters a session reads (both backends' model args have them)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    sliding_window: int


class Latents(Protocol):
    """f_theta's latent codes of one session, one row per slot of its latent layout (``make_latent_ring``)."""

    data: Any  # [slots, latent_dim], slot order
    nbytes: int

    def write(self, plan: ForwardPlan, z) -> None:
        """The latent codes ``z`` of a forward's positions, into the slots its latent-layout ``plan`` says."""

    def materialize(self) -> None: ...

    def copy(self) -> Any:
        """Every slot's codes, as a prefix snapshot keeps them."""

    def load(self, data) -> None:
        """A snapshot's codes (:meth:`copy`), copied in."""


@runtime_checkable
class Target(Protocol):
    """A loaded target model as a verifier backend."""

    backend: str  # "mlx" | "torch"
    args: ModelShape
    sampler: ModuleType  # a sampling session's p, acceptance test and draws (backends/<backend>/sampling.py)
    static_verify: bool  # implements StaticVerify
    restores: bool  # implements Restores
    min_batch: int

    @property
    def device_name(self) -> str: ...

    @property
    def dtype_name(self) -> str: ...

    def make_cache(self, layout: RingLayout, policy: CachePolicy) -> SessionCaches:
        """A new session's caches: rings sized by ``layout``, full-attention caches as ``policy`` says."""

    def release_cache(self, caches: SessionCaches) -> None:
        """A closed session's caches; a backend may keep them for the next session."""

    def forward(self, segments: Sequence[Segment]) -> list[Forward]:
        """Run every segment's block through the body in one pass, each writing its own caches as its
        plan says; one :class:`Forward` per segment, in order."""

    def logits(self, hidden) -> Any: ...

    def greedy(self, hidden) -> list[int]:
        """The argmax at every position of ``hidden`` [1, L, H]: the one host sync of a verify."""

    def concat(self, arrays: Sequence, axis: int) -> Any: ...

    def materialize(self, out: Forward, caches: SessionCaches) -> None:
        """Evaluate what a lazy backend has only recorded (between prefill chunks)."""

    def copy_caches(self, caches: SessionCaches, positions: int) -> list[list]:
        """Copies of ``caches`` as they hold positions ``< positions`` (``SessionCaches.copy``): a prefix
        snapshot, which nothing the session does later changes."""

    def load_caches(self, caches: SessionCaches, saved: list[list], positions: int) -> None:
        """A new session's ``caches`` set to a copy of a snapshot's (:meth:`copy_caches`)."""


@runtime_checkable
class StaticVerify(Protocol):
    """A target with a static-shape greedy verify step (``Target.static_verify``)."""

    def static_length(self, n: int, slack: int) -> int:
        """The length a block of ``n`` runs at in the static step (padded up to a bucket within ``slack``)."""

    def verify_static(
        self, ids: Sequence[int], caches: SessionCaches, aux_layers: tuple[int, ...], plan: ForwardPlan
    ) -> tuple[list[int], Any]:
        """A greedy verify of ``ids`` (planned at :meth:`static_length`): ``(choices, aux of ids)``."""

    def verify_segments(self, segments: Sequence[Segment], greedy: Sequence[bool]) -> tuple[list[Forward], list]:
        """:meth:`Target.forward` of ``segments`` plus, for each segment whose ``greedy`` is True, the argmax
        after each of its positions (None for the others): every greedy row in one argmax, one host sync."""


@runtime_checkable
class Restores(Protocol):
    """A target that restores evicted sliding-layer K/V with f_theta (``Target.restores``)."""

    def restorer(self, path) -> Any:
        """The f_theta at ``path``, loaded once per target and checked against it."""

    def make_latent_ring(self, layout: RingLayout, restorer) -> Latents: ...

    def encode_latents(self, restorer, aux, aux_layers: Sequence[int]) -> Any: ...


def cat(target: Target, chunks: Sequence) -> Any:
    """Aux rows of several forwards, in order."""
    return chunks[0] if len(chunks) == 1 else target.concat(chunks, 0)


def greedy_rows(target: Target, outs: Sequence[Forward], wanted: Sequence[bool]) -> list[list[int] | None]:
    """``target.greedy`` of every ``wanted`` forward's rows through one LM head and one host sync, split
    back per forward (None for the others)."""
    rows = [j for j, w in enumerate(wanted) if w]
    picks: list = [None] * len(outs)
    if rows:
        hs = [outs[j].hidden for j in rows]
        flat, at = target.greedy(hs[0] if len(hs) == 1 else target.concat(hs, 1)), 0
        for j in rows:
            n = outs[j].hidden.shape[1]
            picks[j], at = flat[at : at + n], at + n
    return picks
