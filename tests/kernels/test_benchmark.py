"""benchmarks/kernels.py: a GPU benchmark that refuses a CPU, and whose every case (the kernel
and its eager counterpart) runs -- here under the interpreter, at the small projection shape --
so the first GPU run does not find a broken case."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the kernels need triton (Linux only; no macOS wheels)")


def test_refuses_a_cpu(capsys, benchmark_script):
    bench = benchmark_script("kernels")
    assert bench.main(["--device", "cpu"]) == 2
    assert "GPU benchmark" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="on a GPU"):
        bench.measure_kernels(torch.device("cpu"))


def test_every_case_runs(device, benchmark_script):
    bench = benchmark_script("kernels")
    from gpu_projection import SMALL  # benchmarks/ is on the path: the benchmark imports its shapes from there

    names = set()
    with torch.inference_mode():
        for c in bench.cases(SMALL, 2, 40, device, torch.bfloat16):
            c.kernel()
            c.eager()
            assert c.bytes > 0 and c.rows == 2
            names.add(c.name)
    assert names == {
        "norm.add_rms_norm",
        "rope.qkv_norm_rope.sliding",
        "rope.qkv_norm_rope.full",
        "attention.sliding",
        "attention.full",
        "moe.route",
        "moe.experts",
        "head.softcap_argmax",
    }
