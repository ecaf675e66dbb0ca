"""``kakeya serve ...`` (run the gRPC services) and ``kakeya client ...`` (call them).

::

    kakeya serve verifier     --port P --target DIR [--draft DIR | --aux-layers 1,4] [--max-sessions N]
    kakeya serve drafter      --port P --draft DIR --target DIR [--max-sessions N]
    kakeya serve orchestrator --port P --verifier HOST:PORT [--drafter HOST:PORT]   (split)
    kakeya serve orchestrator --port P [--target DIR --draft DIR]                   (colocated)
    kakeya serve all          --port P [--target DIR --draft DIR]
    kakeya client --addr HOST:PORT generate [--prompt TEXT] [--max-tokens N] [--json] ...
    kakeya client --addr HOST:PORT info | health

Without checkpoint paths every server uses the embedded tiny pair. ``serve all``
runs verifier, drafter and orchestrator as three processes (the backends on
loopback ports of their own choosing), forwards SIGTERM/SIGINT to them in
order (orchestrator first, so it can drain), and takes them down with it if it
dies. Every server: gRPC health checking and reflection, SERVING only once
loaded and warmed up, ``--ready-file`` written at that moment, SIGTERM drains
in-flight streams for ``--grace`` seconds.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from . import serve_flags

DEFAULT_PORTS = {"orchestrator": 50051, "verifier": 50061, "drafter": 50062}


class ServeUsageError(ValueError):
    """A bad command line; `kakeya` prints it as one line and exits 2 (it catches ValueError).

    Not cli.UsageError: under `python -m services.orchestrator.cli` that module is
    ``__main__`` and a class imported from it again would be a different one.
    """


def _usage(msg: str) -> ServeUsageError:
    return ServeUsageError(msg)


def _pair(target: str | None, draft: str | None, need_draft: bool = True) -> tuple[str, str | None]:
    """Checkpoint paths, the embedded tiny pair when none are given."""
    if target is None and draft is None:
        from services.checkpoints.tiny import default_pair

        p = default_pair()
        return str(p.target), str(p.draft)
    if target is None or (need_draft and draft is None):
        raise _usage("give both --target and --draft, or neither (for the embedded default models)")
    return target, draft


def _aux_layers(text: str | None, draft: str | None) -> list[int]:
    if text:
        try:
            return [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise _usage(f"--aux-layers must be comma-separated layer ids, got {text!r}") from None
    if draft:
        from services.checkpoints.config import load_draft_config

        return list(load_draft_config(draft)["dflash_config"]["target_layer_ids"])
    return []


def _common(p: argparse.ArgumentParser, name: str) -> None:
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (0.0.0.0 / [::] for all; default 127.0.0.1)")
    p.add_argument("--port", type=int, default=DEFAULT_PORTS[name], help=f"port (0: any free port; default {DEFAULT_PORTS[name]})")
    p.add_argument("--grace", type=float, default=30.0, help="seconds SIGTERM waits for in-flight streams (default 30)")
    p.add_argument("--ready-file", help="write {addr, port, pid} as JSON here once SERVING")
    serve_flags.add_common(p)


def _run(spec, args) -> int:
    from services.serving import run_server, setup_logging

    setup_logging(spec.name)
    rc = run_server(spec, args.host, args.port, args.grace, args.ready_file)
    # Everything is drained and closed. Leave without joining the compute thread: MLX aborts the
    # process ("terminate called without an active exception") when the thread that owns its
    # arrays is joined while they are alive.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


# --------------------------------------------------------------------------- serve <role>


def cmd_serve_verifier(args) -> int:
    from services.verifier.server import server_spec

    if args.target is None:  # the embedded pair (its drafter's aux layers by default)
        target, draft = _pair(None, None)
        draft = args.draft or draft
    else:  # without --draft/--aux-layers, sessions must name their aux layers at Open
        target, draft = args.target, args.draft
    layers = _aux_layers(args.aux_layers, draft)
    limits = serve_flags.session_limits(args, kv_budget=True)
    limits["restore"], args.restore = serve_flags.restore_sources(args)  # the default policy's: the bare DIR
    kwargs = _backend_kwargs(args) | {"policy": _default_policy(args)}
    spec = server_spec(target, layers, args.backend, args.max_sessions, limits=limits, tls=serve_flags.server_tls(args), **kwargs)
    return _run(spec, args)


def _default_policy(args):
    """The sessions' default cache policy from --cache & co. (each request may send its own)."""
    from services.contract import CachePolicy

    from .cli import cache_policy_from_args

    return cache_policy_from_args(args) or CachePolicy()  # checked against the model when it loads


