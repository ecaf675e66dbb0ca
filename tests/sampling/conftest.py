"""A small-vocabulary pair (vocab 48, ids only) whose sampled outputs can be enumerated exactly."""

from __future__ import annotations

import pytest

from kakeya.core.contract import SamplingParams

SMALL_VOCAB = 48
PROMPT = [2, 10, 20]
BACKENDS = ["mlx", "torch"]
# Temperature 2 flattens the random target enough that the drafter (another random model) often
# disagrees with it, so rejections, residual draws and the broken rule all show.
SETTINGS = {
    "top-k": SamplingParams(2.0, top_k=6),
    "top-p": SamplingParams(2.0, top_p=0.6),
}


@pytest.fixture(scope="session")
def small_pair(tmp_path_factory):
    from kakeya.checkpoints.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("small_vocab"), vocab_size=SMALL_VOCAB)


@pytest.fixture(scope="session")
def small_models(small_pair):
    """{backend: (verifier, drafter)} on the small pair, loaded once (torch on one thread: 2 shared cores)."""
    import torch

    from kakeya.checkpoints.config import load_draft_config
    from kakeya.drafter.loader import local_drafter
    from kakeya.verifier.loader import local_verifier

    torch.set_num_threads(1)
    layers = load_draft_config(small_pair.draft)["dflash_config"]["target_layer_ids"]
    return {
        be: (local_verifier(str(small_pair.target), layers, be), local_drafter(str(small_pair.draft), str(small_pair.target), be))
        for be in BACKENDS
    }
