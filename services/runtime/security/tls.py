"""TLS and mutual TLS for every kakeya server and client, from PEM files (``docs/security.md``).

Servers take ``--tls-cert --tls-key [--tls-client-ca]`` (the CA turns on mutual TLS); clients, and the
orchestrator towards its verifier and drafter, ``--tls-ca [--tls-client-cert --tls-client-key]``. Without
them everything stays plaintext (loopback, a private network, or a mesh that terminates TLS).
"""

from __future__ import annotations

from dataclasses import astuple, dataclass
from pathlib import Path
from typing import ClassVar

import grpc


def _read(path: str | None, flag: str) -> bytes | None:
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: {exc.strerror or exc}") from None


@dataclass(frozen=True)
class _PemFiles:
    """Three PEM files, each named by its flag in ``FLAGS`` (field order); the first turns TLS on. ``PAIR``: the
    two that go together; ``NEEDS``: (a file, the file it needs, the message when it is missing)."""

    FLAGS: ClassVar[tuple[str, str, str]]
    PAIR: ClassVar[tuple[int, int]]
    NEEDS: ClassVar[tuple[int, int, str]]

    @classmethod
    def from_args(cls, args):
        tls = cls(*(getattr(args, flag[2:].replace("-", "_"), None) for flag in cls.FLAGS))
        paths, (i, j), (k, needed, why) = astuple(tls), cls.PAIR, cls.NEEDS
        if bool(paths[i]) != bool(paths[j]):
            raise ValueError(f"{cls.FLAGS[i]} and {cls.FLAGS[j]} go together")
        if paths[k] and not paths[needed]:
            raise ValueError(why)
        return tls

    @property
    def enabled(self) -> bool:
        return bool(astuple(self)[0])

    def argv(self) -> list[str]:
        """The flags that name these files again (``serve all`` passes them to its children)."""
        return [x for flag, path in zip(self.FLAGS, astuple(self)) if path for x in (flag, path)]

    def _pem(self) -> list[bytes | None]:
        return [_read(path, flag) for path, flag in zip(astuple(self), self.FLAGS)]


@dataclass(frozen=True)
class ServerTLS(_PemFiles):
    cert: str | None = None
    key: str | None = None
    client_ca: str | None = None  # mutual TLS: clients must present a certificate from this CA
    FLAGS: ClassVar = ("--tls-cert", "--tls-key", "--tls-client-ca")
    PAIR: ClassVar = (0, 1)
    NEEDS: ClassVar = (2, 0, "--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")

    def credentials(self) -> grpc.ServerCredentials:
        cert, key, ca = self._pem()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


@dataclass(frozen=True)
class ClientTLS(_PemFiles):
    ca: str | None = None
    client_cert: str | None = None  # mutual TLS: this process's certificate and key
    client_key: str | None = None
    FLAGS: ClassVar = ("--tls-ca", "--tls-client-cert", "--tls-client-key")
    PAIR: ClassVar = (1, 2)
    NEEDS: ClassVar = (1, 0, "--tls-client-cert needs --tls-ca (the servers' CA)")

    def credentials(self) -> grpc.ChannelCredentials:
        ca, cert, key = self._pem()
        return grpc.ssl_channel_credentials(ca, key, cert)


def channel(addr: str, tls: ClientTLS | None, options) -> grpc.Channel:
    """A channel to ``addr``: TLS when ``tls`` is enabled, else plaintext."""
    if tls is not None and tls.enabled:
        return grpc.secure_channel(addr, tls.credentials(), options=options)
    return grpc.insecure_channel(addr, options=options)


def add_server_args(p) -> None:
    p.add_argument("--tls-cert", metavar="PEM", help="serve TLS with this certificate (chain) ...")
    p.add_argument("--tls-key", metavar="PEM", help="... and its private key")
    p.add_argument("--tls-client-ca", metavar="PEM", help="mutual TLS: clients must present a certificate from this CA")


def add_client_args(p, what: str = "the server") -> None:
    p.add_argument("--tls-ca", metavar="PEM", help=f"connect to {what} over TLS, trusting this CA")
    p.add_argument("--tls-client-cert", metavar="PEM", help="mutual TLS: this process's certificate ...")
    p.add_argument("--tls-client-key", metavar="PEM", help="... and its private key")
