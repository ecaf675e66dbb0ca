"""Input validation: errors are ValueErrors that name the offending field."""

from __future__ import annotations

import dataclasses
import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

from kakeya.core.contract import Draft, Proposal
from kakeya.core.request import MAX_BLOCK_SIZE
from kakeya.drafter.local import MLXDrafter
from kakeya.drafter.mlx_backend.model import DFlashConfig, load_dflash_mlx

from .conftest import VARIANTS, draft_config, random_aux


@pytest.fixture(scope="module")
def drafter(pairs):
    p = pairs["full"]
    return MLXDrafter(p.draft, p.target)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"block_size": 0}, "block_size"),
        ({"block_size": 65}, "block_size"),
        ({"block_size": 4.0}, "block_size"),
        ({"block_size": True}, "block_size"),
        ({"last_token": -1}, "last_token"),
        ({"last_token": 1024}, "last_token"),
        ({"last_token": "a"}, "last_token"),
        ({"new_aux": "wide"}, "new_aux"),
        ({"new_aux": "narrow"}, "new_aux"),
        ({"new_aux": "1d"}, "new_aux"),
        ({"new_aux": "batch2"}, "new_aux"),
        ({"new_aux": "numpy"}, "new_aux"),
        ({"new_aux": "int"}, "new_aux"),
        ({"new_aux": "empty"}, "new_aux"),
    ],
)
def test_bad_inputs(drafter, kwargs, field):
    w = drafter.model.config.aux_width
    auxes = {
        "wide": random_aux(3, w + 1),
        "narrow": random_aux(3, w // 2),
        "1d": mx.zeros((w,)),
        "batch2": mx.zeros((2, 3, w)),
        "numpy": np.zeros((3, w), np.float32),
        "int": mx.zeros((3, w), dtype=mx.int32),
        "empty": mx.zeros((0, w)),
    }
    args = {"new_aux": random_aux(3, w), "last_token": 5, "block_size": 8}
    args.update(kwargs)
    if isinstance(args["new_aux"], str):
        args["new_aux"] = auxes[args["new_aux"]]
    s = drafter.open_session()
    with pytest.raises(ValueError, match=field):
        s.draft(args["new_aux"], args["last_token"], args["block_size"])
    assert s.stats().context_len == 0  # nothing was appended


def test_accepts_batched_aux_and_edge_sizes(drafter):
    w = drafter.model.config.aux_width
    s = drafter.open_session()
    assert len(s.draft(random_aux(4, w)[None], 3, MAX_BLOCK_SIZE).tokens) == MAX_BLOCK_SIZE - 1
    assert len(s.draft(mx.zeros((0, w)), 3, 2).tokens) == 1  # empty extend is fine after the first call
    assert s.stats().context_len == 4


def test_config_errors(tmp_path):
    cfg = draft_config(VARIANTS["full"])
    del cfg["dflash_config"]["target_layer_ids"]
    cfg.pop("num_target_layers", None)  # with it, the layers are spread over the target as the dflash package does
    with pytest.raises(ValueError, match="target_layer_ids"):
        DFlashConfig.from_dict(cfg)
    cfg = draft_config(VARIANTS["full"])
    cfg["architectures"] = ["DFlash2DraftModel"]
    with pytest.raises(ValueError, match="DFlash2"):
        DFlashConfig.from_dict(cfg)
    cfg = draft_config(VARIANTS["mixed"])
    cfg["sliding_window"] = None
    with pytest.raises(ValueError, match="sliding_window"):
        DFlashConfig.from_dict(cfg)


def test_mismatched_target_hidden(pairs, tmp_path):
    p = pairs["full"]
    target = tmp_path / "target"
    shutil.copytree(p.target, target)
    from safetensors.numpy import save_file

    save_file({"model.embed_tokens.weight": np.zeros((1024, 32), np.float32)}, str(target / "model.safetensors"))
    cfg = json.loads((target / "config.json").read_text())
    cfg["hidden_size"] = 32
    cfg["tie_word_embeddings"] = True
    (target / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="hidden_size"):
        load_dflash_mlx(p.draft, target)


def test_a_draft_is_a_frozen_value_with_one_proposal_row_per_candidate():
    d = Draft([5, 6, 7])
    assert d.tokens == (5, 6, 7) and d.proposal is None and d == Draft((5, 6, 7))
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.tokens = (1,)
    rows = Proposal(np.zeros((2, 4), np.int32), np.full((2, 4), 0.25, np.float32))
    assert len(Draft([5, 6], rows).proposal) == 2
    with pytest.raises(ValueError, match="proposal rows"):
        Draft([5, 6, 7], rows)