def cmd_serve_drafter(args) -> int:
    from services.drafter.server import server_spec

    target, draft = _pair(args.target, args.draft)
    limits = serve_flags.session_limits(args, kv_budget=False)
    tls = serve_flags.server_tls(args)
    return _run(server_spec(draft, target, args.backend, args.max_sessions, limits=limits, tls=tls, **_backend_kwargs(args)), args)


def _backend_kwargs(args) -> dict:
    """torch: where and in which dtype to load (MLX picks its own device)."""
    if args.backend != "torch":
        if args.device or args.dtype:
            raise _usage("--device/--dtype apply to --backend torch")
        return {}
    return {k: v for k, v in (("device", args.device), ("dtype", args.dtype)) if v}


def cmd_serve_orchestrator(args) -> int:
    from .server import GenerationServicer, colocated_engine, server_spec, split_engine

    if args.drafter and not args.verifier:
        raise _usage("--drafter needs --verifier (a remote drafter with an in-process verifier is not supported)")
    if args.verifier:
        if args.target or args.draft:
            raise _usage("--target/--draft load in-process models: leave them out with --verifier (see --tokenizer)")

        client_tls = serve_flags.client_tls(args)

        def build():
            drafter = None if args.no_drafter else args.drafter
            return split_engine(
                args.verifier, drafter, args.tokenizer, args.backend_wait, tls=client_tls, backend_timeout_s=args.backend_timeout
            )

        colocated = False
        sources = None
    else:
        sources, args.restore = serve_flags.restore_sources(args)

        def build():
            target, draft = _pair(args.target, args.draft)  # serve's default: the tiny pair, like verifier/drafter
            return colocated_engine(target, draft, args.backend, args.no_drafter, _default_policy(args))

        colocated = True
    servicer = GenerationServicer(
        build,
        colocated=colocated,
        max_tokens_limit=args.max_tokens_limit,
        default_max_tokens=args.default_max_tokens,
        max_sessions=args.max_sessions,
        max_prompt_tokens=args.max_prompt_tokens,
        restore=sources,
        auth_token=serve_flags.auth_token(args),
    )
    return _run(server_spec(servicer, tls=serve_flags.server_tls(args)), args)


# --------------------------------------------------------------------------- serve all


def _pdeathsig() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: the child gets SIGTERM when its parent dies (the parent-pid watchdog covers macOS)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


class Supervisor:
    """Children of ``serve all``: started in order, stopped in order, never left behind."""

    def __init__(self, grace: float):
        self.grace = grace
        self.procs: dict[str, subprocess.Popen] = {}
        self.stop = threading.Event()

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        from services.serving import ENV_PARENT_PID

        env = dict(os.environ, **{ENV_PARENT_PID: str(os.getpid())})
        cmd = [sys.executable, "-m", "services.orchestrator.cli", "serve", name, *argv]
        p = subprocess.Popen(
            cmd,
            env=env,
            start_new_session=True,  # a terminal's Ctrl-C reaches only us; we stop the children in order
            preexec_fn=_pdeathsig if sys.platform.startswith("linux") else None,
        )
        self.procs[name] = p
        return p

    def wait_ready(self, files: dict[str, Path], timeout: float) -> dict[str, dict]:
        deadline = time.monotonic() + timeout
        out: dict[str, dict] = {}
        while len(out) < len(files):
            for name, f in files.items():
                if name not in out and f.is_file():
                    out[name] = json.loads(f.read_text())
                p = self.procs[name]
                if name not in out and p.poll() is not None:
                    raise RuntimeError(f"{name} exited with status {p.returncode} before it was ready")
            if self.stop.is_set():
                raise KeyboardInterrupt
            if time.monotonic() > deadline:
                raise RuntimeError(f"not ready after {timeout:.0f} s: {sorted(set(files) - set(out))}")
            time.sleep(0.1)
        return out

    def exited(self) -> list[tuple[str, int]]:
        return [(n, p.returncode) for n, p in self.procs.items() if p.poll() is not None]

    def terminate(self, names: list[str]) -> None:
        live = [self.procs[n] for n in names if n in self.procs and self.procs[n].poll() is None]
        for p in live:
            p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.grace + 10
        for p in live:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def shutdown(self) -> None:
        self.terminate(["orchestrator"])  # drains its generations while the backends still answer
        self.terminate(["verifier", "drafter"])


