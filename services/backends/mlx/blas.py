"""Give MLX on Linux an optimized BLAS: the one torch already carries.

MLX's Linux CPU wheels (``mlx[cpu]``) link netlib's *reference* BLAS, a plain triple loop: a float32
matrix product runs at 2-4 GFLOP/s and its time grows linearly with its rows, so a batched verify of
eight sessions costs eight single ones and nothing batches (docs/benchmarks.md, "Many streams"). The
torch wheel Kakeya installs beside it carries an optimized BLAS (MKL on x86-64) and exports its Fortran
entry points (``sgemm_``, ...). The reference ``cblas_sgemm`` MLX calls is a thin wrapper over
``sgemm_``, resolved through the process's global symbol scope, so loading torch's library there
*before* ``mlx.core`` is imported sends MLX's products to torch's BLAS: 5x faster for one row, and
sublinear in rows (``benchmarks/mlx_blas.py``). Nothing changes on macOS (MLX uses Accelerate and the
GPU there), nor when ``mlx.core`` was imported first (it stays correct, on the reference loop).

What it costs: MKL computes a product of 1-3 rows with other kernels than one of 4 or more, so a row's result
can differ in its last bits with the size of its batch (the reference loop's never does; torch's own CPU
products behave as MKL's). A verify of a block and an AR step of the same row then agree to float32
rounding rather than bit for bit, and a long greedy run can part from AR at a near-tie: on the tiny random
pair with f_θ restoration, at token 401 of 600 (a top-2 logit gap of 1.5e-3), where the demo pair's runs
stayed identical (``tests/verifier/test_mlx_blas.py``; the benchmarks' lossless checks). The test suite
runs MLX on the reference BLAS for its exactness tests (``tests/conftest.py``).

``KAKEYA_MLX_BLAS=reference`` keeps MLX's own BLAS: row-exact, and slow.

Its thread count is not torch's: torch pins MKL's threads per calling thread, and MLX calls the BLAS
from a thread of its own, so :func:`set_threads` (``--torch-threads``, the same policy as torch's) sets
MKL's process-wide default, which MKL reads at its first call.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys

ENV = "KAKEYA_MLX_BLAS"

# What route() did: "torch" (MLX's BLAS calls go to torch's library), or why not.
state = "not tried"


def route() -> str:
    """Route MLX's BLAS to torch's optimized one when that can be done here (see the module's text)."""
    global state
    if state != "not tried":
        return state
    if sys.platform != "linux":
        state = "not linux: MLX's own BLAS"
    elif os.environ.get(ENV, "").lower() == "reference":
        state = f"{ENV}=reference: MLX's own BLAS"
    elif "mlx.core" in sys.modules:
        state = "mlx.core was imported first: MLX's own BLAS"
    else:
        state = _load_torch_blas()
    return state


def _load_torch_blas() -> str:
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return "torch is not installed: MLX's own BLAS"
    path = os.path.join(os.path.dirname(spec.origin), "lib", "libtorch_cpu.so")
    try:
        lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        return f"torch's library did not load ({exc}): MLX's own BLAS"
    if not hasattr(lib, "sgemm_"):  # a torch build that keeps its BLAS to itself
        return "torch's library exports no BLAS: MLX's own BLAS"
    return "torch"


def set_threads(n: int | None) -> None:
    """Pin the routed BLAS to ``n`` threads (None or 0: its default, as many as the cores) unless the user's
    ``MKL_NUM_THREADS`` says otherwise; takes effect only before MLX's first matrix product."""
    if n and sys.platform == "linux":
        os.environ.setdefault("MKL_NUM_THREADS", str(n))
