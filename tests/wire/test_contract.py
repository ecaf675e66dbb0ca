"""CachePolicy <-> wire: nothing a client asked for is dropped on the way."""

import pytest

from kakeya.verifier.layout import CachePolicy
from kakeya.wire import convert as wire_contract
from kakeya.wire.kakeya.v1 import cache_pb2


@pytest.mark.parametrize(
    "policy",
    [
        CachePolicy(),
        CachePolicy("sink-window", sink=4, window=64, slack=8),
        CachePolicy("sink-window", sink=2, window=16, full_kv_bits=4, full_kv_group_size=32, restore="/models/ftheta"),
        CachePolicy(full_kv_bits=8),
    ],
    ids=lambda p: p.label,
)
def test_round_trip_keeps_every_field(policy):
    assert wire_contract.policy_from_proto(wire_contract.policy_to_proto(policy), CachePolicy()) == policy


def test_unset_fields_take_the_default_and_bad_fields_are_named():
    default = CachePolicy("sink-window", sink=4, window=32, full_kv_bits=8)
    assert wire_contract.policy_from_proto(cache_pb2.CachePolicy(), default) == default
    with pytest.raises(ValueError, match=r"cache_policy\.kind"):
        wire_contract.policy_from_proto(cache_pb2.CachePolicy(kind=9), default)
    with pytest.raises(ValueError, match=r"cache_policy\.kind must be set when restore_path"):
        wire_contract.policy_from_proto(cache_pb2.CachePolicy(restore_path="/x"), default)
    with pytest.raises(ValueError, match=r"cache_policy\.slack"):
        wire_contract.policy_from_proto(cache_pb2.CachePolicy(kind=cache_pb2.CACHE_KIND_SINK_WINDOW, slack=1000), default)
    with pytest.raises(ValueError, match="SINK_WINDOW only"):
        wire_contract.policy_from_proto(cache_pb2.CachePolicy(kind=cache_pb2.CACHE_KIND_NATIVE, sink=3), default)
