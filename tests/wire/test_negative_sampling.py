"""A negative sampling value sent over gRPC is refused naming its field and quoting it, as over HTTP: the wire's
float32 clamp (``core.request.wire_float``) turned a ``top_p`` or ``min_p`` of -0.5 into float32's smallest positive
value, so a load test's gRPC client with a sign slip got the top token alone (``top_p``) or no filter at all
(``min_p``), silently, and a ``temperature`` of -1 was refused as "got 1e-45"."""

from __future__ import annotations

import pytest

from kakeya.core.request import InvalidRequest
from kakeya.wire.convert import sampling_of
from kakeya.wire.kakeya.v1 import generate_pb2 as gpb


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p"])
def test_a_negative_value_is_refused_naming_its_field_and_the_value_sent(field):
    sent = gpb.SamplingParams(temperature=1.0) if field != "temperature" else gpb.SamplingParams()
    setattr(sent, field, -0.5)
    with pytest.raises(InvalidRequest) as refused:
        sampling_of(sent, seed=1).check()
    assert refused.value.field == f"sampling.{field}" and "got -0.5" in refused.value.reason
