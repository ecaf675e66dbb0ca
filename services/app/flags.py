"""The hardening flags of ``kakeya serve ...`` and ``kakeya client``: limits, admission, TLS, tokens.

Registered here and turned into the servers' keyword arguments here, so the
commands themselves (``serve.py``) stay about starting processes.
"""

from __future__ import annotations

import grpc

from kakeya.runtime.compute import DEFAULT_MAX_BATCH
from kakeya.runtime.lifecycle import DEFAULT_IDLE_TIMEOUT_S, DEFAULT_MAX_SESSIONS
from kakeya.runtime.tls import ClientTLS, ServerTLS, add_client_args, add_server_args


def add_common(p) -> None:
    """Every server: TLS and the session limit."""
    p.add_argument(
        "--max-sessions", type=int, default=DEFAULT_MAX_SESSIONS,
        help=f"concurrent sessions; one more is RESOURCE_EXHAUSTED (default {DEFAULT_MAX_SESSIONS}; the thread pool is sized from it)",
    )  # fmt: skip
    add_server_args(p)


def add_sessions(p, kv_budget: bool) -> None:
    """Verifier and drafter: admission queue, idle expiry, context limit."""
    if kv_budget:
        p.add_argument("--max-kv-bytes", type=int, default=0,
                       help="K/V budget of all sessions; a session is admitted only if its worst case fits (0: none)")
    p.add_argument("--queue", type=int, default=0, help="sessions that may wait for room instead of RESOURCE_EXHAUSTED (default 0)")
    p.add_argument("--queue-timeout", type=float, default=10.0, help="seconds a queued session waits at most (default 10)")
    p.add_argument("--idle-timeout", type=float, default=DEFAULT_IDLE_TIMEOUT_S,
                   help=f"close a session that sends nothing for this long (default {DEFAULT_IDLE_TIMEOUT_S:g} s; 0: never)")
    p.add_argument("--max-context", type=int, default=0,
                   help="most positions one session may hold (default: the model's max_position_embeddings)")
    p.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH,
                   help=f"most sessions' steps that queue up together and run as one batched forward"
                        f" (default {DEFAULT_MAX_BATCH}; 1: each session's step alone, in turn)")  # fmt: skip


def byte_size(text: str) -> int:
    """``--prefix-cache-bytes``: a byte count, optionally with a binary suffix (``512M``, ``2G``, ``1.5GiB``)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}.get(t[-1:], 1)
    try:
        n = float(t[:-1] if scale > 1 else t) * scale
    except ValueError:
        raise ValueError(f"--prefix-cache-bytes must be a byte count like 1073741824, 512M or 2G, got {text!r}") from None
    if n < 0:
        raise ValueError(f"--prefix-cache-bytes must be >= 0, got {text!r}")
    return int(n)


def add_prefix_cache(p, where: str) -> None:
    """Verifier, drafter, colocated orchestrator, ``serve all``: the prefix cache's budget (``core/prefix.py``)."""
    p.add_argument(
        "--prefix-cache-bytes", type=byte_size, default=0, metavar="BYTES",
        help=f"keep finished generations' state (up to BYTES, e.g. 2G; least recently used evicted) so a prompt that"
             f" extends one (a chat's next turn) resumes it instead of prefilling; {where} (default 0: off)",
    )  # fmt: skip


def add_restore(p) -> None:
    """Restoration sources, chosen by name on the wire (replaces the plain --restore of the cache flags)."""
    p.add_argument("--restore", action="append", metavar="NAME=DIR",
                   help="an f_theta restoration source (repeatable); a bare DIR is the source 'default' and the"
                        " default policy's; requests choose sources by NAME (CachePolicy.restore_path)")  # fmt: skip


def add_orchestrator(p) -> None:
    p.add_argument("--max-prompt-tokens", type=int, default=0,
                   help="longest prompt accepted (default 8192, never above the target's max_position_embeddings)")
    p.add_argument("--auth-token-file", help="require `authorization: Bearer <token>` on the public API (health stays open)")
    p.add_argument("--backend-timeout", type=float, default=2.0,
                   help="split: floor of the per-step deadline on verifier/drafter calls (default 2 s; 20x the median step if longer)")
    add_client_args(p, "the verifier and drafter")


def add_http(p) -> None:
    """The orchestrator's OpenAI-compatible HTTP front (``orchestrator/http_server.py``)."""
    p.add_argument("--http-port", type=int, default=None,
                   help="also serve the OpenAI HTTP API (/v1/completions, /v1/chat/completions, /v1/models, /health) on"
                        " this port of --host, with the gRPC server's TLS and bearer token (0: any free port; default: off)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id of the HTTP API (default: the target checkpoint's directory name)")


