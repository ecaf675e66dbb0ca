"""The LM head's soft-cap + argmax against ``Gemma4Text.logits`` and ``torch.argmax``.

The choices: exactly torch's, first index among equals included. The capped logits: within the
float32 tanh's error (from exp, ~2.5e-7) times the cap, absolutely -- the division is IEEE's, as eager.
"""

from __future__ import annotations

import pytest
import torch

from . import reference
from .conftest import cuda_only

pytest.importorskip("triton", reason="the kernels need triton (Linux only; no macOS wheels)")

from kakeya.backends.torch.kernels import head


def _logits(device, dtype, T, V, seed=0, scale=8.0):
    return (torch.randn(T, V, generator=torch.Generator().manual_seed(seed)) * scale).to(device, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T, V, chunks", [(1, 3000, None), (8, 2500, 3), (16, 1024, 1)])
@pytest.mark.parametrize("cap", [30.0, None])
def test_choices_and_capped_logits(device, dtype, T, V, chunks, cap):
    logits = _logits(device, dtype, T, V, seed=T)
    choices, capped = head.softcap_argmax(logits, cap, chunks=chunks)
    want_choices, want = reference.softcap_argmax_reference(logits, cap)
    assert torch.equal(choices, want_choices) and choices.dtype == torch.int64
    torch.testing.assert_close(capped, want, rtol=0, atol=30 * 2.5e-7 if cap else 0)


def test_ties_go_to_the_first_index(device):
    """The max in several chunks and twice within one: the lowest index wins, as torch.argmax."""
    logits = _logits(device, torch.bfloat16, 2, 4000, seed=1)
    logits[0, [3900, 2100, 2050]] = 100.0
    logits[1, [10, 11]] = 100.0
    choices, _ = head.softcap_argmax(logits, 30.0, chunks=4, write_logits=False)
    assert choices.tolist() == [2050, 10] == reference.softcap_argmax_reference(logits, 30.0)[0].tolist()


def test_greedy_only_writes_no_logits(device):
    logits = _logits(device, torch.bfloat16, 4, 2000, seed=2)
    choices, capped = head.softcap_argmax(logits, 30.0, write_logits=False)
    assert capped is None and torch.equal(choices, reference.softcap_argmax_reference(logits, 30.0)[0])


def test_bad_inputs_are_refused(device):
    with pytest.raises(ValueError, match="logits"):
        head.softcap_argmax(_logits(device, torch.bfloat16, 4, 64)[:, ::2], 30.0)
    with pytest.raises(ValueError, match="logits"):
        head.softcap_argmax(torch.zeros(64, dtype=torch.int64, device=device), 30.0)


@cuda_only
@pytest.mark.parametrize("T", [1, 16])
def test_real_shape_on_cuda(T):
    """Gemma-4's 262,144-entry vocabulary, soft-cap 30, bf16 logits."""
    logits = _logits("cuda", torch.bfloat16, T, 262_144, seed=T, scale=4.0)
    choices, capped = head.softcap_argmax(logits, 30.0)
    want_choices, want = reference.softcap_argmax_reference(logits, 30.0)
    assert torch.equal(choices, want_choices)
    torch.testing.assert_close(capped, want, rtol=0, atol=30 * 2.5e-7)
