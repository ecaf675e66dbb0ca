"""Give MLX on Linux an optimized BLAS: the one torch already carries.

MLX's Linux CPU wheels link netlib's *reference* BLAS, whose time grows linearly with a product's rows, so nothing
batches. Loading torch's BLAS (MKL on x86-64, exporting ``sgemm_`` and friends) into the global symbol scope *before*
``mlx.core`` is imported sends MLX's products there (not on macOS). MKL rounds a row differently with its batch's size,
so a long greedy run can part from AR at a near-tie; ``KAKEYA_MLX_BLAS=reference`` keeps MLX's own (row-exact, slow;
the exactness tests run on it). MLX calls the BLAS from its own thread, so :func:`set_threads` sets MKL's process-wide
default before its first call.
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
    if (choice := os.environ.get(ENV, "")).lower() not in ("", "reference"):  # a typo must not run the other BLAS
        raise ValueError(f"{ENV} must be 'reference' (MLX's own BLAS) or unset (torch's), got {choice!r}")
    if sys.platform != "linux":
        state = "not linux: MLX's own BLAS"
    elif choice.lower() == "reference":
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
