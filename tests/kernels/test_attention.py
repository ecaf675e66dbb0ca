"""Split-K decode attention through an index table against the eager attention CUDA runs today
(``ops.decode_attention`` over the gathered K/V and a mask built from positions), and the
position mask against the host's ring plan (``verifier/layout.py``).

bfloat16: within one rounding step of the eager output, the step taken at the largest magnitude
of the head's output row (an output element is a weighted sum that may cancel to near zero; both
paths carry the same absolute error there). The two round the same intermediates (scores,
probabilities) but in different places: the probabilities before normalisation here, after it
eagerly, and the float32 sums in other orders. float32: as close to the float64 math as the eager
float32 path is (both carry the scores' accumulation error through ``exp``).
"""

from __future__ import annotations

import pytest
import torch

from . import reference
from .conftest import cuda_only
from .numerics import assert_within_steps, steps

pytest.importorskip("triton", reason="the kernels need triton (Linux only; no macOS wheels)")

from kakeya.backends.torch.kernels import attention as A
from kakeya.verifier.layout import RingLayout


def _ring(sink: int, window: int, slack: int, start: int, L: int):
    """A session's ring after writing positions ``0 .. start + L - 1`` in in-place blocks, as the
    verifier plans them: (slot positions, the last block's plan)."""
    layout = RingLayout(sink, window, slack)
    while layout.offset < start:
        layout.plan(min(slack, start - layout.offset))
        layout.applied()
    plan = layout.plan(L)
    layout.applied()
    return torch.from_numpy(layout.positions.copy()), plan


def _pool(device, dtype, Hkv, rows, D, seed):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(Hkv, rows, D, generator=g).to(device, dtype) for _ in range(2))


