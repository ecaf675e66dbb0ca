"""Bounds on everything a client controls, checked before anything is allocated.

Each size (cache window and sinks, prompt length, max_tokens, aux rows) and string (request ids, restoration sources) a
request names is checked against a limit the server was started with; a violation is a ``ValueError`` naming the field
(``INVALID_ARGUMENT``). Restoration sources (f_theta checkpoints) are configured on the verifier as ``--restore
NAME=DIR`` (a bare DIR is ``default``) and chosen by NAME: a client never names a server path.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

from kakeya.core.request import CachePolicy, InvalidRequest

MAX_REQUEST_ID_CHARS = 128
DEFAULT_MAX_PROMPT_TOKENS = 8192
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024
CHARS_PER_TOKEN_BOUND = 64  # a text prompt longer than max_prompt_tokens x this is refused before tokenizing
DEFAULT_RESTORE_NAME = "default"


@dataclass(frozen=True)
class HttpTimeouts:
    """How long an HTTP client may take (seconds) to send a request's headers, its body, and the next request on an idle
    keep-alive connection. Without the first two, a client that never finishes (slowloris) holds its connection
    forever."""

    headers_s: float = 10.0
    body_s: float = 30.0
    keep_alive_s: float = 5.0

    def __post_init__(self):
        for name, flag in (("headers_s", "--http-header-timeout"), ("body_s", "--http-body-timeout"),
                           ("keep_alive_s", "--http-keep-alive")):  # fmt: skip
            if not getattr(self, name) > 0:
                raise ValueError(f"{flag} must be > 0 seconds, got {getattr(self, name)}")


REQUEST_ID = re.compile(r"[\x21-\x7e]*")  # printable ASCII, no space
_SOURCE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def check_request_id(value: str, field: str = "request_id") -> str:
    """A request id safe to log and to send as gRPC metadata, or InvalidRequest."""
    if not isinstance(value, str) or len(value) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(field, f"at most {MAX_REQUEST_ID_CHARS} characters of printable ASCII")
    if not REQUEST_ID.fullmatch(value):
        raise InvalidRequest(field, "only printable ASCII without whitespace or control characters is allowed")
    return value


def check_window(policy: CachePolicy, max_window: int, field: str = "cache_policy", limit: str = "") -> None:
    """``policy``'s sink and window fit ``max_window`` (a ring of that size is what a session allocates);
    ``limit`` says what ``max_window`` is, for the message (default: this server's limit)."""
    what = limit or f"this server's limit {max_window}"
    if policy.window is not None and policy.window > max_window:
        raise ValueError(f"{field}.window {policy.window} exceeds {what}")
    if policy.sink > max_window:
        raise ValueError(f"{field}.sink {policy.sink} exceeds {what}")


@dataclass(frozen=True)
class ContextLimits:
    """What one session may hold: ``max_position_embeddings`` of the target, ``max_context`` of the server."""

    max_position_embeddings: int
    max_context: int  # <= max_position_embeddings
    sliding_window: int

    @classmethod
    def of(cls, max_position_embeddings: int, sliding_window: int, max_context: int = 0) -> ContextLimits:
        if max_context < 0:
            raise ValueError(f"--max-context must be >= 0 (0: the model's max_position_embeddings), got {max_context}")
        ctx = min(max_context, max_position_embeddings) if max_context else max_position_embeddings
        return cls(max_position_embeddings, ctx, sliding_window)

    @property
    def max_window(self) -> int:
        """The largest cache window (or sink count) a session may ask for."""
        return max(self.sliding_window, self.max_context)

    def check_positions(self, n: int, field: str) -> int:
        if n > self.max_context:
            raise ValueError(f"{field}: {n} positions exceed this server's limit {self.max_context} (--max-context)")
        return n


class RestoreSources:
    """Named f_theta directories a server may restore from; the wire carries only the names."""

    def __init__(self, sources: dict[str, str] | None = None):
        self.by_name = dict(sources or {})
        self.by_path = {v: k for k, v in self.by_name.items()}

    @classmethod
    def parse(cls, specs: list[str]) -> RestoreSources:
        """``["NAME=DIR", "DIR", "ftheta:DIR"]`` (a bare DIR is the source ``default``); ValueError if bad."""
        out: dict[str, str] = {}
        for spec in specs:
            spec = spec.removeprefix("ftheta:")
            name, sep, path = spec.partition("=")
            if not sep:
                name, path = DEFAULT_RESTORE_NAME, spec
            if not _SOURCE_NAME.fullmatch(name):
                raise ValueError(f"--restore: source name {name!r} must be 1-64 letters, digits, '.', '_' or '-'")
            if name in out:
                raise ValueError(f"--restore: source {name!r} given twice")
            if not Path(path).is_dir():
                raise ValueError(f"--restore {name}={path}: not a directory")
            out[name] = str(path)
        return cls(out)

    @property
    def default_path(self) -> str | None:
        return self.by_name.get(DEFAULT_RESTORE_NAME)

    def names(self) -> list[str]:
        return sorted(self.by_name)

    def to_server(self, policy: CachePolicy, field: str) -> CachePolicy:
        """A policy from the wire (``restore`` = a NAME) -> the same with the configured directory."""
        if policy.restore is None:
            return policy
        name = policy.restore
        if name not in self.by_name:
            known = ", ".join(self.names()) or "none configured (--restore NAME=DIR)"
            raise ValueError(f"{field}.restore_path: unknown restoration source {name[:64]!r} (known: {known})")
        return replace(policy, restore=self.by_name[name])

    def to_wire(self, policy: CachePolicy) -> CachePolicy:
        """A server policy -> the same with its restoration directory replaced by the source's name."""
        restore = policy.restore
        return policy if restore is None else replace(policy, restore=self.by_path.get(restore, DEFAULT_RESTORE_NAME))
