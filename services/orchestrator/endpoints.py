"""Where a verifier and a drafter come from: in this process (MLX or torch) or over gRPC.

The loop (``loop.py``) only sees the protocols of ``services/contract.py``, so
colocated and split deployments run the very same code: the difference is only
which implementation these factories hand it. Each backend is imported lazily,
so a node with one backend never imports the other.
"""

from __future__ import annotations

from services.contract import Drafter, Verifier
from services.drafter.loader import local_drafter
from services.verifier.loader import local_verifier

__all__ = ["local_verifier", "local_drafter", "remote_verifier", "remote_drafter"]


def remote_verifier(addr: str, **kwargs) -> Verifier:
    """A verifier served by ``kakeya serve verifier`` at ``addr`` (HOST:PORT), over gRPC."""
    from .remote import GrpcVerifier

    return GrpcVerifier(addr, **kwargs)


def remote_drafter(addr: str, **kwargs) -> Drafter:
    """A drafter served by ``kakeya serve drafter`` at ``addr`` (HOST:PORT), over gRPC."""
    from .remote import GrpcDrafter

    return GrpcDrafter(addr, **kwargs)
