"""Fixtures for the f_theta tests: a freshly initialised (untrained) f_theta for the tiny pair.

Untrained weights are enough for everything but the trainer tests: they
restore *something* different from the truth, which is what makes "only the
evicted sliding positions change" observable.
"""

import pytest

WINDOW, SINK = 16, 4  # the tiny target's own window is 32


@pytest.fixture(scope="session")
def draft_model(tiny_pair):
    from kakeya.drafter.mlx_backend.model import load_dflash_mlx

    return load_dflash_mlx(tiny_pair.draft, tiny_pair.target)


@pytest.fixture(scope="session")
def ftheta_dir(tmp_path_factory, tiny_pair, mlx_target, draft_model):
    from kakeya.verifier.mlx_backend.ftheta import Restorer

    out = tmp_path_factory.mktemp("ftheta")
    Restorer.init(
        mlx_target, draft_model, rank=16, draft_dir=tiny_pair.draft, target_dir=tiny_pair.target, seed=1
    ).save(out)
    return out


@pytest.fixture(scope="session")
def restore_policy(ftheta_dir):
    from kakeya.core.request import CachePolicy

    return CachePolicy("sink-window", sink=SINK, window=WINDOW, restore=str(ftheta_dir))