def cmd_serve_all(args) -> int:
    from services.serving import setup_logging, write_ready_file

    from services.serving import port_in_use

    setup_logging("all")
    log = logging.getLogger("kakeya.all")
    target, draft = _pair(args.target, args.draft)
    serve_flags.restore_sources(args)  # bad --restore specs: a usage error now, not a child's exit
    serve_flags.server_tls(args), serve_flags.auth_token(args)
    taken = port_in_use(args.host, args.port)
    if taken:
        print(f"kakeya: error: serve all: cannot listen on {args.host}:{args.port}: {taken}", file=sys.stderr)
        return 2
    if args.ready_file:
        Path(args.ready_file).unlink(missing_ok=True)
    sup = Supervisor(args.grace)

    def on_signal(signum, _frame):
        log.info("received %s: stopping orchestrator, then verifier and drafter", signal.Signals(signum).name)
        sup.stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    common = ["--grace", str(args.grace)]
    rc = 0
    with tempfile.TemporaryDirectory(prefix="kakeya-serve-all-") as tmp:
        files = {n: Path(tmp) / f"{n}.json" for n in ("verifier", "drafter", "orchestrator")}
        try:
            back = ["--host", args.backend_host, "--port", "0"]
            torch_kw = [*(["--device", args.device] if args.device else []), *(["--dtype", args.dtype] if args.dtype else [])]
            vback = ["--backend", args.verifier_backend, *(torch_kw if args.verifier_backend == "torch" else [])]
            dback = ["--backend", args.drafter_backend, *(torch_kw if args.drafter_backend == "torch" else [])]
            cache = ["--cache", args.cache, "--sink", str(args.sink), "--full-kv-bits", str(args.full_kv_bits),
                     *(["--window", str(args.window)] if args.window else [])]  # fmt: skip
            vlim, dlim = serve_flags.child_argv(args, "verifier"), serve_flags.child_argv(args, "drafter")
            sup.spawn("verifier", [*back, "--target", target, "--draft", draft, *vback, *cache, "--ready-file", str(files["verifier"]), *common, *vlim])
            sup.spawn("drafter", [*back, "--draft", draft, "--target", target, *dback, "--ready-file", str(files["drafter"]), *common, *dlim])
            ready = sup.wait_ready({n: files[n] for n in ("verifier", "drafter")}, args.start_timeout)
            orch = [
                "--host", args.host, "--port", str(args.port),
                "--verifier", ready["verifier"]["addr"], "--drafter", ready["drafter"]["addr"],
                "--tokenizer", target, "--ready-file", str(files["orchestrator"]),
                "--max-tokens-limit", str(args.max_tokens_limit), *common, *serve_flags.child_argv(args, "orchestrator"),
            ]  # fmt: skip
            sup.spawn("orchestrator", orch)
            ready.update(sup.wait_ready({"orchestrator": files["orchestrator"]}, args.start_timeout))
            summary = {
                "addr": ready["orchestrator"]["addr"],
                "verifier": ready["verifier"]["addr"],
                "drafter": ready["drafter"]["addr"],
                "pids": {n: p.pid for n, p in sup.procs.items()},
                "pid": os.getpid(),
            }
            log.info("all SERVING: orchestrator %s, verifier %s, drafter %s", summary["addr"], summary["verifier"], summary["drafter"])
            if args.ready_file:
                write_ready_file(args.ready_file, summary)
            while not sup.stop.wait(0.5):
                gone = sup.exited()
                if gone:
                    log.error("%s exited unexpectedly: stopping the others", ", ".join(f"{n} (status {c})" for n, c in gone))
                    rc = 1
                    break
        except KeyboardInterrupt:
            pass
        except RuntimeError as exc:
            print(f"kakeya: error: serve all: {exc}", file=sys.stderr)
            rc = 1
        finally:
            sup.shutdown()
            if args.ready_file:
                Path(args.ready_file).unlink(missing_ok=True)
    return rc


