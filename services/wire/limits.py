"""gRPC channel / server options shared by every kakeya client and server.

Both ends must agree on the message-size ceiling: gRPC's default receive limit is 4 MiB, which one prompt's aux hidden
states exceed easily (``positions x len(target_layer_ids) x hidden x itemsize``: e.g. 2048 x 5 x 2816 x 2 bytes = 55
MiB in bfloat16). The default here is 256 MiB; set ``KAKEYA_GRPC_MAX_MESSAGE_BYTES`` on both ends to change it (gRPC
caps it below 2 GiB). Prompts whose aux outgrows it need a chunked prefill (see ``verifier.proto``).

Keepalive: a session's KV cache lives as long as its stream, so a server must
notice a peer that vanished without closing the connection (a node gone,
a dropped route) to free that memory. Both ends ping an idle connection every
60 s and drop it after 20 s without an answer. The orchestrator's channels to
its backends ping every second, so verifier and drafter servers tolerate pings
every 0.5 s; the public API keeps 30 s. Neither trips gRPC's "too_many_pings"
defence against the pings its clients send.

Usage::

    grpc.insecure_channel(addr, options=channel_options())
    grpc.server(executor, options=server_options())
"""

from __future__ import annotations

import os

MiB = 1024 * 1024
DEFAULT_MAX_MESSAGE_BYTES = 256 * MiB
GRPC_MAX_MESSAGE_BYTES = 2**31 - 1  # gRPC stores the limit in an int32
ENV_MAX_MESSAGE_BYTES = "KAKEYA_GRPC_MAX_MESSAGE_BYTES"

KEEPALIVE_TIME_MS = 60_000
KEEPALIVE_TIMEOUT_MS = 20_000
# The orchestrator's channels to verifier and drafter replicas ping every second: a replica cut off without a FIN or
# RST is known dead within ~2 s (the default --backend-timeout), so round_robin stops opening sessions on it and a
# take-over lands on a live replica. At 60 s + 20 s take-overs went back to a cut-off host for over a minute, each
# try waiting out --backend-timeout. A ping is a few bytes a second per replica.
BACKEND_KEEPALIVE_TIME_MS = 1_000
BACKEND_KEEPALIVE_TIMEOUT_MS = 1_000
MIN_CLIENT_PING_INTERVAL_MS = 500  # backend servers: must stay below the backend channels' keepalive time
PUBLIC_MIN_CLIENT_PING_INTERVAL_MS = 10_000  # the public API: grpc-go clients' shortest keepalive
PUBLIC_MAX_RECEIVE_BYTES = 4 * MiB  # the public API and the verifier take token ids, never tensors

Options = list[tuple[str, int]]


def max_message_bytes() -> int:
    """The message-size ceiling: ``$KAKEYA_GRPC_MAX_MESSAGE_BYTES`` or 256 MiB."""
    raw = os.environ.get(ENV_MAX_MESSAGE_BYTES, "").strip()
    if not raw:
        return DEFAULT_MAX_MESSAGE_BYTES
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{ENV_MAX_MESSAGE_BYTES} must be an integer byte count, got {raw!r}") from None
    return _check(value, ENV_MAX_MESSAGE_BYTES)


def _check(value: int, what: str) -> int:
    if not 4 * MiB <= value <= GRPC_MAX_MESSAGE_BYTES:
        raise ValueError(f"{what} must be between {4 * MiB} and {GRPC_MAX_MESSAGE_BYTES} bytes, got {value}")
    return value


def _size_options(limit: int | None) -> Options:
    n = max_message_bytes() if limit is None else _check(int(limit), "max_message_bytes")
    return [
        ("grpc.max_send_message_length", n),
        ("grpc.max_receive_message_length", n),
    ]


def channel_options(max_message_bytes: int | None = None, keepalive: bool = True, backend: bool = False) -> Options:
    """Options for ``grpc.insecure_channel`` / ``grpc.aio.insecure_channel`` (and secure ones); ``backend``: a
    channel to verifier or drafter replicas, whose keepalive finds a dead one within seconds."""
    opts = _size_options(max_message_bytes)
    if keepalive:
        opts += [
            ("grpc.keepalive_time_ms", BACKEND_KEEPALIVE_TIME_MS if backend else KEEPALIVE_TIME_MS),
            ("grpc.keepalive_timeout_ms", BACKEND_KEEPALIVE_TIMEOUT_MS if backend else KEEPALIVE_TIMEOUT_MS),
            ("grpc.keepalive_permit_without_calls", 0),  # ping only while a session is open
            ("grpc.http2.max_pings_without_data", 0),  # keep pinging a quiet session
        ]
    return opts


def server_options(
    max_message_bytes: int | None = None,
    keepalive: bool = True,
    max_receive_bytes: int | None = None,
    public: bool = False,
) -> Options:
    """Options for ``grpc.server`` / ``grpc.aio.server``.

    ``max_receive_bytes`` lowers the receive limit only (a public API takes
    small requests but may answer big ones): a request over it is refused with
    RESOURCE_EXHAUSTED from its length prefix, before it is read whole.
    ``grpc.so_reuseport`` is off: a taken port fails to bind instead of
    silently sharing the connections with another server. ``public``: the
    orchestrator's public API, whose clients ping at most every 60 s.
    """
    opts = _size_options(max_message_bytes)
    if max_receive_bytes is not None:
        n = min(_check(int(max_receive_bytes), "max_receive_bytes"), dict(opts)["grpc.max_receive_message_length"])
        opts = [(k, v) for k, v in opts if k != "grpc.max_receive_message_length"] + [
            ("grpc.max_receive_message_length", n)
        ]
    opts.append(("grpc.so_reuseport", 0))
    if keepalive:
        opts += [
            ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
            ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
            (
                "grpc.http2.min_ping_interval_without_data_ms",
                PUBLIC_MIN_CLIENT_PING_INTERVAL_MS if public else MIN_CLIENT_PING_INTERVAL_MS,
            ),
            ("grpc.keepalive_permit_without_calls", 1),  # idle pooled channels may ping too
            ("grpc.http2.max_pings_without_data", 0),  # keep pinging a quiet session
        ]
    return opts
