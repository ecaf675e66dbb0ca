"""Checkpoints and loaded models shared by the torch backend tests (float32, CPU)."""

from __future__ import annotations

import pytest
import torch

from kakeya.checkpoints.tiny import make_tiny

from .ckpt import make_features_target

AUX_LAYERS = (1, 4)  # the tiny drafter's target_layer_ids
PROMPT = [2, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60]


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """make_tiny(): gemma4_text target (window 32, k_eq_v full layers) + DFlash draft."""
    return make_tiny(tmp_path_factory.mktemp("torch_tiny"), seed=0, sliding_window=32)


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("torch_tiny_moe"), seed=0, sliding_window=32, moe=True)


@pytest.fixture(scope="session")
def features_target(tmp_path_factory):
    """PLE + KV sharing + double-wide MLP + tied head, written by transformers."""
    return make_features_target(tmp_path_factory.mktemp("torch_features") / "target")


@pytest.fixture(scope="session")
def features_mm_target(tmp_path_factory):
    """The same weights under the multimodal ``model.language_model.`` names."""
    return make_features_target(tmp_path_factory.mktemp("torch_features_mm") / "target", multimodal_names=True)


@pytest.fixture(scope="session")
def torch_target(tiny):
    from kakeya.verifier.torch_backend.target import TargetTorch

    return TargetTorch.load(tiny.target, "cpu", "float32")


@pytest.fixture(scope="session")
def torch_drafter(tiny):
    from kakeya.drafter.local import TorchDrafter

    return TorchDrafter(tiny.draft, tiny.target, "cpu", "float32")


@pytest.fixture(scope="package", autouse=True)
def _one_thread():
    """Tiny models: one intra-op thread is fastest (and does not fight a shared CPU)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
