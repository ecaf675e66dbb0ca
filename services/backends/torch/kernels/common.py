"""What every kernel family shares: rounding and transcendental functions spelled the same on a GPU and under Triton's
interpreter, and the launch checks.

The kernels compute in float32 and round to the activation dtype where each eager torch op rounds. The interpreter (the
CPU tests' only way to run a kernel) truncates a float32 -> bfloat16 cast where a GPU rounds to nearest even, and its
``tl.dot`` multiplies bfloat16 bit patterns as integers. So bfloat16 is rounded here in integer arithmetic, and on the
CPU a dot's operands are widened to float32 first (exact: a bfloat16 product fits in float32).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def tl_dtype(t: torch.Tensor) -> tl.dtype:
    """The Triton dtype of an activation tensor (float32, bfloat16 or float16)."""
    try:
        return TL_DTYPES[t.dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {t.dtype} (expected one of {sorted(map(str, TL_DTYPES))})") from None


def interpreted() -> bool:
    """Whether kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, read when triton decorates them)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def check_device(*tensors: torch.Tensor | None) -> torch.device:
    """The one device of ``tensors`` (Nones skipped): CUDA, or the CPU under the interpreter."""
    devices = {t.device for t in tensors if t is not None}
    if len(devices) != 1:
        raise ValueError(f"tensors on several devices: {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type != "cuda" and not (device.type == "cpu" and interpreted()):
        raise ValueError(f"Triton kernels run on CUDA tensors (or CPU ones under TRITON_INTERPRET=1), got {device}")
    return device


def dot_dtype(t: torch.Tensor) -> tl.dtype:
    """The dtype a kernel's ``tl.dot`` takes its operands in: the tensor's own on a GPU, float32 on the
    CPU (the interpreter's dot is wrong for bfloat16; widening a 16-bit operand changes no value)."""
    return tl.float32 if t.device.type == "cpu" else tl_dtype(t)


def dot_precision(t: torch.Tensor) -> str:
    """float32 operands multiply in IEEE float32 (what torch's float32 matmul does by default), not TF32."""
    return "ieee" if t.dtype == torch.float32 or t.device.type == "cpu" else "tf32"


@functools.cache
def programs_wanted(device: torch.device) -> int:
    """Programs a launch should spread its work over: two waves on every SM of a GPU; a few on the
    CPU, where the interpreter runs them one by one (enough to exercise a split's reduction)."""
    if device.type != "cuda":
        return 4
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """float32 ``x`` rounded to nearest even in ``DTYPE`` (what a torch op's output does), as ``DTYPE``."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        nan = (bits & 0x7FFFFFFF) > 0x7F800000
        bits = tl.where(nan, bits | 0x400000, bits + 0x7FFF + ((bits >> 16) & 1))  # a NaN stays a (quiet) NaN
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)


@triton.jit
def rounded(x, DTYPE: tl.constexpr):
    """``x`` rounded to ``DTYPE`` and widened back to float32: the value an eager op in ``DTYPE`` yields."""
    return round_to(x, DTYPE).to(tl.float32)


@triton.jit
def tanh(x):
    """float32 tanh from ``exp`` (triton.language has none, and the interpreter no libdevice): within
    about 1e-7 of torch's, absolutely (so relatively coarse only near 0)."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def gelu_tanh(x):
    """torch's ``gelu(x, approximate="tanh")`` in float32, the same formula."""
    return 0.5 * x * (1.0 + tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))
