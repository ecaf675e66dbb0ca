"""`kakeya memory`'s formula against the bytes a real session holds."""

import json

import pytest

from kakeya.app.main import main
from kakeya.checkpoints.config import load_target_config
from kakeya.core.request import CachePolicy
from kakeya.verifier.memory import KVShape, session_bytes
from kakeya.verifier.session import LocalVerifierSession


@pytest.mark.parametrize(
    "policy",
    [
        CachePolicy(),
        CachePolicy("sink-window", sink=4, window=16),
        CachePolicy(full_kv_bits=8),
        CachePolicy("sink-window", sink=2, window=8, full_kv_bits=4),
    ],
    ids=lambda p: p.label,
)
@pytest.mark.parametrize("context", [512, 768])
def test_formula_matches_a_live_session(tiny_pair, mlx_target, aux_layers, policy, context):
    session = LocalVerifierSession(mlx_target, aux_layers, policy)
    session.prefill([(5 * i) % 1000 + 5 for i in range(context)])
    live = session.stats().kv_bytes.as_dict()
    predicted = session_bytes(KVShape.from_config(load_target_config(tiny_pair.target)), policy, context)
    assert live == {"sliding": predicted["sliding_bytes"], "full": predicted["full_bytes"]}
    assert predicted["total_bytes"] == live["sliding"] + live["full"]


def test_memory_command_json(capsys):
    assert main(["memory", "--preset", "gemma-4-26b-a4b", "--context", "32768", "--json"]) == 0
    table = json.loads(capsys.readouterr().out)
    assert set(table) == {
        "full",
        "native",
        "native+kv8",
        "native+kv4",
        "sink-window",
        "sink-window+kv8",
        "sink-window+kv4",
    }
    for row in table.values():
        assert row["total_bytes"] == row["sliding_bytes"] + row["full_bytes"]
    # S5: full-attention layers are never bounded, only quantized
    assert table["native"]["full_bytes"] == table["sink-window"]["full_bytes"] == table["full"]["full_bytes"]
    assert table["sink-window"]["sliding_bytes"] < table["native"]["sliding_bytes"] < table["full"]["sliding_bytes"]
    assert table["native+kv4"]["full_bytes"] < table["native+kv8"]["full_bytes"] < table["native"]["full_bytes"]
    # 25 sliding layers x 8 KV heads x 256 dims x 2 (K,V) x 2 bytes x 32768 positions
    assert table["full"]["sliding_bytes"] == 25 * 8 * 256 * 2 * 2 * 32768


def test_memory_command_on_a_checkpoint_and_errors(tiny_pair, capsys):
    assert main(["memory", "--config", str(tiny_pair.target), "--context", "100"]) == 0
    assert "sink-window" in capsys.readouterr().out
    assert main(["memory", "--context", "100"]) == 2
    assert "--preset or --config" in capsys.readouterr().err
