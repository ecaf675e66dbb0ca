"""``kakeya serve verifier|drafter|orchestrator|all``: run the gRPC services (README, "Split over gRPC").

Without checkpoint paths every server uses the embedded pair, as ``kakeya generate`` does; ``--backend
auto`` is resolved here, so each process is told a concrete backend. ``serve all`` runs the three as
processes (``supervisor.py``). Every server: gRPC health and reflection, SERVING only once
loaded and warmed up (``--ready-file`` written then), SIGTERM drains in-flight streams for ``--grace``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from kakeya.app import flags as serve_flags
from kakeya.app.options import add_backend_args, add_cache_args, add_torch_threads, cache_policy_from_args
from kakeya.runtime.security.tls import ClientTLS, ServerTLS

DEFAULT_PORTS = {"orchestrator": 50051, "verifier": 50061, "drafter": 50062}


def _aux_layers(text: str | None, draft: str | None) -> list[int]:
    if text:
        try:
            return [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--aux-layers must be comma-separated layer ids, got {text!r}") from None
    if draft:
        from kakeya.checkpoints.config import load_draft_config

        return list(load_draft_config(draft)["dflash_config"]["target_layer_ids"])
    return []


def _common(p: argparse.ArgumentParser, name: str) -> None:
    port = DEFAULT_PORTS[name]
    p.add_argument(
        "--host", default="127.0.0.1", help="interface to listen on (0.0.0.0 / [::] for all; default 127.0.0.1)"
    )
    p.add_argument("--port", type=serve_flags.port, default=port, help=f"port (0: any free port; default {port})")
    p.add_argument("--grace", type=serve_flags.seconds, default=30.0,
                   help="seconds SIGTERM or Ctrl-C waits for in-flight streams (default 30; a second one: none)")  # fmt: skip
    p.add_argument("--ready-file", help="write {addr, port, pid} as JSON here once SERVING")
    serve_flags.add_common(p)
    p.add_argument("--metrics-port", type=serve_flags.port,
                   help="serve Prometheus /metrics on this port of --host (0: any free port; default:"
                        " off)")  # fmt: skip
    p.add_argument("--health-port", type=serve_flags.port,
                   help="also answer gRPC health, alone and in plaintext, on this port of --host (for probes"
                        " that speak no TLS, e.g. Kubernetes'; 0: any free port; default: off)")  # fmt: skip
    p.add_argument(
        "--log-format", default="text", choices=["text", "json"], help="stderr log lines: text or JSON (default text)"
    )


def _pin(args) -> None:
    """``--cpus``: pin this process (every thread, and those it starts later) before it loads anything."""
    if getattr(args, "cpus", None):
        from kakeya.runtime import placement

        placement.pin_process(placement.parse_cpus(args.cpus))


def _run(spec, args) -> int:
    from kakeya.runtime.lifecycle import run_server
    from kakeya.runtime.logs import setup_logging

    setup_logging(spec.name, args.log_format)
    rc = run_server(spec, args.host, args.port, args.grace, args.ready_file, args.metrics_port, args.health_port)
    # Everything is drained and closed. Leave without joining the compute thread: MLX aborts the process ("terminate
    # called without an active exception") when the thread that owns its arrays is joined while they are alive.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def cmd_serve_verifier(args) -> int:
    from kakeya.orchestrator.assembly import pair_paths
    from kakeya.verifier.server import server_spec

    _pin(args)
    if args.target is None:  # the embedded pair (its drafter's aux layers by default)
        target, draft = pair_paths(None, None)
        draft = args.draft or draft
    else:  # without --draft/--aux-layers, sessions must name their aux layers at Open
        target, draft = args.target, args.draft
    layers = _aux_layers(args.aux_layers, draft)
    restore, args.restore = serve_flags.restore_sources(args)  # the default policy's: the bare DIR
    tls, token = serve_flags.internal_auth(args, "verifier")
    backend, kwargs = _backend_kwargs(args, embedded=args.target is None, server="verifier")
    limits = serve_flags.session_limits(args, kwargs.get("device"))
    spec = server_spec(
        target, layers, backend, limits, restore=restore, tls=tls, token=token, policy=_default_policy(args), **kwargs
    )
    return _run(spec, args)


def _default_policy(args):
    """The sessions' default cache policy from --cache & co. (each request may send its own)."""
    from kakeya.core.request import CachePolicy

    return cache_policy_from_args(args) or CachePolicy()  # checked against the model when it loads