def _queries(device, dtype, B, L, Hq, D, seed):
    return torch.randn(B, L, Hq, D, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


def _check(out, q, k, v, table, key_pos, query_pos, **mask):
    ref = reference.decode_attention_reference(q, k, v, table, key_pos, query_pos, **mask)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if q.dtype == torch.float32:
        exact = reference.decode_attention_reference(
            q.double(), k.double(), v.double(), table, key_pos, query_pos, **mask
        )
        ours, eager = steps(out, exact.float(), True).max(), steps(ref, exact.float(), True).max()
        assert ours <= max(2 * eager, 8), (float(ours), float(eager))
    else:
        assert_within_steps(out, ref, 1, row_scale=True)


SLIDING = [  # (dtype, L, Hq, Hkv, sinks, start): GQA 1/2/4, blocks of 1/8/16, young and wrapped rings
    (torch.bfloat16, 1, 2, 2, 0, 5),
    (torch.bfloat16, 8, 4, 2, 0, 70),
    (torch.bfloat16, 16, 8, 2, 2, 90),
    (torch.float32, 8, 4, 2, 2, 41),
    (torch.float32, 16, 2, 1, 0, 100),
    (torch.float16, 8, 4, 1, 2, 66),
]


@pytest.mark.parametrize("dtype, L, Hq, Hkv, sinks, start", SLIDING)
def test_sliding_ring_through_a_table(device, dtype, L, Hq, Hkv, sinks, start):
    """The ring's slots in the order the host plan left them (wrapped, with sinks, empty slots in a
    young ring), each slot at a scattered pool row."""
    window, D = 24, 32
    positions, plan = _ring(sinks, window, 16, start, L)
    S = positions.numel()
    k, v = _pool(device, dtype, Hkv, S + 11, D, seed=start)
    table = torch.randperm(S + 11, generator=torch.Generator().manual_seed(1))[:S][None].to(device)
    key_pos = positions[None].to(device)
    query_pos = torch.arange(start, start + L, device=device)[None]
    seen = A.visible(key_pos[0], query_pos[0], window, sinks)
    assert torch.equal(seen[:, : plan.used].cpu(), torch.from_numpy(plan.mask))  # the host plan's mask
    assert not seen[:, plan.used :].any()
    q = _queries(device, dtype, 1, L, Hq, D, seed=start + 1)
    for splits in (1, 3):
        out = A.decode_attention(q, k, v, table, key_pos, query_pos, window=window, sinks=sinks, splits=splits)
        _check(out, q, k, v, table, key_pos, query_pos, window=window, sinks=sinks)


@pytest.mark.parametrize(
    "dtype, L, Hq, Hkv",
    [(torch.bfloat16, 1, 8, 1), (torch.bfloat16, 16, 8, 2), (torch.float32, 8, 4, 4), (torch.bfloat16, 16, 16, 2)],
)
def test_full_buffer_at_its_capacity(device, dtype, L, Hq, Hkv):
    """A full layer over its whole buffer (the static step's fixed extent): slot = position, the
    unwritten tail masked by causality; 16 x 8 folded rows take several row tiles."""
    D, capacity, start = 64, 96, 50
    k, v = _pool(device, dtype, Hkv, capacity, D, seed=L)
    iota = torch.arange(capacity, device=device)[None]
    query_pos = torch.arange(start, start + L, device=device)[None]
    q = _queries(device, dtype, 1, L, Hq, D, seed=L + 1)
    out = A.decode_attention(q, k, v, iota, iota, query_pos)
    _check(out, q, k, v, iota, iota, query_pos)


@pytest.mark.parametrize("layer", ["sliding", "full"])
def test_slots_no_query_sees_are_never_read(device, layer):
    """NaN in every K/V row no query sees -- a young ring's empty slots; a full buffer's unwritten
    tail, whole key blocks of it (skipped) -- and the output is what zeros there give, in every
    split layout."""
    dtype, Hkv, D, L, start = torch.bfloat16, 2, 32, 8, 20
    window = 24 if layer == "sliding" else 0
    if layer == "sliding":
        key_pos = _ring(0, window, 16, start, L)[0][None].to(device)
    else:
        key_pos = torch.arange(160, device=device)[None]  # key blocks of 64: the last two unseen
    S = key_pos.shape[1]
    k, v = _pool(device, dtype, Hkv, S, D, seed=3)
    query_pos = torch.arange(start, start + L, device=device)[None]
    unseen = ~A.visible(key_pos[0], query_pos[0], window).any(0)
    assert unseen.sum() >= 11
    poisoned_k, poisoned_v = k.clone(), v.clone()
    poisoned_k[:, unseen] = float("nan")
    poisoned_v[:, unseen] = float("nan")
    q = _queries(device, dtype, 1, L, 4, D, seed=4)
    table = torch.arange(S, device=device)[None]
    want = A.decode_attention(q, k, v, table, key_pos, query_pos, window=window, splits=1)
    for splits in (1, 2, 5):
        got = A.decode_attention(q, poisoned_k, poisoned_v, table, key_pos, query_pos, window=window, splits=splits)
        assert not got.isnan().any()
        _check(got, q, k, v, table, key_pos, query_pos, window=window)
        if splits == 1:
            assert torch.equal(got, want)


def test_a_batch_of_sessions_shares_one_pool(device):
    """Two sessions at different positions, their slots interleaved in one pool: each gets exactly
    what it gets alone (the same programs, the same arithmetic)."""
    dtype, Hkv, Hq, D, L, window = torch.bfloat16, 2, 4, 32, 8, 24
    (pos_a, _), (pos_b, _) = _ring(0, window, 16, 30, L), _ring(0, window, 16, 75, L)
    S = pos_a.numel()
    k, v = _pool(device, dtype, Hkv, 2 * S, D, seed=5)
    rows = torch.randperm(2 * S, generator=torch.Generator().manual_seed(6)).to(device)
    table = torch.stack([rows[:S], rows[S:]])
    key_pos = torch.stack([pos_a, pos_b]).to(device)
    query_pos = torch.stack([torch.arange(30, 30 + L), torch.arange(75, 75 + L)]).to(device)
    q = _queries(device, dtype, 2, L, Hq, D, seed=7)
    both = A.decode_attention(q, k, v, table, key_pos, query_pos, window=window, splits=2)
    _check(both, q, k, v, table, key_pos, query_pos, window=window)
    for b in range(2):
        alone = A.decode_attention(
            q[b : b + 1], k, v, table[b : b + 1], key_pos[b : b + 1], query_pos[b : b + 1], window=window, splits=2
        )
        assert torch.equal(both[b : b + 1], alone)


def test_each_session_its_own_window_and_sinks(device):
    """The batched verify step's sliding layers: sessions of different cache policies (window, sinks)
    in one launch, each given its own as a tensor, get exactly what each gets alone with its own."""
    dtype, Hkv, Hq, D, L = torch.bfloat16, 2, 4, 32, 4
    geometry = [(24, 0, 40), (8, 2, 33), (12, 4, 70)]  # (window, sinks, start): rings wrapped differently
    rings = [_ring(sinks, window, 16, start, L)[0] for window, sinks, start in geometry]
    S = max(r.numel() for r in rings)
    key_pos = torch.stack([torch.cat([r, r.new_full((S - r.numel(),), -1)]) for r in rings]).to(device)
    k, v = _pool(device, dtype, Hkv, 3 * S, D, seed=12)
    table = torch.randperm(3 * S, generator=torch.Generator().manual_seed(13)).view(3, S).to(device)
    query_pos = torch.stack([torch.arange(start, start + L) for _, _, start in geometry]).to(device)
    window = torch.tensor([w for w, _, _ in geometry], device=device)
    sinks = torch.tensor([s for _, s, _ in geometry], device=device)
    q = _queries(device, dtype, 3, L, Hq, D, seed=14)
    both = A.decode_attention(q, k, v, table, key_pos, query_pos, window=window, sinks=sinks, splits=2)
    _check(both, q, k, v, table, key_pos, query_pos, window=window, sinks=sinks)
    for b, (w, s, _) in enumerate(geometry):
        one = slice(b, b + 1)
        alone = A.decode_attention(q[one], k, v, table[one], key_pos[one], query_pos[one], window=w, sinks=s, splits=2)
        assert torch.equal(both[one], alone)
    with pytest.raises(ValueError, match="both"):
        A.decode_attention(q, k, v, table, key_pos, query_pos, window=window, sinks=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_scale_and_soft_cap(device, dtype):
    """The drafter's 1/sqrt(head_dim) scale (rounded into q, as eager) and a Gemma-2-style soft-cap."""
    D, Hkv, L, S = 32, 2, 8, 64
    k, v = _pool(device, dtype, Hkv, S, D, seed=8)
    iota = torch.arange(S, device=device)[None]
    query_pos = torch.arange(40, 40 + L, device=device)[None]
    q = _queries(device, dtype, 1, L, 4, D, seed=9) * 3
    for scale, softcap in ((D**-0.5, None), (1.0, 5.0), (D**-0.5, 2.0)):
        out = A.decode_attention(q, k, v, iota, iota, query_pos, scale=scale, softcap=softcap, splits=2)
        _check(out, q, k, v, iota, iota, query_pos, scale=scale, softcap=softcap)


def test_default_split_count_and_strided_queries(device):
    """q as the rope kernel's output viewed per session (rows of a larger tensor), default splits."""
    dtype, D, Hkv, L, S = torch.bfloat16, 32, 1, 4, 80
    k, v = _pool(device, dtype, Hkv, S, D, seed=10)
    wide = _queries(device, dtype, 1, L, 6, D, seed=11)
    q = wide[:, :, :4]  # heads 4 and 5 belong to someone else
    iota = torch.arange(S, device=device)[None]
    query_pos = torch.arange(70, 70 + L, device=device)[None]
    out = A.decode_attention(q, k, v, iota, iota, query_pos)
    _check(out, q.contiguous(), k, v, iota, iota, query_pos)


def test_bad_inputs_are_refused(device):
    k, v = _pool(device, torch.bfloat16, 2, 16, 32, seed=0)
    q = _queries(device, torch.bfloat16, 1, 2, 4, 32, seed=0)
    iota = torch.arange(16, device=device)[None]
    qp = torch.tensor([[3, 4]], device=device)
    with pytest.raises(ValueError, match="query heads"):
        A.decode_attention(q[:, :, :3], k, v, iota, iota, qp)
    with pytest.raises(ValueError, match="query_pos"):
        A.decode_attention(q, k, v, iota, iota, qp[:, :1])
    with pytest.raises(ValueError, match="integer"):
        A.decode_attention(q, k, v, iota, iota.float(), qp)
    with pytest.raises(ValueError, match="pools alike"):
        A.decode_attention(q, k, v[:, :8], iota, iota, qp)


@cuda_only
@pytest.mark.parametrize("L", [1, 16])
@pytest.mark.parametrize("layer", ["sliding", "full"])
def test_real_shape_on_cuda(L, layer):
    """gemma-4-26B-A4B at context 1238: a sliding layer (8 KV heads of 256, window 1024, ring of
    1039 slots) and a full layer (2 KV heads of 512, a 4096-slot buffer), bf16."""
    device, dtype, start = torch.device("cuda"), torch.bfloat16, 1238
    Hq = 16
    if layer == "sliding":
        Hkv, D, window = 8, 256, 1024
        positions, _ = _ring(0, window, 16, start, L)
        key_pos = positions[None].to(device)
        table = torch.arange(key_pos.shape[1], device=device)[None]
    else:
        Hkv, D, window = 2, 512, 0
        key_pos = table = torch.arange(4096, device=device)[None]
    k, v = _pool(device, dtype, Hkv, table.shape[1], D, seed=L)
    q = _queries(device, dtype, 1, L, Hq, D, seed=L + 1)
    query_pos = torch.arange(start, start + L, device=device)[None]
    out = A.decode_attention(q, k, v, table, key_pos, query_pos, window=window)
    _check(out, q, k, v, table, key_pos, query_pos, window=window)
