"""The hardening flags of ``kakeya serve ...`` and ``kakeya client``: limits, admission, TLS, tokens.

Registered here and turned into the servers' keyword arguments here, so the
commands themselves (``serve.py``) stay about starting processes.
"""

from __future__ import annotations

import argparse
import sys
from contextlib import suppress

from kakeya.app.options import add_ngram
from kakeya.runtime.admission import DEFAULT_IDLE_TIMEOUT_S, DEFAULT_MAX_SESSIONS, DEFAULT_RECLAIM_IDLE_S
from kakeya.runtime.bounds import HttpTimeouts, RestoreSources
from kakeya.runtime.compute import DEFAULT_MAX_BATCH
from kakeya.runtime.security.auth import check_exposure, read_token, with_bearer
from kakeya.runtime.security.tls import ClientTLS, ServerTLS, add_client_args, add_server_args, channel
from kakeya.runtime.spare import auto_prefix_cache_bytes


def port(text: str) -> int:  # gRPC took 99999 modulo 65536 (another port), a socket raised: refused by its flag
    if not 0 <= (value := int(text)) <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 (any free port) to 65535, got {value}")
    return value


def seconds(text: str) -> float:  # --grace -1 ran as 0, a NaN as no wait: a length of time is a number >= 0
    if not (value := float(text)) >= 0:
        raise argparse.ArgumentTypeError(f"a number of seconds >= 0, got {text}")
    return value


def add_common(p) -> None:
    """Every server: TLS and the session limits."""
    p.add_argument(
        "--max-sessions", type=int, default=DEFAULT_MAX_SESSIONS,
        help=f"concurrent sessions; one more is RESOURCE_EXHAUSTED (default {DEFAULT_MAX_SESSIONS}; 0: no limit; the thread pool is sized from it)",
    )  # fmt: skip
    p.add_argument("--max-sessions-per-peer", type=int, default=0,
                   help="most sessions one caller (one client address) may hold at once (0: no cap but"
                        " --max-sessions)")  # fmt: skip
    add_server_args(p)


def add_internal_auth(p) -> None:
    """Verifier and drafter: who may open sessions (docs/security.md)."""
    p.add_argument("--auth-token-file", help="require `authorization: Bearer <token>` (the orchestrators'"
                                             " --backend-token-file); health stays open")  # fmt: skip
    p.add_argument("--insecure", action="store_true",
                   help="listen beyond loopback without client authentication (neither --tls-client-ca nor"
                        " --auth-token-file): only behind something that authenticates callers")  # fmt: skip


def add_sessions(p) -> None:
    """Verifier and drafter: memory budget, admission queue, idle expiry and reclaim, context limit."""
    p.add_argument("--max-kv-bytes", type=lambda text: byte_size(text, auto=False), default=0, metavar="BYTES",
                   help="K/V budget of all sessions, e.g. 16G (0: none): the verifier admits a session only if its worst case"
                        " fits; the drafter lets a session's context cache grow only while it fits")  # fmt: skip
    add_queue(p, "sessions")
    p.add_argument("--idle-timeout", type=float, default=DEFAULT_IDLE_TIMEOUT_S,
                   help=f"close a session that sends nothing for this long (default {DEFAULT_IDLE_TIMEOUT_S:g} s;"
                        " 0: never)")  # fmt: skip
    p.add_argument("--reclaim-idle", type=float, default=DEFAULT_RECLAIM_IDLE_S,
                   help="when a limit would refuse a new session, first end sessions whose clients have sent nothing"
                        f" for this long, longest idle first (default {DEFAULT_RECLAIM_IDLE_S:g} s; 0: never)")  # fmt: skip
    p.add_argument("--max-context", type=int, default=0,
                   help="most positions one session may hold (default: the model's"
                        " max_position_embeddings)")  # fmt: skip
    p.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH,
                   help=f"most sessions' steps that queue up together and run as one batched forward"
                        f" (default {DEFAULT_MAX_BATCH}; 1: each session's step alone, in turn)")  # fmt: skip


AUTO = "auto"


def byte_size(text: str, auto: bool = True) -> int | str:
    """``--prefix-cache-bytes`` and ``--max-kv-bytes``: a byte count, optionally with a binary suffix (``512M``,
    ``2G``, ``1.5GiB``), or where ``auto``, ``auto`` (:func:`prefix_cache_bytes` sizes it when the server starts)."""
    if auto and text.strip().lower() == AUTO:
        return AUTO
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}.get(t[-1:], 1)
    with suppress(ValueError):
        if 0 <= (n := float(t[:-1] if scale > 1 else t) * scale) < float("inf"):  # inf, nan: no int to make
            return int(n)
    raise argparse.ArgumentTypeError(f"a byte count >= 0 like 1073741824, 512M or 2G{', or auto' * auto}, got {text!r}")


