"""Load a DFlash drafter into this process on one backend (each backend imported only when chosen)."""

from __future__ import annotations

from pathlib import Path

from kakeya.core.contract import Drafter


def local_drafter(draft_dir: str | Path, target_dir: str | Path, backend: str = "mlx", **kwargs) -> Drafter:
    """The in-process drafter for ``backend`` (``device=``/``dtype=`` for torch)."""
    if backend == "mlx":
        from kakeya.drafter.local import MLXDrafter as Loaded
    elif backend == "torch":
        from kakeya.drafter.local import TorchDrafter as Loaded
    else:
        raise ValueError(f"unknown drafter backend {backend!r} (expected 'mlx' or 'torch')")
    drafter = Loaded(draft_dir, target_dir, **kwargs)
    drafter.model_name = str(draft_dir)
    return drafter
