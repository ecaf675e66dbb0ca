"""TLS and mutual TLS for every kakeya server and client, from PEM files (``docs/security.md``).

Servers take ``--tls-cert --tls-key [--tls-client-ca]`` (the CA turns on mutual TLS); clients, and the
orchestrator towards its verifier and drafter, ``--tls-ca [--tls-client-cert --tls-client-key]``. Without
them everything stays plaintext (loopback, a private network, or a mesh that terminates TLS).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc


def _read(path: str | None, flag: str) -> bytes | None:
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: {exc.strerror or exc}") from None


@dataclass(frozen=True)
class ServerTLS:
    cert: str | None = None
    key: str | None = None
    client_ca: str | None = None

    @classmethod
    def from_args(cls, args) -> ServerTLS:
        tls = cls(getattr(args, "tls_cert", None), getattr(args, "tls_key", None), getattr(args, "tls_client_ca", None))
        if bool(tls.cert) != bool(tls.key):
            raise ValueError("--tls-cert and --tls-key go together")
        if tls.client_ca and not tls.cert:
            raise ValueError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
        return tls

    @property
    def enabled(self) -> bool:
        return bool(self.cert)

    def credentials(self) -> grpc.ServerCredentials:
        pair = (_read(self.key, "--tls-key"), _read(self.cert, "--tls-cert"))
        ca = _read(self.client_ca, "--tls-client-ca")
        return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)

    def argv(self) -> list[str]:
        out = []
        for flag, value in (("--tls-cert", self.cert), ("--tls-key", self.key), ("--tls-client-ca", self.client_ca)):
            if value:
                out += [flag, value]
        return out


@dataclass(frozen=True)
class ClientTLS:
    ca: str | None = None
    client_cert: str | None = None
    client_key: str | None = None

    @classmethod
    def from_args(cls, args) -> ClientTLS:
        tls = cls(
            getattr(args, "tls_ca", None), getattr(args, "tls_client_cert", None), getattr(args, "tls_client_key", None)
        )
        if bool(tls.client_cert) != bool(tls.client_key):
            raise ValueError("--tls-client-cert and --tls-client-key go together")
        if tls.client_cert and not tls.ca:
            raise ValueError("--tls-client-cert needs --tls-ca (the servers' CA)")
        return tls

    @property
    def enabled(self) -> bool:
        return bool(self.ca)

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca, "--tls-ca"),
            private_key=_read(self.client_key, "--tls-client-key"),
            certificate_chain=_read(self.client_cert, "--tls-client-cert"),
        )

    def argv(self) -> list[str]:
        out = []
        for flag, value in (
            ("--tls-ca", self.ca),
            ("--tls-client-cert", self.client_cert),
            ("--tls-client-key", self.client_key),
        ):
            if value:
                out += [flag, value]
        return out


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
