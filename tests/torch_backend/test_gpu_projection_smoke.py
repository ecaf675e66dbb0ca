"""Smoke test of benchmarks/gpu_projection.py: --small on the CPU, JSON has every key."""

from __future__ import annotations

import json
import math


def test_small_run_writes_projection_json(tmp_path, benchmark_script):
    gp = benchmark_script("gpu_projection")
    out = tmp_path / "gp.json"
    argv = ["--small", "--device", "cpu", "--dtype", "float32", "--reps", "1", "--ctx", "80", "--out", str(out)]
    assert gp.main(argv) == 0
    d = json.loads(out.read_text())
    for key in (
        "device",
        "dtype",
        "ctx",
        "target_shape",
        "drafter_shape",
        "params",
        "formula",
        "t_ar_ms",
        "t_verify_ms",
        "t_draft_ms",
        "projected_speedup",
        "best_block_per_tau",
        "kv_bytes",
    ):
        assert key in d, key
    assert d["small"] is True and d["device"] == "cpu" and d["ctx"] == 80
    assert sorted(map(int, d["t_verify_ms"])) == list(range(1, 17))
    assert sorted(map(int, d["t_draft_ms"])) == list(range(1, 17)) and d["t_draft_ms"]["1"] == 0.0
    assert sorted(map(int, d["projected_speedup"])) == list(range(1, 9))
    for tau, row in d["projected_speedup"].items():
        assert min(map(int, row)) == int(tau)  # a block commits at most L tokens
        for L, s in row.items():
            expect = int(tau) * d["t_ar_ms"] / (d["t_draft_ms"][L] + d["t_verify_ms"][L])
            assert math.isclose(s, expect, rel_tol=1e-9) and s > 0
    assert d["target_shape"]["enable_moe_block"] and d["target_shape"]["attention_k_eq_v"]
    assert d["device_name"] and d["cuda_graphs"] is False
    r = d["roofline"]
    assert sorted(map(int, r["per_L"])) == [1, 2, 4, 8, 16] and r["bandwidth_bytes_s"] is None  # a CPU: no HBM figure
    k, E = d["target_shape"]["top_k_experts"], d["target_shape"]["num_experts"]
    for L, row in r["per_L"].items():
        assert math.isclose(row["experts_touched"], 1 - (1 - k / E) ** int(L))
        assert math.isclose(
            row["bytes"], r["weight_bytes"]["dense"] + row["experts_touched"] * r["weight_bytes"]["experts"]
        )
        assert row["t_verify_ms"] == d["t_verify_ms"][L]
    g = d["agreement_with_own_ar"]
    assert g["fraction_identical"] == 1.0 and g["first_divergence"] is None  # float32: lossless


def test_roofline_with_a_stated_bandwidth(tmp_path, benchmark_script):
    gp = benchmark_script("gpu_projection")
    out = tmp_path / "gp.json"
    argv = [
        "--small",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--reps",
        "1",
        "--ctx",
        "40",
        "--agree-tokens",
        "4",
        "--bandwidth-tbs",
        "3.35",
        "--out",
        str(out),
    ]
    assert gp.main(argv) == 0
    r = json.loads(out.read_text())["roofline"]
    assert r["bandwidth_bytes_s"] == 3.35e12
    row = r["per_L"]["16"]
    assert math.isclose(row["roofline_ms"], row["bytes"] / 3.35e12 * 1e3)
    assert math.isclose(row["over_roofline"], row["t_verify_ms"] / row["roofline_ms"])
    assert gp.hbm_bandwidth("NVIDIA H200") == 4.8e12 and gp.hbm_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert math.isclose(gp.expert_fraction(16, 8, 128), 0.643, abs_tol=1e-3)  # issue #10: ~64 % at L = 16


def test_full_shape_is_gemma4_26b_a4b(benchmark_script):
    gp = benchmark_script("gpu_projection")
    s = gp.GEMMA4_26B_A4B
    assert (s["hidden_size"], s["num_hidden_layers"], s["vocab_size"]) == (2816, 30, 262144)
    assert (s["num_experts"], s["top_k_experts"], s["moe_intermediate_size"]) == (128, 8, 704)
    assert (s["head_dim"], s["global_head_dim"], s["num_attention_heads"]) == (256, 512, 16)
    assert (s["num_key_value_heads"], s["num_global_key_value_heads"], s["sliding_window"]) == (8, 2, 1024)
    assert s["layer_types"].count("full_attention") == 5 and s["layer_types"][-1] == "full_attention"
    assert gp.DRAFT_26B["num_hidden_layers"] == 5


def test_full_shape_parameter_counts_match_the_published_model(benchmark_script):
    """25.2B total / 3.8B active (gemma-4-26B-A4B's published figures), ~0.4B drafter; meta tensors only."""
    import torch

    from kakeya.drafter.torch_backend.model import DFlashDraftModel
    from kakeya.verifier.torch_backend.gemma4 import Gemma4Args, Gemma4Text

    gp = benchmark_script("gpu_projection")
    with torch.device("meta"):
        m = Gemma4Text(Gemma4Args(**gp.GEMMA4_26B_A4B))
        d = DFlashDraftModel(gp.draft_config(gp.DRAFT_26B, gp.GEMMA4_26B_A4B["vocab_size"]))
    total = sum(b.numel() for b in m.buffers())
    experts = sum(l.moe.gate_up.numel() + l.moe.down.numel() for l in m.layers)
    active = total - experts * (1 - 8 / 128)
    assert abs(total / 1e9 - 25.2) < 0.1 and abs(active / 1e9 - 3.8) < 0.1
    assert 0.35 < sum(p.numel() for p in d.parameters()) / 1e9 < 0.5


def test_top_ops_name_the_product_a_step_computes(benchmark_script):
    """--profile's op table runs a static step eagerly (a graph replay hides its ops) and groups
    device time by op and input shapes, so a slow GEMM is named with its shapes."""
    import torch

    from kakeya.backends.torch.graphs import GraphedStep

    gp = benchmark_script("gpu_projection")
    a, b = torch.randn(8, 128), torch.randn(128, 2048)
    step = GraphedStep(lambda x, y: torch.relu(x @ y), [a, b], capture=False)
    replay = GraphedStep.__call__
    rows = gp.top_ops(lambda: step(), torch.device("cpu"), calls=2)
    assert GraphedStep.__call__ is replay  # put back
    mm = [r for r in rows if r["op"] == "aten::mm"]
    assert mm and mm[0]["input_shapes"] == "[[8, 128], [128, 2048]]" and mm[0]["count_per_call"] == 1
    assert all(r["ms_per_call"] > 0 for r in rows) and rows == sorted(rows, key=lambda r: -r["ms_per_call"])
