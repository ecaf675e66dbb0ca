"""Who may call a kakeya server: bearer tokens, the loopback rule, and who a caller is (``docs/security.md``).

A bearer token (``--auth-token-file``) rides as ``authorization: Bearer <token>`` and is compared in
constant time (:func:`bearer_ok`, the HTTP front's check too): the public API admits its clients with one,
a verifier or drafter only its orchestrators, which send it with ``--backend-token-file``
(:func:`with_bearer`; ``serve all`` makes one per run, :func:`new_token`). Mutual TLS (``tls.py``) is the
other way; both may be on. A verifier or drafter listening beyond loopback with neither refuses to start
without ``--insecure`` (:func:`check_exposure`). :func:`peer_of` names a caller for the per-peer caps.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
from pathlib import Path

import grpc

MIN_TOKEN_CHARS = 16


def read_token(path: str | Path, flag: str = "--auth-token-file") -> str:
    """The bearer token in ``path`` (surrounding whitespace stripped); ValueError naming ``flag`` if unusable."""
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: {exc.strerror or exc}") from None
    if len(token) < MIN_TOKEN_CHARS or any(c.isspace() or not c.isprintable() for c in token):
        raise ValueError(f"{flag} {path}: the token must be {MIN_TOKEN_CHARS}+ printable characters without whitespace")
    return token


def new_token() -> str:
    """A fresh random token (256 bits, URL-safe): ``serve all``'s secret for its children."""
    return secrets.token_urlsafe(32)


def write_token(path: str | Path, token: str) -> Path:
    """Write ``token`` to a new file only its owner can read."""
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return path


def bearer_ok(authorization: str, token: str | None) -> bool:
    """``authorization`` (the header's value) is ``Bearer <token>``; always true without a token. The scheme
    matches in any case (RFC 7235), the token exactly, in constant time (a wrong guess tells nothing of it)."""
    if token is None:
        return True
    scheme, _, credentials = authorization.partition(" ")
    return hmac.compare_digest(credentials.encode(errors="replace"), token.encode()) and scheme.lower() == "bearer"


def authorized(context, token: str | None) -> bool:
    """The gRPC call's ``authorization`` metadata carries ``token`` (True without a token)."""
    return bearer_ok(dict(context.invocation_metadata() or ()).get("authorization", ""), token)


def is_loopback(host: str) -> bool:
    """``host`` (as given to ``--host``) is reachable only from this machine."""
    name = host.strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False  # a hostname or an interface name: assume it is reachable from elsewhere


def check_exposure(service: str, host: str, *, mutual_tls: bool, token: bool, insecure: bool) -> str | None:
    """Whether an internal service (verifier, drafter) may listen on ``host`` as configured: loopback, or callers
    authenticated by mutual TLS or a token: fine (None); else ValueError naming the flags, or with ``insecure`` a
    warning to log (returned)."""
    if is_loopback(host) or mutual_tls or token:
        return None
    problem = (
        f"{service} on {host} without client authentication: anyone who reaches this port can open sessions"
        " and hold its memory"
    )
    if insecure:
        return f"{problem} (--insecure)"
    raise ValueError(
        f"{problem}. Require mutual TLS (--tls-cert, --tls-key, --tls-client-ca) or a bearer token"
        " (--auth-token-file; orchestrators send it with --backend-token-file), listen on 127.0.0.1,"
        " or pass --insecure if something in front authenticates callers (docs/security.md)"
    )


def peer_of(context) -> str:
    """The caller, for per-peer limits: its address without the port, which changes with each connection
    (``ipv4:10.0.0.7``). Every orchestrator pod, every client host is its own peer; callers behind one proxy or
    NAT share one."""
    peer = context.peer() or "unknown"
    kind, _, rest = peer.partition(":")
    return f"{kind}:{rest.rpartition(':')[0]}" if kind in ("ipv4", "ipv6") else peer


class _Bearer(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds ``authorization: Bearer <token>`` to every call of a channel."""

    def __init__(self, token: str):
        self.header = ("authorization", f"Bearer {token}")

    def intercept_unary_unary(self, cont, details, request_or_iterator):
        return cont(_Details(details, list(details.metadata or []) + [self.header]), request_or_iterator)

    intercept_unary_stream = intercept_stream_unary = intercept_stream_stream = intercept_unary_unary


class _Details(grpc.ClientCallDetails):
    """``grpc.ClientCallDetails`` with other metadata (the interceptor API has no constructor for it)."""

    def __init__(self, d, metadata):
        self.method, self.timeout, self.metadata = d.method, d.timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = d.credentials, d.wait_for_ready, d.compression


def with_bearer(channel: grpc.Channel, token: str | None) -> grpc.Channel:
    """``channel`` sending ``token`` on every call (as it is without one)."""
    return channel if token is None else grpc.intercept_channel(channel, _Bearer(token))
