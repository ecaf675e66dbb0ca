"""The recall pair (``services/models/recall``): what the bounded verifier cache costs in recall, pinned per
policy on the pair that can recall (issue 61; docs/ftheta.md, "The recall pair").

A few (context, depth) cases of ``kakeya niah`` through the MLX engine, greedy: a change that breaks the
full-attention layers' exact K/V, the quantized full-layer K/V or restoration fails here, not only in
``benchmarks/niah_recall.py``'s grid (the figures: ``benchmarks/results/niah_recall_*.json``)."""

from pathlib import Path

import pytest

import kakeya.models
from kakeya.orchestrator.niah import parse_policy, run_niah

RECALL = Path(kakeya.models.__file__).parent / "recall"
SINK = 4


def engine_for(pair: str):
    from kakeya.orchestrator.assembly import build_local_engine

    return build_local_engine(str(RECALL / pair / "target"), str(RECALL / pair / "draft"), "mlx")


def recall_of(engine, contexts, depths, names, window: int, restore=None) -> dict:
    policies = {n: parse_policy(n, SINK, window, restore) for n in names}
    return run_niah(engine, contexts, depths, policies, max_tokens=8)


@pytest.fixture(scope="module")
def gemma():
    return engine_for("gemma")


def test_gemma_shaped_target_recalls_far_past_its_window_under_every_bounded_policy(gemma):
    """Window 32; needles up to ~240 tokens back: the full layers (exact under every policy) carry recall, so
    a sink + window of 16 (half the model's) and its 8-bit full-layer K/V recall as native does."""
    assert gemma.verifier.info.sliding_window == 32
    out = recall_of(gemma, [128, 256], [0.0, 0.5], ["native", "sink-window", "sink-window+kv8"], window=16)
    far = [c["needle_distance"] for c in out["native"]["cases"]]
    assert max(far) > 4 * 32  # the needles lie well outside every sliding window
    for name in ("native", "sink-window", "sink-window+kv8"):
        assert out[name]["recall"] == 1.0, (name, [c["output"] for c in out[name]["cases"]])


@pytest.fixture(scope="module")
def slide():
    return engine_for("slide")


def test_all_sliding_target_recalls_only_within_the_window_it_is_given(slide):
    """Every layer slides (window 128): a needle 62 tokens back is recalled under ``native`` and a sink + window
    of 64, one 89 back only under ``native`` (the sink-window evicted it: the band only f_theta could restore),
    and one 177 back under neither (past the model's own window; a sliding layer that saw farther would)."""
    from kakeya.checkpoints.config import load_target_config

    assert set(load_target_config(RECALL / "slide" / "target")["layer_types"]) == {"sliding_attention"}
    assert slide.verifier.info.sliding_window == 128
    out = recall_of(slide, [128, 192], [0.0, 0.5], ["native", "sink-window"], window=64)
    out["sink-window@32"] = recall_of(slide, [128, 192], [0.0, 0.5], ["sink-window"], window=32)["sink-window"]
    by = {name: {c["needle_distance"]: c["recalled"] for c in out[name]["cases"]} for name in out}
    assert sorted(by["native"]) == [62, 89, 138, 177]
    assert by["native"] == {62: True, 89: True, 138: False, 177: False}
    assert by["sink-window"] == {62: True, 89: False, 138: False, 177: False}
    assert not any(by["sink-window@32"].values())


def test_all_sliding_target_recalls_a_band_needle_only_with_ftheta(slide):
    """The band (64, 128]: a needle 89 tokens back is evicted by a sink + window of 64 and brought back by f_theta
    restoring the model's own window; one 138 back lies past that window, where nothing restores it."""
    restore = str(RECALL / "slide" / "ftheta")
    out = recall_of(slide, [128, 160], [0.0], ["sink-window", "sink-window+restore"], window=64, restore=restore)
    by = {name: {c["needle_distance"]: c["recalled"] for c in out[name]["cases"]} for name in out}
    assert by["sink-window"] == {89: False, 138: False}
    assert by["sink-window+restore"] == {89: True, 138: False}, [
        c["output"] for c in out["sink-window+restore"]["cases"]
    ]
