"""Load a DFlash drafter into this process on one backend (each backend imported only when chosen)."""

from __future__ import annotations

from pathlib import Path

from kakeya.core.contract import Drafter


def local_drafter(draft_dir: str | Path, target_dir: str | Path, backend: str = "mlx", **kwargs) -> Drafter:
    """The in-process drafter for ``backend`` (``device=``/``dtype=`` for torch)."""
    if backend == "mlx":
        from kakeya.drafter.local import MLXDrafter

        return MLXDrafter(draft_dir, target_dir, **kwargs)
    if backend == "torch":
        from kakeya.drafter.local import TorchDrafter

        return TorchDrafter(draft_dir, target_dir, **kwargs)
    raise ValueError(f"unknown drafter backend {backend!r} (expected 'mlx' or 'torch')")
