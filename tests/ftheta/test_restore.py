"""Restoration touches only what it should, and speculation stays lossless under it.

* attention inputs: with and without restore, the exact part of every sliding
  layer's keys/values/mask (sinks + window) and every full layer's K/V are
  identical; the extra keys are restored K/V visible exactly at the evicted
  positions ``sink <= p``, ``t - Wn < p <= t - window``, and equal f_theta of
  those positions' aux, rotated at their own positions;
* logits match the plain sink-window policy until a position is evicted, and
  differ after;
* greedy speculative == greedy AR of the same restore policy (block 1 through
  the same session code, and an independent keep-everything reference), past
  many wraps of both rings, with partial acceptance and trims.
"""

import numpy as np
import pytest
from mlx_lm.models import gemma4_text

from kakeya.checkpoints.config import load_target_config
from kakeya.core.request import CachePolicy
from kakeya.drafter.local import MLXDrafter
from kakeya.orchestrator.decode.loop import Decode, DecodeOptions, alone, run
from kakeya.verifier.memory import KVShape, policy_table
from kakeya.verifier.session import LocalVerifierSession

from ..planted import PlantedDrafterSession
from .conftest import SINK, WINDOW
from .reference import restore_greedy

PROMPT = [2] + [(13 * i) % 700 + 20 for i in range(40)]


def _record(monkeypatch):
    calls = []
    real = gemma4_text.scaled_dot_product_attention

    def spy(q, k, v, cache=None, scale=1.0, mask=None, **kw):
        calls.append((np.array(k), np.array(v), mask if mask is None or isinstance(mask, str) else np.array(mask)))
        return real(q, k, v, cache=cache, scale=scale, mask=mask, **kw)

    monkeypatch.setattr(gemma4_text, "scaled_dot_product_attention", spy)
    return calls


def test_restoration_changes_only_evicted_sliding_positions(monkeypatch, mlx_target, aux_layers, restore_policy):
    plain_policy = CachePolicy("sink-window", sink=SINK, window=WINDOW)
    prompt, block = PROMPT[:WINDOW], [7, 8, 9, 10, 11, 12, 13, 14]  # one prefill chunk in both sessions
    on, off = (
        LocalVerifierSession(mlx_target, aux_layers, restore_policy),
        LocalVerifierSession(mlx_target, aux_layers, plain_policy),
    )
    _, prompt_aux = on.prefill(prompt)
    off.prefill(prompt)
    calls = _record(monkeypatch)
    on.verify(block)
    with_restore = calls[:]
    calls.clear()
    off.verify(block)
    without = calls[:]
    n_layers = mlx_target.args.num_hidden_layers
    assert len(with_restore) == len(without) == n_layers

    s, native = len(prompt), mlx_target.args.sliding_window
    positions = on.latent_layout.positions  # the prefill's, the block's are pending
    slots = len(positions)
    queries = np.arange(s, s + len(block))[:, None]
    expected = (positions[None] >= SINK) & (positions[None] <= queries - WINDOW) & (positions[None] > queries - native)
    assert expected.any() and not expected[: WINDOW + SINK - s].any()  # the band opens inside this block
    restorer = on.restorer
    z = restorer.encode(prompt_aux, aux_layers)
    for i, kind in enumerate(mlx_target.layer_types):
        (k1, v1, m1), (k0, v0, m0) = with_restore[i], without[i]
        if kind == "full_attention":  # S5: exact K/V, nothing restored, same mask
            assert k1.shape == k0.shape and (m1 is None and m0 is None or np.array_equal(m1, m0))
            assert np.array_equal(k1[..., :s, :], k0[..., :s, :]) and np.array_equal(v1[..., :s, :], v0[..., :s, :])
            continue
        # sliding: [restored slots ++ the ring]; the ring part is the plain policy's, slot for slot
        assert k1.shape[2] == slots + k0.shape[2]
        assert np.array_equal(m1[:, slots:], m0)
        assert np.array_equal(m1[:, :slots], expected)
        if i == 0:  # same layer input in both runs: the exact K/V are bit-identical
            assert np.array_equal(k1[..., slots:, :], k0) and np.array_equal(v1[..., slots:, :], v0)
        else:  # K/V of positions before this forward come from the (identical) prefill
            ring = on.layout.positions
            old = np.flatnonzero((ring >= 0) & (ring < s))
            assert np.array_equal(k1[..., slots + old, :], k0[..., old, :])
        attn = mlx_target.inner.layers[i].self_attn
        for slot in np.flatnonzero(expected.any(axis=0)):
            p = int(positions[slot])
            rk, rv = restorer.layer_kv(z[p : p + 1], i, attn)
            rk = attn.rope(rk.transpose(1, 0, 2)[None], offset=p)
            assert np.allclose(k1[..., slot, :], np.array(rk)[..., 0, :], atol=1e-5)
            assert np.allclose(v1[..., slot, :], np.array(rv.transpose(1, 0, 2)[None])[..., 0, :], atol=1e-5)


