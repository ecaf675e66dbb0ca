"""verify_batch on MLX (sessions on the batch axis of mlx-lm's own layers) == each session alone.

The same lockstep scenario as the torch test: different prompts, prompt lengths,
block lengths 1..16 and n_keep per session, wrapped native and sink-window rings,
sampling sessions with seeds; quantized full caches and f_theta sessions run alone
inside the batch.
"""

from __future__ import annotations

from kakeya.core.request import REJECTION, CachePolicy, SamplingParams
from kakeya.verifier.session import batchable

from .batch_scenario import lockstep

SINK = CachePolicy(kind="sink-window", sink=2, window=8)


def _prompt(n: int, salt: int = 0) -> list[int]:
    return [2] + [5 + (7 * i + salt) % 200 for i in range(n - 1)]


def test_batched_mlx_sessions_match_alone(mlx_target, aux_layers):
    specs = [
        (_prompt(22), CachePolicy(), None),
        (_prompt(5, 1), SINK, None),
        (_prompt(70, 2), CachePolicy(), None),  # native ring (window 32) already wrapped
        (_prompt(40, 3), SINK, SamplingParams(temperature=1.0, seed=5)),
        (_prompt(13, 4), CachePolicy(full_kv_bits=8, full_kv_group_size=32), None),  # runs alone in the batch
        (_prompt(9, 5), CachePolicy(), SamplingParams(temperature=0.8, top_k=30, seed=6, rule=REJECTION)),
    ]
    _alone, batched = lockstep(mlx_target, aux_layers, specs, rounds=6)
    assert [batchable(s) for s in batched] == [True, True, True, True, False, True]


def _forwards(target, monkeypatch) -> list[int]:
    """The segment count of every forward ``target`` runs from now on."""
    calls = []
    real = type(target).forward
    monkeypatch.setattr(
        type(target), "forward", lambda self, segments: calls.append(len(segments)) or real(self, segments)
    )
    return calls


def test_mlx_batch_runs_in_one_forward(mlx_target, aux_layers, monkeypatch):
    calls = _forwards(mlx_target, monkeypatch)
    specs = [(_prompt(9, k), CachePolicy(), None) for k in range(3)]
    lockstep(mlx_target, aux_layers, specs, rounds=2)
    assert [n for n in calls if n > 1] == [3, 3]


def test_a_lone_mlx_item_runs_alone(mlx_target, aux_layers, monkeypatch):
    calls = _forwards(mlx_target, monkeypatch)
    lockstep(mlx_target, aux_layers, [(_prompt(9), CachePolicy(), None)], rounds=2)
    assert calls and set(calls) == {1}  # a lone item must not batch
