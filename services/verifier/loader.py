"""Load a target into this process on one backend (each backend imported only when chosen)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kakeya.core.contract import Verifier


def local_verifier(target_dir: str | Path, aux_layers: Sequence[int], backend: str = "mlx", **kwargs) -> Verifier:
    """The in-process verifier for ``backend``: ``policy=`` for both, ``device=``/``dtype=`` for torch."""
    if backend == "mlx":
        from kakeya.verifier.local import mlx_verifier

        return mlx_verifier(target_dir, aux_layers, **kwargs)
    if backend == "torch":
        from kakeya.verifier.torch_backend.target import torch_verifier

        return torch_verifier(target_dir, aux_layers, **kwargs)
    raise ValueError(f"unknown verifier backend {backend!r} (expected 'mlx' or 'torch')")
