"""MLX's products on Linux go to torch's optimized BLAS (``backends/mlx/blas.py``), checked in fresh processes.

MKL_VERBOSE=1 makes MKL print a line for every call it serves, so "SGEMM" in a process's output says that
MLX's matrix product reached torch's MKL (and ``NThr`` how many threads it ran on); its absence says it stayed
on MLX's own reference BLAS.
"""

import os
import platform
import subprocess
import sys

import pytest

pytest.importorskip("mlx.core")

linux_x86 = pytest.mark.skipif(
    sys.platform != "linux" or platform.machine() != "x86_64",
    reason="torch's x86-64 Linux wheel carries MKL; elsewhere MLX keeps its own BLAS (macOS: Accelerate)",
)

PRODUCT = """
import numpy as np
import mlx.core as mx
from kakeya.backends.mlx import blas
a = np.arange(4 * 64, dtype=np.float32).reshape(4, 64) / 100
b = np.arange(64 * 32, dtype=np.float32).reshape(64, 32) / 100
out = np.array(mx.array(a) @ mx.array(b))
assert np.allclose(out, a @ b, rtol=1e-5), "wrong product"
print("state:", blas.state)
"""


def run(code: str, **env) -> str:
    full = {k: v for k, v in os.environ.items() if k not in ("MKL_NUM_THREADS", "KAKEYA_MLX_BLAS")} | env
    done = subprocess.run(
        [sys.executable, "-c", code], env=full | {"MKL_VERBOSE": "1"}, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@linux_x86
def test_mlx_products_reach_torchs_blas_once_a_backend_is_imported():
    out = run("import kakeya.verifier.mlx_backend.target\n" + PRODUCT)
    assert "state: torch" in out
    assert "SGEMM" in out


@linux_x86
def test_the_thread_pin_reaches_mlxs_products():
    code = (
        "from kakeya.orchestrator.assembly import set_torch_threads\n"
        "import kakeya.drafter.mlx_backend.model\n"
        "assert set_torch_threads(None, None, True, 'mlx') == 1\n" + PRODUCT
    )
    out = run(code)
    assert "SGEMM" in out and "NThr:1" in out


def test_reference_blas_on_request():
    out = run("import kakeya.verifier.mlx_backend.target\n" + PRODUCT, KAKEYA_MLX_BLAS="reference")
    assert "SGEMM" not in out
    assert "MLX's own BLAS" in out


def test_mlx_imported_first_stays_on_its_own_blas_and_still_computes():
    out = run("import mlx.core\nimport kakeya.verifier.mlx_backend.target\n" + PRODUCT)
    assert "SGEMM" not in out
    assert "own BLAS" in out


@linux_x86
def test_on_the_route_the_demo_pair_decodes_losslessly():
    """What a user runs (README command 1 on MLX, products in torch's MKL): speculative equals AR on the demo
    pair, and the products ran in MKL."""
    env = {k: v for k, v in os.environ.items() if k not in ("MKL_NUM_THREADS", "KAKEYA_MLX_BLAS")}
    done = subprocess.run(
        [sys.executable, "-m", "kakeya.app.main", "generate", "--backend", "mlx", "--compare-ar", "--max-tokens", "48"],
        env=env | {"MKL_VERBOSE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "SGEMM" in done.stdout  # MKL_VERBOSE's lines
    summary = [ln for ln in done.stderr.splitlines() if ln.startswith("speculative (")]
    assert summary and "lossless (48/48 tokens identical)" in summary[0], done.stderr[-2000:]


def test_an_unknown_choice_is_refused_by_name():
    """The README's KAKEYA_MLX_BLAS=reference mistyped is one error line naming the variable, exit 2, as
    KAKEYA_MALLOC's and KAKEYA_LOG_LEVEL's are; it ran on torch's BLAS, the one it was set to avoid."""
    env = {k: v for k, v in os.environ.items() if k != "KAKEYA_MLX_BLAS"} | {"KAKEYA_MLX_BLAS": "refrence"}
    argv = [sys.executable, "-m", "kakeya.app.main", "generate", "--backend", "mlx", "--max-tokens", "2"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().startswith("kakeya: error: KAKEYA_MLX_BLAS") and "refrence" in done.stderr, done.stderr
