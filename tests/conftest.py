"""Fixtures shared across the suite: the embedded tiny pair, loaded once."""

import pytest


@pytest.fixture(scope="session")
def tiny_pair():
    from kakeya.checkpoints.tiny import default_pair

    return default_pair()


@pytest.fixture(scope="session")
def mlx_target(tiny_pair):
    from kakeya.verifier.mlx_backend.target import TargetMLX

    return TargetMLX.load(tiny_pair.target)


@pytest.fixture(scope="session")
def aux_layers(tiny_pair):
    from kakeya.checkpoints.config import load_draft_config

    return tuple(load_draft_config(tiny_pair.draft)["dflash_config"]["target_layer_ids"])


@pytest.fixture(scope="session")
def demo_pair():
    """The trained demo pair (services/models/demo): shipped in the repo, so its absence is a failure."""
    from kakeya.checkpoints.tiny import demo_pair as _demo

    pair = _demo()
    assert pair is not None, "trained demo pair missing from services/models/demo"
    return pair