# --------------------------------------------------------------------------- client


def _channel(args):
    return serve_flags.client_channel(args)


def _rpc_error(exc) -> int:
    code = exc.code().name if exc.code() else "UNKNOWN"
    print(f"kakeya: error: {code}: {exc.details()}", file=sys.stderr)
    return 1


def report_from_stream(model, server, complete, token_ids: list[int], text: str) -> dict:
    """The ``kakeya generate --json`` object, rebuilt from a Generate stream's messages.

    Goes through ``Engine.report`` itself (on a Generation rebuilt from the
    Complete message), so the keys and their rounding are the CLI's own.
    """
    from services.wire.kakeya.v1 import generate_pb2 as pb

    from services.wire import contract as wire_contract
    from .engine import Engine, Request
    from .loop import Block, Generation

    s = complete.stats
    blocks = [Block(token_ids[:1], 0, 0)] + [Block([0] * n, n - 1, n - 1) for n in s.acceptance_lengths]
    gen = Generation(
        prompt_ids=list(complete.prompt_token_ids),
        token_ids=list(token_ids),
        blocks=blocks,
        finish_reason=pb.FinishReason.Name(complete.finish_reason).removeprefix("FINISH_REASON_").lower(),
        prefill_s=s.prefill_s,
        decode_s=s.decode_s,
        drafter_fallback=s.drafter_fallback,
        verifier_stats={
            "kv_bytes": {"sliding": s.verifier_kv_bytes_sliding, "full": s.verifier_kv_bytes_full},
            "cache_policy": s.cache_policy,
            "bounded": s.cache_bounded,
        },
    )

    class _Streamed:  # the text as it was streamed (stop strings already cut)
        def decode(self, _ids):
            return text

    class _Remote:
        info = wire_contract.model_info_from_public(model, server.verifier_backend)

    engine = Engine(_Remote(), None, _Streamed(), target=model.target_model, draft=model.draft_model)
    out = engine.report(Request(gen.prompt_ids, block_size=s.block_size), gen)
    out["decode_tok_s"] = round(s.decode_tok_s, 3)  # the server's figure (same formula, its clock)
    return out


def generate_request(args):
    from services.wire.kakeya.v1 import generate_pb2 as pb

    from services.wire import contract as wire_contract

    from .cli import DEFAULT_PROMPT, cache_policy_from_args

    sp = pb.SamplingParams(
        max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos,
        stop=args.stop or [],
        stop_token_ids=args.stop_token_id or [],
        temperature=args.temperature,
    )
    req = pb.GenerateRequest(request_id=args.request_id or "", sampling_params=sp, block_size=args.block_size or 0)
    if args.prompt_ids is not None:
        try:
            ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError:
            raise _usage(f"--prompt-ids must be comma-separated token ids, got {args.prompt_ids!r}") from None
        req.tokenized.ids.extend(ids)
        if not ids:
            req.tokenized.SetInParent()
    else:
        req.text = args.prompt if args.prompt is not None else DEFAULT_PROMPT
    policy = cache_policy_from_args(args)
    if policy is not None:
        req.cache_policy.CopyFrom(wire_contract.policy_to_proto(policy))
    return req


