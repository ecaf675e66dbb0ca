"""benchmarks/suite.py end to end on the tiny pair: every row is there, lossless, and the split rows time the wire."""

from __future__ import annotations

import json

from benchmarks import suite


def test_suite_runs_every_configuration_losslessly(tmp_path, tiny_pair):
    out = tmp_path / "suite.json"
    argv = [
        "--target",
        str(tiny_pair.target),
        "--draft",
        str(tiny_pair.draft),
        "--block-sizes",
        "1",
        "4",
        "--prompts",
        "1",
        "--prompt-len",
        "16",
        "--max-tokens",
        "12",
        "--repeats",
        "1",
        "--torch",
        "--split",
        "--out",
        str(out),
    ]
    assert suite.main(argv) == 0
    res = json.loads(out.read_text())
    assert res["mlx_lm_ar"]["identical_to_kakeya"]
    for b in ("1", "4"):
        assert res["kakeya_mlx"][b]["identical_to_block1"]
        assert res["kakeya_torch"][b]["identical_to_mlx"]
        assert res["kakeya_split"][b]["identical_to_colocated"]
        split = res["kakeya_split"][b]["block_ms_median"]
        assert split["wire"] > 0 and split["verify"] > 0  # the network share is separated out
        assert res["kakeya_mlx"][b]["block_ms_median"]["wire"] == 0
    assert res["dflash"]["4"]["gap_b"]["identical_to_ar"] and res["dflash"]["4"]["sqrt_hidden_scale"]["identical_to_ar"]
    assert set(res["efficiency"]) == {"4"} and res["torch_threads"] == 1
    for f in res["plots"]:
        assert (tmp_path / f).stat().st_size > 1000
