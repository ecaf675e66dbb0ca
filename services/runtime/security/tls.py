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
    """Three PEM files, each named by its flag in ``FLAGS`` (field order); ``check`` says which go together."""

    FLAGS: ClassVar[tuple[str, str, str]]

    @classmethod
    def from_args(cls, args):
        tls = cls(*(getattr(args, flag[2:].replace("-", "_"), None) for flag in cls.FLAGS))
        tls.check()
        return tls

    def argv(self) -> list[str]:
        """The flags that name these files again (``serve all`` passes them to its children)."""
        return [x for flag, path in zip(self.FLAGS, astuple(self)) if path for x in (flag, path)]


@dataclass(frozen=True)
class ServerTLS(_PemFiles):
    cert: str | None = None
    key: str | None = None
    client_ca: str | None = None
    FLAGS: ClassVar = ("--tls-cert", "--tls-key", "--tls-client-ca")

    def check(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.client_ca and not self.cert:
            raise ValueError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")

    @property
    def enabled(self) -> bool:
        return bool(self.cert)

    def credentials(self) -> grpc.ServerCredentials:
        pair = (_read(self.key, "--tls-key"), _read(self.cert, "--tls-cert"))
        ca = _read(self.client_ca, "--tls-client-ca")
        return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


@dataclass(frozen=True)
class ClientTLS(_PemFiles):
    ca: str | None = None
    client_cert: str | None = None
    client_key: str | None = None
    FLAGS: ClassVar = ("--tls-ca", "--tls-client-cert", "--tls-client-key")

    def check(self) -> None:
        if bool(self.client_cert) != bool(self.client_key):
            raise ValueError("--tls-client-cert and --tls-client-key go together")
        if self.client_cert and not self.ca:
            raise ValueError("--tls-client-cert needs --tls-ca (the servers' CA)")

    @property
    def enabled(self) -> bool:
        return bool(self.ca)

    def credentials(self) -> grpc.ChannelCredentials:
        ca, key = _read(self.ca, "--tls-ca"), _read(self.client_key, "--tls-client-key")
        return grpc.ssl_channel_credentials(ca, key, _read(self.client_cert, "--tls-client-cert"))


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