def add_client(p) -> None:
    add_client_args(p)
    p.add_argument("--auth-token-file", help="send `authorization: Bearer <token>` read from this file")


def session_limits(args, kv_budget: bool) -> dict:
    out = {
        "queue": args.queue,
        "queue_timeout_s": args.queue_timeout,
        "idle_timeout_s": args.idle_timeout,
        "max_context": args.max_context,
        "max_batch": args.max_batch,
        "prefix_cache_bytes": args.prefix_cache_bytes,
    }
    if kv_budget:
        out["max_kv_bytes"] = args.max_kv_bytes
    for k in ("queue", "max_context") + (("max_kv_bytes",) if kv_budget else ()):
        if out[k] < 0:
            raise ValueError(f"--{k.replace('_', '-')} must be >= 0, got {out[k]}")
    if args.max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, got {args.max_batch}")
    if args.max_sessions < 0:
        raise ValueError(f"--max-sessions must be >= 0, got {args.max_sessions}")
    return out


def restore_sources(args):
    """(sources, the default policy's directory or None) from the repeatable --restore."""
    from kakeya.runtime.bounds import RestoreSources

    sources = RestoreSources.parse(args.restore or [])
    return sources, sources.default_path


def server_tls(args) -> ServerTLS:
    return ServerTLS.from_args(args)


def client_tls(args) -> ClientTLS:
    return ClientTLS.from_args(args)


def auth_token(args) -> str | None:
    from kakeya.runtime.guard import read_token

    return read_token(args.auth_token_file) if getattr(args, "auth_token_file", None) else None


def child_argv(args, role: str) -> list[str]:
    """What ``serve all`` passes on to one child (``verifier``, ``drafter`` or ``orchestrator``)."""
    tls = server_tls(args)
    out = ["--max-sessions", str(args.max_sessions), *tls.argv()]
    if role in ("verifier", "drafter"):
        out += ["--queue", str(args.queue), "--queue-timeout", str(args.queue_timeout),
                "--idle-timeout", str(args.idle_timeout), "--max-context", str(args.max_context),
                "--max-batch", str(args.max_batch), "--prefix-cache-bytes", str(args.prefix_cache_bytes)]  # fmt: skip
        if role == "verifier":
            out += ["--max-kv-bytes", str(args.max_kv_bytes)]
            out += [x for spec in args.restore or [] for x in ("--restore", spec)]
        return out
    out += ["--max-prompt-tokens", str(args.max_prompt_tokens), "--backend-timeout", str(args.backend_timeout),
            "--default-max-tokens", str(args.default_max_tokens)]  # fmt: skip
    if args.auth_token_file:
        out += ["--auth-token-file", args.auth_token_file]
    if args.http_port is not None:
        out += ["--http-port", str(args.http_port)]
    if args.served_model_name:
        out += ["--served-model-name", args.served_model_name]
    if tls.enabled:  # the children share one certificate: the orchestrator trusts it towards its backends
        ca = args.tls_ca or args.tls_client_ca or args.tls_cert
        out += ["--tls-ca", ca]
        if tls.client_ca:  # mutual TLS between the children: the orchestrator presents the same pair
            out += ["--tls-client-cert", args.tls_client_cert or args.tls_cert,
                    "--tls-client-key", args.tls_client_key or args.tls_key]  # fmt: skip
    return out


def client_channel(args):
    """The client's channel to ``args.addr`` (TLS with --tls-ca); a bearer token (--auth-token-file) rides on every call."""
    from kakeya.runtime.tls import channel
    from kakeya.wire.limits import channel_options

    ch = channel(args.addr, client_tls(args), channel_options())
    token = auth_token(args)
    if token is None:
        return ch
    return grpc.intercept_channel(ch, _Bearer(token))


class _Bearer(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds ``authorization: Bearer <token>`` to unary and server-streaming calls."""

    def __init__(self, token: str):
        self.header = ("authorization", f"Bearer {token}")

    def _with(self, d):
        return _Details(d, list(d.metadata or []) + [self.header])

    def intercept_unary_unary(self, cont, details, request):
        return cont(self._with(details), request)

    def intercept_unary_stream(self, cont, details, request):
        return cont(self._with(details), request)


class _Details(grpc.ClientCallDetails):
    """``grpc.ClientCallDetails`` with other metadata (the interceptor API has no constructor for it)."""

    def __init__(self, d, metadata):
        self.method, self.timeout, self.metadata = d.method, d.timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = d.credentials, d.wait_for_ready, d.compression
