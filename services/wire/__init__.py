"""The wire: the kakeya.v1 gRPC contract and the one tensor codec.

- ``kakeya.wire.kakeya.v1``: generated stubs (``scripts/gen_protos.py`` from
  ``protos/kakeya/v1/*.proto``), e.g.
  ``from kakeya.wire.kakeya.v1 import verifier_pb2, verifier_pb2_grpc``.
- ``kakeya.wire.codec``: ``to_proto(array) -> Tensor`` and
  ``from_proto(tensor, like="numpy"|"mlx"|"torch")``.
- ``kakeya.wire.limits``: ``channel_options()`` / ``server_options()``.
"""

from kakeya.wire.codec import from_proto, to_proto

__all__ = ["from_proto", "to_proto"]
