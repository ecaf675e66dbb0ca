"""Every cache policy: greedy speculative == greedy AR of the same policy, over many wraps of the ring.

The reference keeps every position and masks (tests/policy_reference.py), so it
shares neither the ring nor its rollback with the code under test.

Quantized full-layer K/V are the one place where "token for token" needs a
qualifier: two equivalent computation orders differ in the last float bits,
and quantization can round such a difference up to a whole quantization step
(~1e-3 on a logit). Where the reference's top two logits are that close, either
token is the target's greedy choice up to rounding; those tests therefore
require identity up to the reference's first near-tie and a long prefix.
"""

import pytest

from kakeya.core.request import CachePolicy
from kakeya.drafter.local import MLXDrafter
from kakeya.orchestrator.decode.loop import Decode, DecodeOptions, alone, run
from kakeya.verifier.session import LocalVerifierSession

from ..planted import PlantedDrafterSession
from ..policy_reference import policy_greedy

PROMPT = [2] + [(11 * i) % 700 + 20 for i in range(40)]
# logits: an 8-bit step on these K/V moves a logit by ~1e-3; a 4-bit step is 17x coarser
NEAR_TIE = {8: 0.01, 4: 0.17}


@pytest.fixture(scope="module")
def drafter(tiny_pair):
    return MLXDrafter(tiny_pair.draft, tiny_pair.target)


# What a run's length buys. The sliding layers' ring has ``window - 1 + slack`` rotating slots (slack 16: 31 for
# a window of 16, 39 for 24, 47 for the native 32), so its slot arithmetic repeats every that many positions: a run
# of 500 tokens goes round each ring 11-17 times (WRAPS, asserted per case), every block start and every trim
# landing on every slot many times over, and the full layers' cache (mlx-lm's, grown in steps of 256 positions)
# grows twice (prompt 41 + 500 > 2 * 256 + the largest block, asserted). The random drafter (nearly every block
# rejected: one verify forward per token, the block's other positions written then trimmed) and the planted one
# (full, partial and zero-accepted blocks, asserted) each run every policy that long; longer runs (1,200-2,500
# tokens until this was measured, then 600) repeat the same situations and cost a verify forward per token or two,
# and as much again for the reference.
CASES = [
    (CachePolicy("sink-window", sink=4, window=16), 8, "random", 500),
    (CachePolicy("sink-window", sink=4, window=16), 16, "planted", 500),
    (CachePolicy("sink-window", sink=0, window=24), 3, "planted", 500),
    (CachePolicy("sink-window", sink=4, window=16, full_kv_bits=8), 4, "planted", 500),
    (CachePolicy("native", full_kv_bits=8), 8, "random", 500),
    (CachePolicy("sink-window", sink=2, window=24, full_kv_bits=4), 16, "planted", 500),
]
WRAPS = 10  # times every case's ring must go round (the fewest, native's 47 slots over 500 tokens, is 11)
KV_STEP = 256  # mlx-lm's KVCache (the full layers') grows by this many positions
# test_sliding_bytes_flat_full_bytes_linear's run (its marks need the length), on a reference CASES' share
BYTES_POLICY, BYTES_TOKENS = CachePolicy("sink-window", sink=4, window=16), 1500


@pytest.fixture(scope="module")
def reference(mlx_target):
    """``get(policy, n)``: policy_greedy's first ``n`` ids and margins, computed once per policy at the longest
    length CASES ask of it. A shorter run's reference is a prefix of the longer one (greedy AR takes the same
    steps), and a reference costs about as much as the speculative run it checks (the bytes test's too)."""
    longest: dict[CachePolicy, int] = {BYTES_POLICY: BYTES_TOKENS}
    for policy, _, _, n in CASES:
        longest[policy] = max(longest.get(policy, 0), n)
    done: dict[CachePolicy, tuple[list[int], list[float]]] = {}

    def get(policy: CachePolicy, n: int) -> tuple[list[int], list[float]]:
        if policy not in done or len(done[policy][0]) < n:
            margins: list[float] = []
            done[policy] = (policy_greedy(mlx_target, PROMPT, max(n, longest.get(policy, 0)), policy, margins), margins)
        ids, margins = done[policy]
        return ids[:n], margins[:n]

    return get


