"""Few-row linear layers: how long ``F.linear`` takes per row count, beside the same product
spelled other ways, so the next GPU run can tell which one a verify/draft step should use.

A verify of L tokens multiplies L rows (1..16) by every weight matrix. At one row cuBLAS
runs a GEMV; at a few rows in float32 the H200 run picked FFMA GEMMs that took ~43 us for
8 rows of the demo pair (docs/cuda.md). Variants, all computing ``x @ w.T`` for ``x``
[rows, in] and ``w`` [out, in]:

* ``linear``      -- ``F.linear(x, w)`` (what the models call);
* ``matmul_wT``   -- ``x @ wt`` with ``wt = w.T.contiguous()`` made once (the other layout);
* ``w_matmul_xT`` -- ``(w @ x.T).T``: rows on the GEMM's narrow side;
* ``per_row_mv``  -- one ``torch.mv`` per row (GEMVs; launch-bound, the floor at one row);

Each is checked against ``linear`` (a wrong variant is reported, not timed) and timed as
the median of ``--reps`` calls, synchronised per call on CUDA.

    python benchmarks/small_gemm.py --device cuda                 # demo-pair and 26B-shape weights
    python benchmarks/small_gemm.py --device cpu --reps 20        # anywhere
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: record.py, the results' one writer
from record import write_result

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "small_gemm.json"
ROWS = (1, 2, 4, 5, 8, 16)
# (name, in, out): the demo pair's linears (float32) and the 26B-A4B target's dense ones (bf16)
SHAPES = {
    "float32": [
        ("demo qkv", 128, 4 * 32 + 2 * 2 * 32),
        ("demo gate_up", 128, 768),
        ("demo down", 384, 128),
        ("demo lm_head", 128, 1024),
        ("demo draft mlp", 128, 1024),
    ],
    "bfloat16": [
        ("26B qkv (sliding)", 2816, 16 * 256 + 2 * 8 * 256),
        ("26B o", 16 * 256, 2816),
        ("26B gate_up", 2816, 2 * 2112),
        ("26B down", 2112, 2816),
    ],
}


def variants(w: torch.Tensor) -> dict:
    wt = w.T.contiguous()
    return {
        "linear": lambda x: F.linear(x, w),
        "matmul_wT": lambda x: x @ wt,
        "w_matmul_xT": lambda x: (w @ x.T).T,
        "per_row_mv": lambda x: torch.stack([torch.mv(w, r) for r in x]),
    }


def timed(fn, x, reps: int, device: torch.device) -> float:
    for _ in range(3):
        fn(x)
    samples = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn(x)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    rows_out = []
    with torch.inference_mode():
        for dtype_name, shapes in SHAPES.items():
            dtype = getattr(torch, dtype_name)
            for name, n_in, n_out in shapes:
                w = (torch.randn(n_out, n_in, generator=g) * n_in**-0.5).to(device, dtype)
                fns = variants(w)
                for rows in ROWS:
                    x = torch.randn(rows, n_in, generator=g).to(device, dtype)
                    ref = fns["linear"](x).float()
                    row = {"weight": name, "dtype": dtype_name, "in": n_in, "out": n_out, "rows": rows, "us": {}}
                    for vname, fn in fns.items():
                        if not torch.allclose(fn(x).float(), ref, rtol=2e-2, atol=2e-2):
                            row["us"][vname] = "wrong result"
                            continue
                        row["us"][vname] = timed(fn, x, args.reps, device)
                    timed_ok = {k: v for k, v in row["us"].items() if isinstance(v, float)}
                    row["fastest"] = min(timed_ok, key=timed_ok.get)
                    rows_out.append(row)
                    print(
                        f"{name:20s} {dtype_name:8s} rows {rows:2d}  "
                        + "  ".join(
                            f"{k} {v:7.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row["us"].items()
                        )
                    )
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    out = {
        "benchmark": "small_gemm",
        "device": str(device),
        "device_name": name,
        "torch": torch.__version__,
        "reps": args.reps,
        "unit": "us per call, median",
        "results": rows_out,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