def cmd_serve_drafter(args) -> int:
    from kakeya.drafter.server import server_spec
    from kakeya.orchestrator.assembly import pair_paths

    _pin(args)
    target, draft = pair_paths(args.target, args.draft)
    tls, token = serve_flags.internal_auth(args, "drafter")
    backend, kwargs = _backend_kwargs(args, embedded=args.target is None, server="drafter")
    limits = serve_flags.session_limits(args, kwargs.get("device"))
    return _run(server_spec(draft, target, backend, limits, tls=tls, token=token, **kwargs), args)


def _backend_kwargs(args, embedded: bool, server: str | None = None) -> tuple[str, dict]:
    """The concrete backend for --backend (auto: the fastest here) and, for torch, where and in which
    dtype (and for a ``server``, verifier or drafter, its fast-path options); pins torch's CPU threads
    (``--torch-threads``) for this process."""
    from kakeya.app.options import torch_options
    from kakeya.orchestrator.assembly import check_compile, refuse_torch_flags, resolve_backend, set_torch_threads

    backend, device = resolve_backend(args.backend, args.device)
    refuse_torch_flags((backend,), device, args.dtype, torch_options(args))
    set_torch_threads(args.torch_threads, device, embedded, backend)
    if backend != "torch":
        return backend, {}
    kwargs = {"device": device} | ({"dtype": args.dtype} if args.dtype else {})
    if server is not None:
        kwargs |= torch_options(args, drafter=server == "drafter")
        check_compile(kwargs, device)
    return backend, kwargs


def cmd_serve_orchestrator(args) -> int:
    from kakeya.drafter.loader import local_drafter
    from kakeya.orchestrator.assembly import build_local_engine, require_backend, split_engine
    from kakeya.orchestrator.fronts.grpc_server import GenerationServicer, server_spec

    _pin(args)
    if args.drafter and not args.verifier:
        raise ValueError("--drafter needs --verifier (a remote drafter with an in-process verifier is not supported)")
    prefixes = None
    here = None  # the split's drafter in this process (--draft): its backend and options
    if args.verifier:
        if args.draft and (args.drafter or args.no_drafter or not args.target):
            raise ValueError("--draft with --verifier loads the drafter here: it needs --target (the checkpoint whose"
                             " embeddings and head it shares), and neither --drafter nor --no-drafter")  # fmt: skip
        if args.target and not args.draft:
            raise ValueError("--target with --verifier is the in-process drafter's: give --draft too (see --tokenizer)")
        held = {"--cache": args.cache != "native", "--sink": args.sink != 4, "--window": args.window,  # their defaults
                "--full-kv-bits": args.full_kv_bits, "--restore": args.restore,
                "--prefix-cache-bytes": args.prefix_cache_bytes not in (serve_flags.AUTO, 0)}  # fmt: skip
        if not args.draft:  # no model in this process: its backend's flags are the servers' too
            held |= {"--backend": args.backend != "auto", "--device": args.device, "--dtype": args.dtype,
                     "--torch-threads": args.torch_threads is not None, "--compile": args.compile,
                     "--cuda-graphs": args.cuda_graphs != "auto", "--graphed-min-batch": args.graphed_min_batch}  # fmt: skip
        if given := [flag for flag, value in held.items() if value]:  # the models' state, the sessions' default policy
            raise ValueError(f"{given[0]} is the verifier's (and the drafter's) to set: give it to those servers")
        if args.draft:
            here = _backend_kwargs(args, embedded=False, server="drafter")
            require_backend(here[0])

        client_tls, backend_token = ClientTLS.from_args(args), serve_flags.auth_token(args, "--backend-token-file")

        def build():
            drafter = None if args.no_drafter else args.drafter
            if here is not None:
                drafter = local_drafter(args.draft, args.target, here[0], **here[1])
            return split_engine(args.verifier, drafter, args.tokenizer or args.target,
                                120.0 if args.backend_wait is None else args.backend_wait,
                                tls=client_tls, token=backend_token, backend_timeout_s=args.backend_timeout,
                                ngram=args.ngram == "on")  # fmt: skip

        sources = None
    else:
        split_only = {"--backend-token-file": args.backend_token_file, "--tokenizer": args.tokenizer,
                      "--backend-wait": args.backend_wait is not None}  # fmt: skip
        if given := [flag for flag, value in split_only.items() if value]:
            raise ValueError(f"{given[0]} is for a split orchestrator (--verifier): colocated, the models are here")
        sources, args.restore = serve_flags.restore_sources(args)

        backend, kwargs = _backend_kwargs(args, embedded=args.target is None)
        budget = serve_flags.prefix_cache_bytes(args, kwargs.get("device"))
        if budget:  # one budget for both models' snapshots
            from kakeya.core.prefix import PrefixCache

            prefixes = PrefixCache(budget)

        def build():  # no paths: the embedded pair, as `kakeya generate`
            from kakeya.app.options import torch_options

            options = torch_options(args) if backend == "torch" else None
            return build_local_engine(args.target, args.draft, backend, kwargs.get("device"), kwargs.get("dtype"),
                                      _default_policy(args), no_drafter=args.no_drafter, torch_options=options,
                                      prefixes=prefixes, ngram=args.ngram == "on")  # fmt: skip

    servicer = GenerationServicer(
        build, colocated=not args.verifier, models_here=not args.verifier or here is not None,
        max_tokens_limit=args.max_tokens_limit,
        default_max_tokens=args.default_max_tokens, max_sessions=args.max_sessions,
        max_sessions_per_peer=args.max_sessions_per_peer, queue=args.queue, queue_timeout_s=args.queue_timeout,
        max_prompt_tokens=args.max_prompt_tokens, restore=sources, auth_token=serve_flags.auth_token(args),
        prefixes=prefixes,
    )  # fmt: skip
    http = None
    if args.http_port is not None:
        from kakeya.orchestrator.fronts.http_server import HttpFront

        http = HttpFront(servicer, args.http_port, args.served_model_name, timeouts=serve_flags.http_timeouts(args))
    return _run(server_spec(servicer, tls=ServerTLS.from_args(args), http=http), args)


