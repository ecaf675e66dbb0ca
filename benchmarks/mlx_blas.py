"""MLX's float32 matrix products on this CPU: on MLX's own BLAS and on the one Kakeya routes them to.

MLX's Linux CPU wheel links netlib's reference BLAS; ``services/backends/mlx/blas.py`` sends MLX's products
to the optimized BLAS torch carries (MKL on x86-64). This times ``x @ w`` for ``x`` [rows, in] and ``w``
[in, out] at the demo pair's shapes and one larger one, 1..64 rows, one fresh process per BLAS
(``KAKEYA_MLX_BLAS=reference`` keeps MLX's own; the route works only before ``mlx.core`` loads), one BLAS
thread, medians of ``--reps`` calls. What a batched round needs from it: that 8 rows cost much less than
8 times one row.

    python benchmarks/mlx_blas.py            # writes benchmarks/results/mlx_blas.json
    python benchmarks/mlx_blas.py --quantized 4 --out benchmarks/results/mlx_quantized_matmul.json

``--quantized BITS``: the same products on weights packed as ``mlx_lm.convert -q`` packs them
(``mx.quantize``, group size 64; ``mx.quantized_matmul``, which no BLAS serves), in one process -- what
a verify block of a quantized target costs against one row of mlx-lm's plain decoding.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: record.py, the results' one writer
from record import write_result

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "mlx_blas.json"
ROWS = (1, 2, 4, 8, 16, 32, 64)
SHAPES = [("demo gate_up", 128, 768), ("demo down", 384, 128), ("demo lm_head", 128, 1024), ("1024 square", 1024, 1024)]

CHILD = """
import json, statistics, sys, time
import kakeya.backends.mlx  # routes (or not, as KAKEYA_MLX_BLAS says) before mlx.core loads
from kakeya.backends.mlx import blas
import mlx.core as mx
shapes, rows_list, reps, bits = json.loads(sys.argv[1])
out = {"state": blas.state, "us": {}}
for name, n_in, n_out in shapes:
    w = mx.random.normal((n_in, n_out), key=mx.random.key(0))
    if bits:
        wq, scales, biases = mx.quantize(w.T, group_size=64, bits=bits)
        product = lambda x: mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=64, bits=bits)
    else:
        product = lambda x: x @ w
    for rows in rows_list:
        x = mx.random.normal((rows, n_in), key=mx.random.key(1))
        mx.eval(x, w)
        for _ in range(3):
            mx.eval(product(x))
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            mx.eval(product(x))
            samples.append(time.perf_counter() - t0)
        out["us"][f"{name}|{rows}"] = statistics.median(samples) * 1e6
print(json.dumps(out))
"""


def measure(blas: str, reps: int, bits: int = 0) -> dict:
    env = dict(os.environ, MKL_NUM_THREADS="1", OMP_NUM_THREADS="1")
    env.pop("KAKEYA_MLX_BLAS", None)  # unset: torch's BLAS (any value but "reference" is refused)
    env |= {"KAKEYA_MLX_BLAS": "reference"} if blas == "reference" else {}
    arg = json.dumps([SHAPES, ROWS, reps, bits])
    done = subprocess.run([sys.executable, "-c", CHILD, arg], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--quantized", type=int, choices=[4, 8], help="time mx.quantized_matmul at these bits instead")
    args = p.parse_args(argv)
    if args.quantized:
        return quantized(args)
    runs = {name: measure(name, args.reps) for name in ("reference", "torch")}
    results = []
    for name, n_in, n_out in SHAPES:
        one = {b: runs[b]["us"][f"{name}|1"] for b in runs}
        for rows in ROWS:
            us = {b: runs[b]["us"][f"{name}|{rows}"] for b in runs}
            row = {
                "shape": name,
                "in": n_in,
                "out": n_out,
                "rows": rows,
                "us": us,
                "x_one_row": {b: us[b] / one[b] for b in us},
                "speedup": us["reference"] / us["torch"],
            }
            results.append(row)
            print(
                f"{name:14s} rows {rows:2d}  reference {us['reference']:9.1f} us ({row['x_one_row']['reference']:5.1f}x"
                f" one row)  torch's {us['torch']:8.1f} us ({row['x_one_row']['torch']:5.1f}x)  {row['speedup']:5.1f}x faster"
            )
    out = {
        "benchmark": "mlx_blas",
        "machine": platform.machine(),
        "processor": platform.processor(),
        "route": {b: runs[b]["state"] for b in runs},
        "unit": "us per product, median; x_one_row: the time over the same shape's one-row time",
        "reps": args.reps,
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, out)
    print(f"wrote {args.out}")
    return 0


def quantized(args) -> int:
    from record import write_result

    us = measure("torch", args.reps, args.quantized)["us"]
    results = []
    for name, n_in, n_out in SHAPES:
        one = us[f"{name}|1"]
        for rows in ROWS:
            t = us[f"{name}|{rows}"]
            results.append({"shape": name, "in": n_in, "out": n_out, "rows": rows, "us": t, "x_one_row": t / one})
            print(f"{name:14s} rows {rows:2d}  {t:9.1f} us ({t / one:5.1f}x one row)")
    out = {
        "benchmark": "mlx_quantized_matmul",
        "bits": args.quantized,
        "group_size": 64,
        "unit": "us per mx.quantized_matmul, median; x_one_row: the time over the same shape's one-row time",
        "reps": args.reps,
        "results": results,
    }
    write_result(args.out, out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
