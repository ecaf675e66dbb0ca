"""Verifier cache arrays: the ring holds what its layout says (MLX's ring; torch's is pages, ``test_pool.py``),
quantized full-layer K/V (as mx.quantize)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kakeya.core.request import CachePolicy
from kakeya.verifier.layout import RingLayout
from kakeya.verifier.torch_backend.pool import dequantize, quantize

from .conftest import AUX_LAYERS


def _kv(n, start, heads=2, dim=8):
    """K/V whose every element encodes its absolute position (so slots are checkable)."""
    pos = torch.arange(start, start + n, dtype=torch.float32)
    k = pos.view(1, 1, n, 1).expand(1, heads, n, dim).clone()
    return k, -k


def test_ring_holds_exactly_the_positions_the_layout_says():
    import mlx.core as mx

    from kakeya.verifier.mlx_backend.cache import RingKVCache

    layout = RingLayout(sink=2, window=6, slack=4)
    ring = RingKVCache(layout.capacity)
    rng = np.random.default_rng(0)
    for _ in range(60):
        n = int(rng.integers(1, 9))
        plan = layout.plan(n)
        k, v = (mx.array(t.numpy()) for t in _kv(n, layout.offset))
        all_k, all_v = ring.fetch(k, v, plan)
        assert all_k.shape[2] == plan.mask.shape[1] and mx.array_equal(all_v, -all_k).item()
        layout.applied()
        used = layout.used
        held = layout.positions[:used]
        got = np.array(ring.keys[0, 0, :used, 0])
        live = held >= 0
        assert (got[live] == held[live]).all()
        keep = int(rng.integers(0, n + 1)) if n <= layout.slack else n
        layout.trim(n - keep)
    assert ring.keys.shape[2] == layout.capacity  # bounded: sink + window - 1 + slack


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64])
def test_quantize_is_mx_quantize(bits, group):
    import mlx.core as mx

    x = np.random.default_rng(bits + group).standard_normal((1, 3, 9, 128)).astype(np.float32)
    codes, s, b = quantize(torch.from_numpy(x), group, bits)
    assert codes.shape[-1] == 128 * bits // 8 and s.shape[-1] == 128 // group
    mine = dequantize(codes, s, b, group, bits, torch.float32).numpy()
    wq, ms, mb = mx.quantize(mx.array(x), group_size=group, bits=bits)
    theirs = np.asarray(mx.dequantize(wq, ms, mb, group_size=group, bits=bits))
    assert np.array_equal(mine, theirs)
    assert np.abs(mine - x).max() <= np.abs(s.numpy()).max() + 1e-6  # one edge is snapped exact, as in MLX


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_policy_matches_mlx_backend(torch_target, tiny, bits):
    """Same codes as MLX's QuantizedKVCache: logits agree up to rounding-boundary flips.

    The two backends' keys differ by float32 noise (~1e-6), which flips a code
    now and then (one quantization step, ~1e-2 relative): logits differ by
    ~1e-3 typically, and the greedy choice practically never.
    """
    from kakeya.verifier.mlx_backend.target import TargetMLX

    from .test_verifier_parity import SEQ_LEN, sequence, session_logits

    policy = CachePolicy(full_kv_bits=bits)
    seq = sequence(torch_target.args.vocab_size, seed=1)
    mine = session_logits(torch_target, seq, 24, policy, seed=1)
    theirs = session_logits(TargetMLX.load(tiny.target), seq, 24, policy, seed=1)
    exact = session_logits(torch_target, seq, 24, CachePolicy(), seed=1)
    diff = np.abs(mine - theirs).max(-1)
    assert np.median(diff) < 2e-2 and (mine.argmax(-1) == theirs.argmax(-1)).mean() >= 0.97
    assert np.abs(mine - exact).max() > 10 * np.median(diff)  # the policy really quantized
    assert len(seq) == SEQ_LEN


def test_quantized_policy_kv_bytes(torch_target, tiny):
    from kakeya.verifier.local import LocalVerifier

    v = LocalVerifier(torch_target, tiny.target, AUX_LAYERS)
    sizes = {}
    for bits in (0, 8, 4):
        s = v.open_session(CachePolicy(full_kv_bits=bits))
        s.prefill(list(range(5, 105)))
        sizes[bits] = s.stats().kv_bytes.as_dict()
    assert sizes[0]["sliding"] == sizes[8]["sliding"] == sizes[4]["sliding"]
    hd = torch_target.args.global_head_dim  # float32: 4 bytes/value exact; bits/8 + 2 * 4 / group quantized
    assert sizes[8]["full"] == sizes[0]["full"] * (1 + 8 / hd) / 4
    assert sizes[4]["full"] == sizes[0]["full"] * (0.5 + 8 / hd) / 4
