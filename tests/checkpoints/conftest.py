"""Shared fixtures: each tiny checkpoint is generated once per test session."""

from __future__ import annotations

import importlib

import pytest

from kakeya.checkpoints.tiny import TinyPair, make_tiny


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> TinyPair:
    return make_tiny(tmp_path_factory.mktemp("tiny") / "seed0", seed=0, sliding_window=32)


@pytest.fixture(scope="session")
def tiny_moe_pair(tmp_path_factory) -> TinyPair:
    return make_tiny(tmp_path_factory.mktemp("tiny") / "moe", seed=0, sliding_window=32, moe=True)


@pytest.fixture(scope="session")
def mlx_target(tiny_pair):
    mlx_lm = importlib.import_module("mlx_lm")
    return mlx_lm.load(str(tiny_pair.target))


@pytest.fixture
def local_hub(monkeypatch):
    """Make dflash.model_mlx.load_draft resolve a local directory instead of the hub."""
    dm = importlib.import_module("dflash.model_mlx")
    monkeypatch.setattr(dm, "snapshot_download", lambda repo_id, **kwargs: repo_id)
    return dm
