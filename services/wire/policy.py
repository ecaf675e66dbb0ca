"""``CachePolicy`` <-> its wire message: the one place the two are converted.

Every field crosses: a policy a client asked for is never narrowed on the way
(quantized full layers, f_theta restoration included).
"""

from __future__ import annotations

import dataclasses

from services.verifier.cache import CachePolicy
from services.wire.kakeya.v1 import cache_pb2

KIND_TO_NAME = {cache_pb2.CACHE_KIND_NATIVE: "native", cache_pb2.CACHE_KIND_SINK_WINDOW: "sink-window"}
NAME_TO_KIND = {v: k for k, v in KIND_TO_NAME.items()}
MAX_SLACK = 64  # largest rollback slack a session may ask for (ring memory grows with it)


def to_proto(p: CachePolicy) -> cache_pb2.CachePolicy:
    if p.kind not in NAME_TO_KIND:
        raise ValueError(f"cache policy kind must be 'native' or 'sink-window', got {p.kind!r}")
    return cache_pb2.CachePolicy(
        kind=NAME_TO_KIND[p.kind],
        sink=p.sink,
        window=(p.window or 0) if p.kind != "native" else 0,  # native: always the model's own window
        slack=p.slack,
        full_kv_bits=p.full_kv_bits,
        full_kv_group_size=p.full_kv_group_size if p.full_kv_bits else 0,
        restore_path=p.restore or "",
    )


def from_proto(p: cache_pb2.CachePolicy, default: CachePolicy, field: str = "cache_policy") -> CachePolicy:
    """A message with ``kind`` set is a whole policy (0 / "" mean exact, the model's window, no
    restoration; ``slack`` 0 means the server's); with ``kind`` unset it is ``default``. Raises
    ValueError naming the field.

    Only the shape is checked here; ``CachePolicy.resolve`` checks the values
    against the model when a session opens.
    """
    if p.kind == cache_pb2.CACHE_KIND_UNSPECIFIED:
        given = [f.name for f, _ in p.ListFields()]
        if given:  # never drop what a client asked for
            raise ValueError(f"{field}.kind must be set when {', '.join(given)} is given")
        return default
    elif p.kind in KIND_TO_NAME:
        kind = KIND_TO_NAME[p.kind]
    else:
        raise ValueError(f"{field}.kind: unknown cache kind {p.kind}")
    if p.sink < 0:
        raise ValueError(f"{field}.sink must be >= 0, got {p.sink}")
    if p.window < 0:
        raise ValueError(f"{field}.window must be >= 0 (0 = the model's window), got {p.window}")
    if not 0 <= p.slack <= MAX_SLACK:
        raise ValueError(f"{field}.slack must be 0 (default) or 1..{MAX_SLACK}, got {p.slack}")
    if kind == "native" and (p.sink or p.window):
        raise ValueError(f"{field}: sink and window apply to CACHE_KIND_SINK_WINDOW only")
    values = {
        "kind": kind,
        "sink": p.sink,
        "window": p.window or None,
        "slack": p.slack or default.slack,
        "full_kv_bits": p.full_kv_bits,
        "full_kv_group_size": p.full_kv_group_size or default.full_kv_group_size,
        "restore": p.restore_path or None,
    }
    return dataclasses.replace(default, **values)
