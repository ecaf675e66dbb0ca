"""``kakeya serve all``: the verifier, the drafter and the orchestrator as three supervised processes.

The backends listen on loopback ports of their own choosing and require a bearer token made for this run, which only
the orchestrator is given; SIGTERM/SIGINT stop the orchestrator first (so it drains), then the backends; a child
that dies is restarted with backoff (``supervisor.py``), and all of them go down with this process.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

from kakeya.app import flags as serve_flags


def cmd_serve_all(args) -> int:
    from kakeya.app.supervisor import Supervisor, run_dir
    from kakeya.orchestrator.assembly import pair_paths
    from kakeya.runtime.lifecycle import port_in_use, write_ready_file
    from kakeya.runtime.logs import setup_logging
    from kakeya.runtime.security.auth import new_token, write_token

    setup_logging("all", args.log_format)
    log = logging.getLogger("kakeya.all")
    target, draft = pair_paths(args.target, args.draft)
    serve_flags.restore_sources(args)  # bad --restore specs: a usage error now, not a child's exit
    serve_flags.ServerTLS.from_args(args), serve_flags.auth_token(args)
    serve_flags.session_limits(args)
    for port in (args.port, args.http_port):
        taken = port_in_use(args.host, port) if port is not None else None
        if taken:
            print(f"kakeya: error: serve all: cannot listen on {args.host}:{port}: {taken}", file=sys.stderr)
            return 2
    if args.ready_file:
        Path(args.ready_file).unlink(missing_ok=True)
    sup = Supervisor(args.grace)

    def on_signal(signum, _frame):
        log.info("received %s: stopping orchestrator, then verifier and drafter", signal.Signals(signum).name)
        sup.stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    common = ["--grace", str(args.grace), "--log-format", args.log_format]

    def metrics(i: int) -> list[str]:  # orchestrator: the base port, verifier +1, drafter +2 (0: any free ports)
        if args.metrics_port is None:
            return []
        return ["--metrics-port", str(args.metrics_port + i if args.metrics_port else 0)]

    vback, dback = _child_backend(args.verifier_backend, args), _child_backend(args.drafter_backend, args)
    cpus = _placement(args.placement, [vback, dback], log)
    pinned = {role: ["--cpus", c] for role, c in cpus.items()}
    rc = 0
    with run_dir() as tmp:
        files = {n: Path(tmp) / f"{n}.json" for n in ("verifier", "drafter", "orchestrator")}
        token_file = str(write_token(Path(tmp) / "backend.token", new_token()))
        try:
            back = ["--host", "127.0.0.1", "--port", "0"]  # loopback only: the orchestrator is their one client
            cache = ["--cache", args.cache, "--sink", str(args.sink), "--full-kv-bits", str(args.full_kv_bits),
                     *(["--window", str(args.window)] if args.window else [])]  # fmt: skip

            def spawn(role: str, *argv: str, port: int) -> None:  # port: the i-th of --metrics-port
                child = serve_flags.child_argv(args, role, token_file)
                sup.spawn(role, [*argv, "--ready-file", str(files[role]), *common, *child, *metrics(port),
                                 *pinned.get(role, [])], files[role])  # fmt: skip

            spawn("verifier", *back, "--target", target, "--draft", draft, *vback, *cache, port=1)
            spawn("drafter", *back, "--draft", draft, "--target", target, *dback, port=2)
            ready = sup.wait_ready(["verifier", "drafter"], args.start_timeout)
            health = ["--health-port", str(args.health_port)] if args.health_port is not None else []
            spawn("orchestrator", "--host", args.host, "--port", str(args.port), "--verifier", ready["verifier"]["addr"],
                  "--drafter", ready["drafter"]["addr"], "--tokenizer", target, "--max-tokens-limit",
                  str(args.max_tokens_limit), *health, port=0)  # fmt: skip
            ready.update(sup.wait_ready(["orchestrator"], args.start_timeout))

            def summary() -> dict:
                c = sup.children
                out = {
                    "addr": c["orchestrator"].info["addr"],
                    "verifier": c["verifier"].info["addr"],
                    "drafter": c["drafter"].info["addr"],
                    "pids": {n: p.pid for n, p in sup.procs.items()},
                    "restarts": {n: ch.restarts for n, ch in c.items()},
                    "pid": os.getpid(),
                    "cpus": cpus,
                }
                if args.metrics_port is not None:
                    out["metrics_ports"] = {n: ch.info.get("metrics_port") for n, ch in c.items()}
                if args.http_port is not None:  # the orchestrator's OpenAI API
                    out["http_port"] = c["orchestrator"].info.get("http_port")
                return out

            def publish() -> None:  # the ready file follows restarts (new pids)
                if args.ready_file:
                    write_ready_file(args.ready_file, summary())

            s = summary()
            log.info("all SERVING: orchestrator %s, verifier %s, drafter %s", s["addr"], s["verifier"], s["drafter"])
            publish()
            sup.on_change = publish
            sup.watch()  # restarts dead children until SIGTERM/SIGINT
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


def _placement(choice: str, backends: list[list[str]], log) -> dict[str, str]:
    """Each child's ``--cpus`` (``runtime/placement.for_split``): with ``auto``, where this platform can pin,
    both models run on torch's CPU backend and this process may use two CPUs or more; else none."""
    from kakeya.runtime import placement

    def on_cpu(argv: list[str]) -> bool:  # torch on --device cpu: what was measured (not MLX's CPU backend)
        return argv[1] == "torch" and argv[argv.index("--device") + 1] == "cpu"

    cpus = placement.for_split(choice, all(on_cpu(b) for b in backends))
    if cpus:
        log.info("placement: verifier on CPUs %s, drafter and orchestrator on %s (--placement off: none)",
                 cpus["verifier"], cpus["drafter"])  # fmt: skip
    return cpus


def _child_backend(choice: str, args) -> list[str]:
    """A child's backend flags: auto resolved here, so the supervisor's log and the children agree."""
    from kakeya.orchestrator.assembly import resolve_backend, torch_threads

    backend, device = resolve_backend(choice, None if choice == "mlx" else args.device)
    threads = torch_threads(args.torch_threads, device, embedded=args.target is None)  # children get explicit paths
    if backend != "torch":
        return ["--backend", backend, "--torch-threads", str(threads)]
    graphs = getattr(args, "cuda_graphs", "auto")
    return [
        "--backend",
        "torch",
        "--device",
        device,
        *(["--dtype", args.dtype] if args.dtype else []),
        "--torch-threads",
        str(threads),
        *(["--cuda-graphs", graphs] if graphs != "auto" else []),
        *(["--compile"] if getattr(args, "compile", False) else []),
    ]