def register(sub) -> None:
    p = sub.add_parser("serve", help="run the gRPC services (verifier, drafter, orchestrator, or all three)")
    roles = p.add_subparsers(dest="role", required=True)

    v = roles.add_parser("verifier", help="the target model and its per-session KV caches")
    _common(v, "verifier")
    _cpus_arg(v)
    v.add_argument("--target", help="Gemma-4 target checkpoint directory (default: the embedded pair's)")
    v.add_argument(
        "--draft", help="a DFlash drafter directory: only its target_layer_ids are read (the default aux layers)"
    )
    v.add_argument("--aux-layers", help="default aux layers, e.g. 1,4 (sessions may send their own)")
    add_backend_args(v)
    add_cache_args(v, restore_sources=True)
    _sessions_server(v, "on the device beside the sessions' K/V, outside --max-kv-bytes")
    v.set_defaults(func=cmd_serve_verifier)

    d = roles.add_parser("drafter", help="the DFlash drafter and its per-session context caches")
    _common(d, "drafter")
    _cpus_arg(d)
    d.add_argument("--draft", help="DFlash drafter checkpoint directory")
    d.add_argument("--target", help="the target checkpoint: only its embedding and LM head are loaded")
    add_backend_args(d)
    _sessions_server(d, "the sessions' context caches")
    d.set_defaults(func=cmd_serve_drafter)

    o = roles.add_parser("orchestrator", help="the public Generate API (split: --verifier/--drafter; else colocated)")
    _common(o, "orchestrator")
    _cpus_arg(o)
    o.add_argument("--verifier", metavar="TARGET",
                   help="a `kakeya serve verifier`: HOST:PORT, or a gRPC target naming several replicas"
                        " (dns:///verifier-headless:50061, ipv4:H1:P,H2:P); each session goes to the next SERVING"
                        " one")  # fmt: skip
    o.add_argument(
        "--drafter", metavar="TARGET", help="a `kakeya serve drafter`: HOST:PORT or a gRPC target, as --verifier"
    )
    o.add_argument("--target", help="colocated: target checkpoint loaded in this process; split (--verifier): the"
                                    " one whose embeddings and head the in-process drafter shares")  # fmt: skip
    o.add_argument("--draft", help="drafter checkpoint loaded in this process: colocated, or split with --verifier"
                                   " (one round trip a block instead of two)")  # fmt: skip
    o.add_argument("--no-drafter", action="store_true", help="no speculation: the verifier decodes alone")
    o.add_argument(
        "--tokenizer",
        help="split: directory with the target's tokenizer.json (default: the verifier's path, if readable)",
    )
    add_backend_args(o, help_suffix=" (the models in this process)")
    serve_flags.add_backend_auth(o)
    # colocated: the sessions' default policy, and one prefix-cache budget for the verifier's and the drafter's
    _policy_and_front(o, "colocated: one budget for the verifier's and the drafter's")
    o.add_argument(
        "--backend-wait",
        type=serve_flags.seconds,
        help="split: seconds to wait for verifier/drafter at start (default 120)",
    )
    _limits(o)
    serve_flags.add_queue(o, "generations")  # `serve all` has it from add_sessions, for its three processes
    o.set_defaults(func=cmd_serve_orchestrator)

    a = roles.add_parser("all", help="verifier, drafter and orchestrator as three local processes")
    _common(a, "orchestrator")
    a.add_argument("--target", help="target checkpoint (default: the embedded pair, as `kakeya generate`)")
    a.add_argument("--draft", help="drafter checkpoint")
    a.add_argument("--backend", default="auto", choices=["auto", "mlx", "torch"],
                   help="both model processes' backend (default auto: MLX on Apple silicon, torch elsewhere)")  # fmt: skip
    for role in ("verifier", "drafter"):
        a.add_argument(f"--{role}-backend", choices=["auto", "mlx", "torch"], help=f"the {role}'s (default --backend)")
    a.add_argument("--device", help="torch processes: cuda, cuda:1, cpu (default: cuda when available, else cpu)")
    a.add_argument("--dtype", help="torch processes: float32, bfloat16, float16 (default float32)")
    add_torch_threads(a)
    a.add_argument("--placement", default="auto", choices=["auto", "off"],
                   help="auto (default): on Linux, torch on the CPU and 2+ CPUs, pin the verifier to its own CPUs and"
                        " the drafter and orchestrator to the rest (docs/operations.md, \"Placement\", says why); off:"
                        " no pinning")  # fmt: skip
    serve_flags.add_sessions(a)  # the verifier's and drafter's (--max-kv-bytes: the verifier's)
    # the verifier process's default policy; each of the verifier and drafter processes keeps a prefix cache
    _policy_and_front(a, "the verifier and the drafter process each keep one of this budget")
    a.add_argument("--start-timeout", type=serve_flags.seconds, default=600.0, help="seconds each child may take to be SERVING (default 600)")  # fmt: skip
    _limits(a)
    from kakeya.app.supervisor import cmd_serve_all

    a.set_defaults(func=cmd_serve_all)


