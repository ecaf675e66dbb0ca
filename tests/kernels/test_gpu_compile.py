"""Every kernel compiles for Hopper (sm_90) at the real shapes, without a GPU (see gpu_compile.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="the kernels need triton (Linux only; no macOS wheels)")

ROOT = Path(__file__).resolve().parents[2]
KERNELS = {
    "_rms_norm_kernel",
    "_add_rms_norm_kernel",
    "_qkv_kernel",
    "_split_kernel",
    "_combine_kernel",
    "_route_kernel",
    "_gate_up_kernel",
    "_down_kernel",
    "_chunk_kernel",
    "_choose_kernel",
}


def test_every_kernel_compiles_for_hopper(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real, not from an earlier run's cache
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *sys.path])
    done = subprocess.run(
        [sys.executable, "-m", "tests.kernels.gpu_compile", "90"],
        check=False,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    compiled = set(done.stdout.split("compiled:")[-1].split())
    assert compiled == KERNELS