def cmd_client_generate(args) -> int:
    import grpc

    from services.wire.kakeya.v1 import generate_pb2 as pb, generate_pb2_grpc

    from .cli import print_result

    if args.max_tokens < 1:
        raise _usage(f"max_tokens must be >= 1, got {args.max_tokens}")
    if args.block_size is not None and args.block_size < 1:  # as `kakeya generate`; 0 would mean "default" on the wire
        raise _usage(f"block_size must be between 1 and 16, got {args.block_size}")
    if args.prompt is not None and args.prompt_ids is not None:
        raise _usage("give --prompt or --prompt-ids, not both")
    req = generate_request(args)
    stub = generate_pb2_grpc.GenerationStub(_channel(args))
    ids: list[int] = []
    text: list[str] = []
    complete = None
    try:
        model = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=args.timeout or 30)
        server = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=args.timeout or 30)
        for resp in stub.Generate(req, timeout=args.timeout):
            if resp.HasField("chunk"):
                ids.extend(resp.chunk.token_ids)
                text.append(resp.chunk.text)
                if not args.json and resp.chunk.text:
                    sys.stdout.write(resp.chunk.text)
                    sys.stdout.flush()
            else:
                complete = resp.complete
    except grpc.RpcError as exc:
        if not args.json and text:
            print()
        return _rpc_error(exc)
    if complete is None:
        print("kakeya: error: the stream ended without a Complete message", file=sys.stderr)
        return 1
    out = report_from_stream(model, server, complete, ids, "".join(text))
    print_result(args, out)
    if complete.finish_reason == pb.FINISH_REASON_ERROR:
        print(f"kakeya: error: generation failed: {complete.error_message}", file=sys.stderr)
        return 1
    return 0


def cmd_client_info(args) -> int:
    import grpc
    from google.protobuf.json_format import MessageToDict

    from services.wire.kakeya.v1 import generate_pb2 as pb, generate_pb2_grpc

    stub = generate_pb2_grpc.GenerationStub(_channel(args))
    try:
        model = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=args.timeout or 10)
        server = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=args.timeout or 10)
    except grpc.RpcError as exc:
        return _rpc_error(exc)
    print(json.dumps({"model": MessageToDict(model), "server": MessageToDict(server)}, indent=1))
    return 0


def cmd_client_health(args) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub = health_pb2_grpc.HealthStub(_channel(args))
    try:
        r = stub.Check(health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout or 5)
    except grpc.RpcError as exc:
        return _rpc_error(exc)
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
    print(status)
    return 0 if r.status == health_pb2.HealthCheckResponse.SERVING else 1


# --------------------------------------------------------------------------- registration


def register_serve(sub) -> None:
    from .cli import add_cache_args

    p = sub.add_parser("serve", help="run the gRPC services (verifier, drafter, orchestrator, or all three)")
    roles = p.add_subparsers(dest="role", required=True)

    v = roles.add_parser("verifier", help="the target model and its per-session KV caches", conflict_handler="resolve")
    _common(v, "verifier")
    v.add_argument("--target", help="Gemma-4 target checkpoint directory (default: the embedded tiny target)")
    v.add_argument("--draft", help="a DFlash drafter directory: only its target_layer_ids are read (the default aux layers)")
    v.add_argument("--aux-layers", help="default aux layers, e.g. 1,4 (sessions may send their own)")
    _backend_args(v)
    add_cache_args(v)
    serve_flags.add_restore(v)
    serve_flags.add_sessions(v, kv_budget=True)
    v.set_defaults(func=cmd_serve_verifier)

    d = roles.add_parser("drafter", help="the DFlash drafter and its per-session context caches")
    _common(d, "drafter")
    d.add_argument("--draft", help="DFlash drafter checkpoint directory")
    d.add_argument("--target", help="the target checkpoint: only its embedding and LM head are loaded")
    _backend_args(d)
    serve_flags.add_sessions(d, kv_budget=False)
    d.set_defaults(func=cmd_serve_drafter)

    o = roles.add_parser(
        "orchestrator", help="the public Generate API (split: --verifier/--drafter; else colocated)", conflict_handler="resolve"
    )
    _common(o, "orchestrator")
    o.add_argument("--verifier", metavar="HOST:PORT", help="a `kakeya serve verifier` (split deployment)")
    o.add_argument("--drafter", metavar="HOST:PORT", help="a `kakeya serve drafter` (split deployment)")
    o.add_argument("--target", help="colocated: target checkpoint loaded in this process")
    o.add_argument("--draft", help="colocated: drafter checkpoint loaded in this process")
    o.add_argument("--no-drafter", action="store_true", help="no speculation: the verifier decodes alone")
    o.add_argument("--tokenizer", help="split: directory with the target's tokenizer.json (default: the verifier's path, if readable)")
    o.add_argument("--backend", default="mlx", choices=["mlx"], help="colocated backend")
    add_cache_args(o)  # colocated: the sessions' default policy
    serve_flags.add_restore(o)
    serve_flags.add_orchestrator(o)
    o.add_argument("--backend-wait", type=float, default=120.0, help="split: seconds to wait for verifier/drafter at start")
    _limits(o)
    o.set_defaults(func=cmd_serve_orchestrator)

    a = roles.add_parser("all", help="verifier, drafter and orchestrator as three local processes", conflict_handler="resolve")
    _common(a, "orchestrator")
    a.add_argument("--target", help="target checkpoint (default: the embedded tiny pair)")
    a.add_argument("--draft", help="drafter checkpoint")
    a.add_argument("--backend-host", default="127.0.0.1", help="interface of the verifier and drafter (default 127.0.0.1)")
    a.add_argument("--verifier-backend", default="mlx", choices=["mlx", "torch"], help="the verifier process's backend")
    a.add_argument("--drafter-backend", default="mlx", choices=["mlx", "torch"], help="the drafter process's backend")
    a.add_argument("--device", help="torch processes: cuda, cuda:1, cpu (default: the backend's)")
    a.add_argument("--dtype", help="torch processes: float32, bfloat16, float16 (default: the backend's)")
    add_cache_args(a)  # the verifier process's default policy
    serve_flags.add_restore(a)
    serve_flags.add_sessions(a, kv_budget=True)
    serve_flags.add_orchestrator(a)
    a.add_argument("--start-timeout", type=float, default=600.0, help="seconds to wait for each process to be SERVING")
    _limits(a)
    a.set_defaults(func=cmd_serve_all)