def _sessions_server(p, prefix_cache_where: str) -> None:
    """What the verifier and the drafter share as servers of sessions: the limits, who may open a session
    and the prefix cache's budget (``prefix_cache_where``: where it lives)."""
    serve_flags.add_sessions(p)
    serve_flags.add_internal_auth(p)
    serve_flags.add_prefix_cache(p, prefix_cache_where)


def _policy_and_front(p, prefix_cache_help: str) -> None:
    """What an orchestrator that may hold the sessions takes: the cache policy and f_theta restores, its
    public front (limits, HTTP) and the prefix cache's budget."""
    add_cache_args(p, restore_sources=True)
    serve_flags.add_orchestrator(p)
    serve_flags.add_http(p)
    serve_flags.add_prefix_cache(p, prefix_cache_help)


def _cpus_arg(p) -> None:
    p.add_argument("--cpus", help="Linux: pin this process to these CPUs, e.g. 0 or 2-3 (default: none; `serve all`"
                                  " places its processes itself, see its --placement)")  # fmt: skip


def _limits(p) -> None:
    from kakeya.orchestrator.decode.checks import DEFAULT_MAX_TOKENS
    from kakeya.orchestrator.fronts.service import DEFAULT_MAX_TOKENS_LIMIT

    p.add_argument("--max-tokens-limit", type=int, default=DEFAULT_MAX_TOKENS_LIMIT, help="largest max_tokens accepted (default %(default)s)")  # fmt: skip
    p.add_argument("--default-max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="what max_tokens = 0 means (default %(default)s)")  # fmt: skip