def add_queue(p, what: str) -> None:
    """``--queue N --queue-timeout S``: ``what`` (sessions of a verifier or drafter, generations of an
    orchestrator) that wait for room instead of RESOURCE_EXHAUSTED; ``serve all`` gives its three the same."""
    p.add_argument(
        "--queue", type=int, default=0,
        help=f"{what} that may wait for room (--max-sessions) instead of RESOURCE_EXHAUSTED / HTTP 429 (default 0)",
    )  # fmt: skip
    p.add_argument("--queue-timeout", type=float, default=10.0, help=f"seconds queued {what} wait at most (default 10)")


def add_prefix_cache(p, where: str) -> None:
    """Verifier, drafter, colocated orchestrator, ``serve all``: the prefix cache's budget (``core/prefix.py``)."""
    p.add_argument(
        "--prefix-cache-bytes", type=byte_size, default=AUTO, metavar="BYTES",
        help=f"keep finished generations' state (up to BYTES, e.g. 2G; least recently used evicted) so a prompt that"
             f" extends one (a chat's next turn) resumes it instead of prefilling; {where} (default auto: a tenth"
             " of the memory it lives in that is free when the server starts -- a CUDA device's, else the host's"
             " available memory within its container -- at most 4G; 0: off)",
    )  # fmt: skip


def prefix_cache_bytes(args, device: str | None = None) -> int:
    """``--prefix-cache-bytes`` in bytes; ``auto`` is ``runtime/spare.py``'s share of the memory the snapshots live
    in: ``device``'s when it is a CUDA device (a torch backend keeps them beside the model), else the host's."""
    if args.prefix_cache_bytes != AUTO:
        return args.prefix_cache_bytes

    free = None
    if device is not None and device.startswith("cuda"):
        from kakeya.backends.torch.memory import device_free_bytes

        free = device_free_bytes(device)
    return auto_prefix_cache_bytes(free)


def add_orchestrator(p) -> None:
    p.add_argument("--max-prompt-tokens", type=int, default=0,
                   help="longest prompt accepted (default 8192, never above the target's"
                        " max_position_embeddings)")  # fmt: skip
    p.add_argument("--auth-token-file", help="require `authorization: Bearer <token>` on the public API (health"
                                             " stays open)")  # fmt: skip
    p.add_argument("--backend-timeout", type=float, default=2.0,
                   help="split: how long a verifier/drafter step may go without an answer or a progress message"
                        " before it counts as hung (default 2 s; 20x the median step if longer)")  # fmt: skip
    add_ngram(p)
    add_client_args(p, "the verifier and drafter")


def add_backend_auth(p) -> None:
    """The split orchestrator: the token its verifier and drafter require (their --auth-token-file)."""
    p.add_argument("--backend-token-file",
                   help="split: send `authorization: Bearer <token>` from this file to the verifier and"
                        " drafter")  # fmt: skip


def add_http(p) -> None:
    """The orchestrator's OpenAI-compatible HTTP front (``orchestrator/fronts/http_server.py``)."""
    p.add_argument("--http-port", type=port,
                   help="also serve the OpenAI HTTP API (/v1/completions, /v1/chat/completions, /v1/models, /health)"
                        " on this port of --host, with the gRPC server's TLS and bearer token (0: any free port;"
                        " default: off)")  # fmt: skip
    p.add_argument("--served-model-name",
                   help="the model id of the HTTP API (default: the target checkpoint's directory name)")  # fmt: skip
    t = HttpTimeouts()
    p.add_argument("--http-header-timeout", type=float, default=t.headers_s, metavar="S",
                   help="HTTP: close a connection whose request headers are not all in after S seconds (from the"
                        f" connection, or the request's first byte; default {t.headers_s:g})")  # fmt: skip
    p.add_argument("--http-body-timeout", type=float, default=t.body_s, metavar="S",
                   help=f"HTTP: answer 408 to a request whose body is not all in after S seconds (default {t.body_s:g})")  # fmt: skip
    p.add_argument("--http-keep-alive", type=float, default=t.keep_alive_s, metavar="S",
                   help=f"HTTP: close a keep-alive connection idle for S seconds (default {t.keep_alive_s:g})")  # fmt: skip


def http_timeouts(args) -> HttpTimeouts:
    """The HTTP front's bounds on slow clients (ValueError naming a flag that is not > 0)."""
    return HttpTimeouts(args.http_header_timeout, args.http_body_timeout, args.http_keep_alive)


def add_client(p) -> None:
    add_client_args(p)
    p.add_argument("--auth-token-file", help="send `authorization: Bearer <token>` read from this file")