def _backend_args(p) -> None:
    p.add_argument("--backend", default="mlx", choices=["mlx", "torch"], help="mlx (Apple silicon / CPU) or torch (CUDA / CPU)")
    p.add_argument("--device", help="torch: cuda, cuda:1, cpu (default: the backend's)")
    p.add_argument("--dtype", help="torch: float32, bfloat16, float16 (default: the backend's)")


def _limits(p) -> None:
    from .server import DEFAULT_MAX_TOKENS, DEFAULT_MAX_TOKENS_LIMIT

    p.add_argument("--max-tokens-limit", type=int, default=DEFAULT_MAX_TOKENS_LIMIT, help="largest max_tokens accepted")
    p.add_argument("--default-max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="what max_tokens = 0 means")


def register_client(sub) -> None:
    from .cli import add_cache_args, add_generation_options

    p = sub.add_parser("client", help="call a running orchestrator (kakeya serve orchestrator|all)")
    p.add_argument("--addr", default=f"127.0.0.1:{DEFAULT_PORTS['orchestrator']}", help="HOST:PORT of the orchestrator")
    p.add_argument("--timeout", type=float, help="deadline in seconds (propagates to the verifier and drafter)")
    serve_flags.add_client(p)
    cmds = p.add_subparsers(dest="client_command", required=True)

    g = cmds.add_parser("generate", help="streaming generation, same options and --json as `kakeya generate`")
    add_generation_options(g)
    g.add_argument("--prompt-ids", help="pre-tokenized prompt, comma-separated ids (instead of --prompt)")
    g.add_argument("--stop", action="append", help="stop string (repeatable); cut from the output")
    g.add_argument("--stop-token-id", type=int, action="append", help="extra stop token id (repeatable)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the only mode supported yet)")
    g.add_argument("--request-id", help="request id for the server's logs")
    add_cache_args(g, default_kind=None)
    g.set_defaults(func=cmd_client_generate)

    i = cmds.add_parser("info", help="GetModelInfo + GetServerInfo as JSON")
    i.set_defaults(func=cmd_client_info)

    h = cmds.add_parser("health", help="grpc.health.v1 Check; exit 0 when SERVING")
    h.add_argument("--service", default="", help="service name ('' = the whole server)")
    h.set_defaults(func=cmd_client_health)