@pytest.mark.parametrize(
    "policy,block_size,drafter_kind,n", CASES, ids=lambda v: v.label if isinstance(v, CachePolicy) else str(v)
)
def test_speculative_equals_same_policy_ar(
    mlx_target, aux_layers, drafter, reference, policy, block_size, drafter_kind, n
):
    ref, margins = reference(policy, n)
    assert len(ref) == n and len(set(ref)) > 100
    assert len(PROMPT) + n > 2 * KV_STEP + block_size  # the full layers' cache grew twice, blocks straddling
    if drafter_kind == "random":
        dsession = drafter.open_session()
    else:
        dsession = PlantedDrafterSession(ref, len(PROMPT), mlx_target.args.vocab_size, seed=block_size)
    session = LocalVerifierSession(mlx_target, aux_layers, policy)
    gen = run(session, dsession, PROMPT, n, block_size)
    layout = session.layout
    assert (layout.offset - layout.sink) // layout.rotating >= WRAPS, "the ring did not go round often enough"
    if drafter_kind == "random":  # nearly every block rejected, so every block start hit every slot
        assert gen.acceptance_lengths.count(1) > 0.8 * len(gen.acceptance_lengths)
    else:
        assert min(dsession.kinds.values()) > 0, dsession.kinds  # full, partial and zero-accepted blocks
    first_diff = next((i for i, (a, b) in enumerate(zip(gen.token_ids, ref)) if a != b), None)
    if policy.full_kv_bits and first_diff is not None:
        assert margins[first_diff] < NEAR_TIE[policy.full_kv_bits], (
            f"diverged at token {first_diff} where the margin was {margins[first_diff]}"
        )
        assert first_diff >= 300
    else:
        assert first_diff is None, f"diverged at token {first_diff} of {n}"
        assert gen.token_ids == ref


def test_policies_change_the_output(mlx_target, aux_layers, reference):
    """A window of 16 is not the model's 32: the bounded policy must actually act."""
    native = policy_greedy(mlx_target, PROMPT, 300, CachePolicy())
    bounded, _ = reference(CachePolicy("sink-window", sink=4, window=16), 300)
    assert native != bounded


def test_sliding_bytes_flat_full_bytes_linear(mlx_target, aux_layers, reference):
    policy = BYTES_POLICY
    session = LocalVerifierSession(mlx_target, aux_layers, policy)
    seen = {}
    # 1,500 tokens (90 wraps of the ring): the marks are far enough apart that a sliding layer that grew, or a full
    # layer that stopped growing, shows. The planted drafter (on the reference the speculative test computed
    # already) commits 1..16 tokens a block and trims the rest in three blocks of four: ~200 verify forwards where
    # a drafter rejected at every block took 1,500, for the same cache growth, wraps and trims
    ref, _ = reference(policy, BYTES_TOKENS)
    drafter = PlantedDrafterSession(ref, len(PROMPT), mlx_target.args.vocab_size, seed=1)
    for _ in alone(Decode(session, drafter, PROMPT, DecodeOptions(1500, 16))):
        n = session.offset - len(PROMPT)
        for mark in (300, 1000, 1500 - 16):
            if mark not in seen and n >= mark:
                seen[mark] = (n + len(PROMPT), session.stats().kv_bytes.as_dict())
    assert len(seen) == 3 and min(drafter.kinds.values()) > 0  # every mark; full, partial and zero-accepted blocks
    a = mlx_target.args
    n_full = a.layer_types.count("full_attention")
    kv_heads = a.num_global_key_value_heads or a.num_key_value_heads
    per_position = n_full * 2 * kv_heads * a.global_head_dim * 4  # K and V, float32
    for p, b in seen.values():
        assert b["sliding"] == seen[300][1]["sliding"] > 0  # flat
        # linear: mlx-lm's KVCache allocates in steps of 256 positions (a block may straddle one)
        assert per_position * p <= b["full"] <= per_position * (p + 256 + 16)


def test_quantized_full_layers_hold_fewer_bytes(mlx_target, aux_layers, drafter):
    sizes = {}
    for bits in (0, 8, 4):
        session = LocalVerifierSession(mlx_target, aux_layers, CachePolicy(full_kv_bits=bits))
        # 40 tokens (5 blocks of 8, each verified and trimmed): the full layers' caches, plain or quantized, hold
        # one step of KV_STEP positions from the first token to the 215th after this prompt, so 200 tokens measured
        # the same bytes (131072 / 40960 / 24576, checked) for 5x the verify forwards
        run(session, drafter.open_session(), PROMPT, 40, 8)
        sizes[bits] = session.stats().kv_bytes.as_dict()["full"]
    assert sizes[4] < sizes[8] < sizes[0]


@pytest.mark.parametrize(
    "policy,fragment",
    [
        (CachePolicy("bogus"), "kind"),
        (CachePolicy(full_kv_bits=3), "full_kv_bits"),
        (CachePolicy("sink-window", window=0), "window"),
        (CachePolicy("native", sink=4), "native"),
    ],
)
def test_bad_policies_are_refused(mlx_target, aux_layers, policy, fragment):
    with pytest.raises(ValueError, match=fragment):
        LocalVerifierSession(mlx_target, aux_layers, policy)
