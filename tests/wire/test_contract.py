"""CachePolicy and SamplingParams <-> wire: nothing a client asked for is dropped on the way."""

import pytest

from kakeya.core.request import COUPLED, REJECTION, CachePolicy, SamplingParams
from kakeya.wire import convert as wire_contract
from kakeya.wire.kakeya.v1 import cache_pb2, generate_pb2, sampling_pb2


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
    with pytest.raises(ValueError, match=r"cache_policy\.kind: must be set when restore_path"):
        wire_contract.policy_from_proto(cache_pb2.CachePolicy(restore_path="/x"), default)
    with pytest.raises(ValueError, match=r"cache_policy\.slack"):
        wire_contract.policy_from_proto(
            cache_pb2.CachePolicy(kind=cache_pb2.CACHE_KIND_SINK_WINDOW, slack=1000), default
        )
    with pytest.raises(ValueError, match="SINK_WINDOW only"):
        wire_contract.policy_from_proto(cache_pb2.CachePolicy(kind=cache_pb2.CACHE_KIND_NATIVE, sink=3), default)


def test_a_group_size_without_quantization_is_refused_by_name():
    """``full_kv_group_size`` sizes the groups of ``full_kv_bits`` 4 or 8: beside 0 (exact K/V) it would be
    dropped (the request ran exact, said nothing), so it is refused naming the field; with the bits it is kept."""
    policy = cache_pb2.CachePolicy(kind=cache_pb2.CACHE_KIND_NATIVE, full_kv_group_size=32)
    with pytest.raises(ValueError, match=r"cache_policy\.full_kv_group_size: .*full_kv_bits"):
        wire_contract.policy_from_proto(policy, CachePolicy())
    policy.full_kv_bits = 4
    assert wire_contract.policy_from_proto(policy, CachePolicy()).full_kv_group_size == 32


@pytest.mark.parametrize(
    "params",
    [SamplingParams(0.7, seed=3), SamplingParams(1.0, top_k=5, top_p=0.9, min_p=0.05, seed=2**64 - 1, rule=REJECTION)],
    ids=lambda p: p.label,
)
def test_sampling_round_trips_with_its_rule(params):
    assert wire_contract.sampling_from_proto(wire_contract.sampling_to_proto(params)) == params
    public = generate_pb2.SamplingParams(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        min_p=params.min_p,
        seed=params.seed,
        rule=wire_contract.rule_to_proto(params.rule),
    )
    assert wire_contract.sampling_of(public, public.seed).check() == params


def test_an_unset_rule_is_coupled_and_an_unknown_one_is_named():
    assert wire_contract.sampling_of(generate_pb2.SamplingParams(temperature=0.5), None).rule == COUPLED
    assert wire_contract.sampling_from_proto(sampling_pb2.Sampling(temperature=0.5, seed=1)).rule == COUPLED
    with pytest.raises(ValueError, match=r"^sampling_params\.rule: must be one of coupled, rejection, got 9"):
        wire_contract.sampling_from_proto(sampling_pb2.Sampling(temperature=0.5, rule=9), "sampling_params")
    with pytest.raises(ValueError, match=r"^open\.sampling\.rule: "):
        wire_contract.sampling_from_proto(sampling_pb2.Sampling(temperature=0.5, rule=9), "open.sampling")
    with pytest.raises(ValueError, match=r"^sampling_params\.temperature: must be 0 \(greedy\) or at least 1e-05"):
        wire_contract.sampling_from_proto(sampling_pb2.Sampling(temperature=1e-39), "sampling_params")


@pytest.mark.parametrize(
    "sent,checked",
    [
        ((0.8624577756921689, 0.9137406201, 0.0123456789012), (0.86245775, 0.91374063, 0.012345679)),
        ((1e39, 1e-50, 1e-50), (3.4028235e38, 1e-45, 1e-45)),
        ((0.7, 0.95, 0.0), (0.7, 0.95, 0.0)),
    ],
)
def test_checked_sampling_is_what_the_wire_carries_so_colocated_samples_as_split(sent, checked):
    """A colocated engine samples with the checked values, a split one with the wire's float32 of them: the check
    makes them one (a many-digit temperature's 1/t differed by a step in ~30 % of cases), and a value float32
    cannot hold keeps its meaning (top-p 1e-50 was 0 on the wire: off, the whole distribution sampled)."""
    params = SamplingParams(sent[0], 0, *sent[1:], 7).check()
    assert (params.temperature, params.top_p, params.min_p) == checked
    assert wire_contract.sampling_from_proto(wire_contract.sampling_to_proto(params)) == params == params.check()
