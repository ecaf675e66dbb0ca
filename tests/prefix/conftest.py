"""Fixtures of the prefix-cache tests: the tiny pair's targets on both backends, an untrained f_theta."""

import pytest


@pytest.fixture(scope="session")
def torch_target(tiny_pair):
    from kakeya.verifier.torch_backend.target import TargetTorch

    return TargetTorch.load(tiny_pair.target)


@pytest.fixture(scope="session")
def static_torch_target(tiny_pair):
    """The torch target with the static step's CUDA shapes (whole buffers, buckets), run eagerly on the CPU."""
    from kakeya.backends.torch.graphs import BUCKETS, GraphOptions
    from kakeya.verifier.torch_backend.target import TargetTorch

    return TargetTorch.load(
        tiny_pair.target, graph_options=GraphOptions(capture=False, buckets=BUCKETS, static_extent=True)
    )


@pytest.fixture(scope="session")
def ftheta_dir(tmp_path_factory, tiny_pair, mlx_target):
    from kakeya.drafter.mlx_backend.model import load_dflash_mlx
    from kakeya.verifier.mlx_backend.ftheta import Restorer

    draft = load_dflash_mlx(tiny_pair.draft, tiny_pair.target)
    out = tmp_path_factory.mktemp("ftheta")
    Restorer.init(mlx_target, draft, rank=16, draft_dir=tiny_pair.draft, target_dir=tiny_pair.target, seed=1).save(out)
    return out