def test_logits_change_only_once_positions_are_evicted(monkeypatch, mlx_target, aux_layers, restore_policy):
    stream = [(29 * i) % 900 + 10 for i in range(40)]
    logits = {}
    real = mlx_target.greedy
    for name, policy in (("on", restore_policy), ("off", CachePolicy("sink-window", sink=SINK, window=WINDOW))):
        session, out = LocalVerifierSession(mlx_target, aux_layers, policy), []
        monkeypatch.setattr(
            mlx_target, "greedy", lambda h, out=out: out.append(np.array(mlx_target.logits(h)[0, -1])) or real(h)
        )
        session.prefill(stream[:1])
        for tok in stream[1:]:
            session.verify([tok])
            session.commit(1)
        logits[name] = np.stack(out)
    diff = np.abs(logits["on"] - logits["off"]).max(axis=-1)  # row t: the query at position t
    first = SINK + WINDOW  # the first query with an evicted position p >= sink
    assert diff[:first].max() < 1e-4
    assert diff[first:].min() > 1e-3


# The random drafter's run (and so the AR reference): 400 tokens, 441 positions, go round the latent ring (47
# slots) 9 times and the K/V ring (31) 14 times; the test asserts > 5 wraps of the latent ring. 600 tokens (13 and
# 20) cost a verify forward per token more, and as much again for the reference.
N_RANDOM = 400


@pytest.fixture(scope="module")
def restore_ar(mlx_target, aux_layers, restore_policy):
    return run(LocalVerifierSession(mlx_target, aux_layers, restore_policy), None, PROMPT, N_RANDOM, 1).token_ids


def test_independent_reference_agrees(mlx_target, aux_layers, restore_policy, restore_ar):
    restorer = mlx_target.restorer(restore_policy.restore)
    ref = restore_greedy(mlx_target, restorer, PROMPT, 120, restore_policy, aux_layers)
    assert restore_ar[:120] == ref
    plain = run(
        LocalVerifierSession(mlx_target, aux_layers, CachePolicy("sink-window", sink=SINK, window=WINDOW)),
        None,
        PROMPT,
        120,
        1,
    )
    assert plain.token_ids != ref  # restoration acts


@pytest.mark.parametrize("block_size,drafter_kind", [(8, "random"), (16, "planted")])
def test_speculative_equals_ar_of_the_same_restore_policy(
    mlx_target, aux_layers, tiny_pair, restore_policy, restore_ar, block_size, drafter_kind
):
    n = N_RANDOM if drafter_kind == "random" else 300
    if drafter_kind == "random":
        dsession = MLXDrafter(tiny_pair.draft, tiny_pair.target).open_session()
    else:
        dsession = PlantedDrafterSession(restore_ar, len(PROMPT), mlx_target.args.vocab_size, seed=5)
    session = LocalVerifierSession(mlx_target, aux_layers, restore_policy)
    decoding, kv = Decode(session, dsession, PROMPT, DecodeOptions(n, block_size)), []
    for _ in alone(decoding):
        kv.append(session.stats().kv_bytes.as_dict())
    gen = decoding.generation
    assert len(set(restore_ar)) > 50
    first_diff = next((i for i, (a, b) in enumerate(zip(gen.token_ids, restore_ar)) if a != b), None)
    assert first_diff is None, f"diverged at token {first_diff} of {n}"
    assert session.offset > 5 * session.latent_layout.capacity  # many wraps of both rings
    if drafter_kind == "planted":
        assert dsession.kinds["partial"] > 5 and dsession.kinds["zero"] > 5
    # memory: the latent ring is allocated whole and reported apart; the K/V ring stays flat
    latent = (mlx_target.args.sliding_window - 1 + restore_policy.slack) * session.restorer.latent_dim * 4
    assert {b["restored"] for b in kv} == {latent}
    shape = KVShape.from_config(load_target_config(tiny_pair.target))
    row = policy_table(shape, session.offset, SINK, WINDOW, restore_rank=session.restorer.config.rank)[
        "sink-window+restore"
    ]
    assert row["restored_bytes"] == latent and row["sliding_bytes"] == kv[-1]["sliding"]
    assert len({b["sliding"] for b in kv[5:]}) == 1
    assert session.stats().cache_policy == f"sink-window({SINK}+{WINDOW})+restore"


@pytest.mark.parametrize(
    "policy,fragment",
    [
        (CachePolicy("native", restore="x"), "sink-window"),
        (CachePolicy("sink-window", sink=4, window=32, restore="x"), "smaller than the model's"),
        (CachePolicy("sink-window", sink=4, window=16, restore="/no/such/ftheta"), "not an f_theta directory"),
    ],
)
def test_bad_restore_policies_are_refused(mlx_target, aux_layers, policy, fragment):
    with pytest.raises((ValueError, FileNotFoundError), match=fragment):
        LocalVerifierSession(mlx_target, aux_layers, policy)


def test_restore_limits(mlx_target, aux_layers, ftheta_dir):
    policy = CachePolicy("sink-window", sink=2, window=8, restore=str(ftheta_dir))
    session = LocalVerifierSession(mlx_target, aux_layers, policy)
    session.prefill(PROMPT)  # 41 positions: prefilled in chunks of the window
    with pytest.raises(ValueError, match="at most the window"):
        session.verify(list(range(10, 19)))  # 9 > window 8: a restored position would be in this forward
    session.verify(list(range(10, 18)))
    session.commit(3)
    with pytest.raises(ValueError, match="do not capture|does not capture"):
        LocalVerifierSession(mlx_target, (1,), policy)
