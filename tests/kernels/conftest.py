"""The kernels run on CUDA where there is one, else under Triton's interpreter on the CPU.

The interpreter is chosen when triton decorates a kernel, so the switch is set here, before any
test module imports ``kakeya.backends.torch.kernels``. On a CPU the tests run at small shapes;
the real-shape ones are marked ``cuda`` and skip without a GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="real shapes: needs CUDA (the interpreter runs the small ones)")


@pytest.fixture
def device() -> torch.device:
    return DEVICE