def session_limits(args, device: str | None = None):
    """Verifier and drafter: their servicers' ``SessionLimits`` from the flags (``device``: where the model
    runs, None for MLX: what ``--prefix-cache-bytes auto`` is a share of)."""
    from kakeya.runtime.servicer import SessionLimits

    for flag, value in (("--queue", args.queue), ("--max-context", args.max_context),
                        ("--max-sessions-per-peer", args.max_sessions_per_peer), ("--reclaim-idle", args.reclaim_idle),
                        ("--max-sessions", args.max_sessions)):  # fmt: skip
        if value < 0:
            raise ValueError(f"{flag} must be >= 0, got {value}")
    if args.max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, got {args.max_batch}")
    return SessionLimits(
        max_sessions=args.max_sessions, max_kv_bytes=args.max_kv_bytes, queue=args.queue,
        queue_timeout_s=args.queue_timeout, idle_timeout_s=args.idle_timeout, max_per_peer=args.max_sessions_per_peer,
        reclaim_idle_s=args.reclaim_idle, max_context=args.max_context, max_batch=args.max_batch,
        prefix_cache_bytes=prefix_cache_bytes(args, device),
    )  # fmt: skip


def restore_sources(args):
    """(sources, the default policy's directory or None) from the repeatable --restore."""
    sources = RestoreSources.parse(args.restore or [])
    return sources, sources.default_path


def auth_token(args, flag: str = "--auth-token-file") -> str | None:
    """The token in ``flag``'s file, or None without one: callers must present ``--auth-token-file``'s, a split
    orchestrator sends its verifier and drafter ``--backend-token-file``'s."""
    path = getattr(args, flag[2:].replace("-", "_"))
    return read_token(path, flag) if path else None


def internal_auth(args, service: str) -> tuple[ServerTLS, str | None]:
    """A verifier's or drafter's TLS and token; ValueError when it would listen beyond loopback
    with neither mutual TLS nor a token and no ``--insecure`` (``auth.check_exposure``)."""
    tls, token = ServerTLS.from_args(args), auth_token(args)
    warning = check_exposure(
        service, args.host, mutual_tls=bool(tls.client_ca), token=token is not None, insecure=args.insecure
    )
    if warning:
        print(f"kakeya: warning: {warning}", file=sys.stderr)
    return tls, token


def child_argv(args, role: str, backend_token_file: str) -> list[str]:
    """What ``serve all`` passes on to one child (``verifier``, ``drafter`` or ``orchestrator``).

    ``backend_token_file``: the run's own secret, which verifier and drafter require and the
    orchestrator sends (so nothing else on this machine may open their sessions).
    """
    tls = ServerTLS.from_args(args)
    out = ["--max-sessions", str(args.max_sessions), *tls.argv()]
    if role in ("verifier", "drafter"):
        out += ["--queue", str(args.queue), "--queue-timeout", str(args.queue_timeout),
                "--idle-timeout", str(args.idle_timeout), "--reclaim-idle", str(args.reclaim_idle),
                "--max-context", str(args.max_context), "--max-batch", str(args.max_batch),
                "--auth-token-file", backend_token_file, "--prefix-cache-bytes", str(args.prefix_cache_bytes)]  # fmt: skip
        if role == "verifier":
            out += ["--max-kv-bytes", str(args.max_kv_bytes)]
            out += [x for spec in args.restore or [] for x in ("--restore", spec)]
        return out
    out += ["--queue", str(args.queue), "--queue-timeout", str(args.queue_timeout),
            "--max-prompt-tokens", str(args.max_prompt_tokens), "--backend-timeout", str(args.backend_timeout),
            "--default-max-tokens", str(args.default_max_tokens), "--max-sessions-per-peer", str(args.max_sessions_per_peer),
            "--backend-token-file", backend_token_file,
            "--ngram", args.ngram]  # fmt: skip
    if args.auth_token_file:
        out += ["--auth-token-file", args.auth_token_file]
    if args.http_port is not None:
        out += ["--http-port", str(args.http_port), "--http-header-timeout", str(args.http_header_timeout),
                "--http-body-timeout", str(args.http_body_timeout), "--http-keep-alive", str(args.http_keep_alive)]  # fmt: skip
    if args.served_model_name:
        out += ["--served-model-name", args.served_model_name]
    if tls.enabled:  # the children share one certificate: the orchestrator trusts it towards its backends
        ca = args.tls_ca or args.tls_client_ca or args.tls_cert
        out += ["--tls-ca", ca]
        if tls.client_ca:  # mutual TLS between the children: the orchestrator presents the same pair
            out += ["--tls-client-cert", args.tls_client_cert or args.tls_cert,
                    "--tls-client-key", args.tls_client_key or args.tls_key]  # fmt: skip
    return out


def client_channel(args, addr: str | None = None):
    """The client's channel to ``addr`` (default ``args.addr``; TLS with --tls-ca); a bearer token (--auth-token-file)
    rides on every call."""
    from kakeya.wire.limits import channel_options

    if args.timeout is not None and args.timeout <= 0:  # a deadline already past: gRPC fails the call at once
        raise ValueError(f"--timeout: must be > 0 seconds, got {args.timeout}")
    return with_bearer(channel(addr or args.addr, ClientTLS.from_args(args), channel_options()), auth_token(args))
