"""Trainers: ``target`` (``kakeya train-target``), ``drafter`` (``kakeya train-drafter``, on ``block_trainer``;
measured by ``drafter_eval``, rendered by ``card``), ``ftheta`` (``kakeya train-ftheta``); ``data`` and
``retrieval`` the corpus; ``common`` the shared plumbing (progress, resumable state, reports)."""

import kakeya.backends.mlx  # noqa: F401 - first: routes MLX's BLAS on Linux before mlx.core loads
