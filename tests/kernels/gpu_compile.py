"""Compile every kernel for a GPU without a GPU: ``test_gpu_compile.py`` runs this in a subprocess.

Triton's interpreter runs a kernel's Python; Triton's compiler refuses things the interpreter
accepts (a global that is not a constexpr, a dot smaller than an MMA tile, a loop-carried value
changing type) and is what a GPU runs. So each launch the entry points make at gemma-4-26B-A4B's
shapes is compiled here instead of run: a stand-in CUDA driver names the target, CPU tensors stand
in for CUDA ones (a compile sees only their dtypes and alignment), the launch stops after the
compile, and the launch-side choices are the GPU's (16-bit dot operands, an H100's SM count).

    python -m tests.kernels.gpu_compile [ARCH]     # ARCH 90 (Hopper) by default; prints what compiled
"""

from __future__ import annotations

import os
import sys

import torch

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    raise SystemExit("gpu_compile compiles kernels: run it without TRITON_INTERPRET")

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase
from triton.backends.nvidia.driver import ty_to_cpp
from triton.runtime.jit import JITFunction

from kakeya.backends.torch.kernels import attention, common, head, moe, norm, rope

H100_SMS = 132


class StandInCuda(DriverBase):
    """Just enough of a CUDA driver for Triton to pick a target and compile for it."""

    def __init__(self, arch: int):
        super().__init__()
        self.arch = arch

    @classmethod
    def is_active(cls):
        return True

    def map_python_to_cpp_type(self, ty):
        return ty_to_cpp(ty)

    def get_current_target(self):
        return GPUTarget("cuda", self.arch, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_benchmarker(self):
        raise NotImplementedError("compile only")

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def compile_only(arch: int) -> list[str]:
    """Route every launch to a compile for ``arch``; returns the list the compiled kernels' names go into."""
    triton.runtime.driver.set_active(StandInCuda(arch))
    compiled: list[str] = []
    run = JITFunction.run

    def compile_launch(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append(self.__name__)
        return kernel

    JITFunction.run = compile_launch
    common.check_device = lambda *tensors: torch.device("cpu")
    common.dot_dtype = common.tl_dtype
    common.dot_precision = lambda t: "ieee" if t.dtype == torch.float32 else "tf32"
    common.programs_wanted = lambda device: 2 * H100_SMS
    return compiled


def z(*size, dtype=torch.bfloat16):
    return torch.zeros(size, dtype=dtype)


def attend(rows: int) -> None:
    """Attention over a sliding ring and a full buffer at 26B-A4B's head dims (the row count sets
    the row tile), split and whole; K/V written by the rope kernel into the same pools."""
    for n_kv, D, k_eq_v, S, window in ((8, 256, False, 1039, 1024), (2, 512, True, 4096, 0)):
        qkv = z(rows, (16 + n_kv * (1 if k_eq_v else 2)) * D)
        rope.qkv_norm_rope(qkv, 16, n_kv, D, z(D), z(D), z(rows, D), z(rows, D), 1e-6, k_eq_v=k_eq_v)
        pool = z(n_kv, S, D)
        rope.qkv_norm_rope(
            qkv,
            16,
            n_kv,
            D,
            z(D),
            z(D),
            z(rows, D),
            z(rows, D),
            1e-6,
            k_eq_v=k_eq_v,
            cache=(pool, pool, z(rows, dtype=torch.long)),
        )
        # A KV-shared layer (n_kv=0, no k_weight): queries only. The compiler traces the K/V
        # branch that no program takes, which the interpreter never does.
        rope.qkv_norm_rope(z(rows, 16 * D), 16, 0, D, z(D), None, z(rows, D), z(rows, D), 1e-6)
        q, slots, qpos = z(1, rows, 16, D), z(1, S, dtype=torch.long), z(1, rows, dtype=torch.long)
        for splits in (None, 1):
            attention.decode_attention(q, pool, pool, slots, slots, qpos, window=window, splits=splits)


def launch_everything() -> None:
    """Each entry point at the 26B-A4B shapes, 16 rows (and attention at one row too)."""
    h = z(16, 2816)
    norm.add_rms_norm(h, h, z(2816), 1e-6, branch_weight=z(2816), scale=z(1))
    norm.add_rms_norm(h, h, z(2816), 1e-6, qwen3=True)
    norm.rms_norm(h, None, 1e-6)
    attend(16)
    attend(1)
    moe.route(z(16, 128), 8, z(128))
    moe.experts(h, z(16, 8, dtype=torch.long), z(16, 8, dtype=torch.float32), z(128, 1408, 2816), z(128, 2816, 704))
    head.softcap_argmax(z(16, 262_144), 30.0)
    q, kv, slots = z(1, 8, 4, 64, dtype=torch.float32), z(2, 128, 64, dtype=torch.float32), z(1, 128, dtype=torch.long)
    attention.decode_attention(q, kv, kv, slots, slots, slots[:, :8], softcap=30.0, scale=0.125)  # float32: IEEE dots


def main(argv: list[str]) -> int:
    compiled = compile_only(int(argv[0]) if argv else 90)
    launch_everything()
    print("compiled:", " ".join(sorted(set(compiled))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
