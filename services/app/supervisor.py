"""``kakeya serve all``: the verifier, the drafter and the orchestrator as three supervised processes.

The backends listen on loopback ports of their own choosing and require a bearer token made for this run, which
only the orchestrator is given. A child that exits while ``serve all`` serves is restarted on the same ports after
an exponential backoff (0.5 s doubling to 10 s, reset once it stayed up ``stable_s``); meanwhile the others keep
serving (without the drafter, requests finish through the verifier alone; without the verifier they end
``UNAVAILABLE``). SIGTERM/SIGINT of ``serve all`` stop the orchestrator first (so it drains), then the backends.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kakeya.app import flags as serve_flags

log = logging.getLogger("kakeya.all")

STOP_ORDER = (("orchestrator",), ("verifier", "drafter"))  # the orchestrator drains while the backends still answer


def _pdeathsig() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: the child gets SIGTERM when its parent dies (the parent-pid watchdog covers macOS)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:  # no libc.so.6 (musl): the parent-pid watchdog still covers it
        pass


RUN_DIR_PREFIX = "kakeya-serve-all-"


def run_dir() -> tempfile.TemporaryDirectory:
    """``serve all``'s private directory (mode 0700: its children's ready files and the token they share).

    Its name carries this process's pid, so that a later ``serve all`` can tell it from a live one's:
    a ``serve all`` killed outright (SIGKILL, the OOM killer) never runs its cleanup and would leave
    its token file behind for good. Each start first removes such leftovers (:func:`sweep_run_dirs`).
    """
    if removed := sweep_run_dirs():
        log.info("removed the run directories a killed serve all left: %d", len(removed))
    return tempfile.TemporaryDirectory(prefix=f"{RUN_DIR_PREFIX}{os.getpid()}-")


def sweep_run_dirs(root: str | Path | None = None) -> list[Path]:
    """Remove the run directories under ``root`` (the temp dir) that this user's dead ``serve all`` left.

    Only directories named by :func:`run_dir` (the pid in the name), owned by this user, not links, and
    whose pid no process has now; a live pid, even another program's that reused it, keeps its directory.
    """
    root = Path(root) if root is not None else Path(tempfile.gettempdir())
    pattern = re.compile(re.escape(RUN_DIR_PREFIX) + r"(\d+)-[^/]+")
    removed = []
    for d in root.glob(RUN_DIR_PREFIX + "*"):
        m = pattern.fullmatch(d.name)
        try:
            st = d.lstat()  # the entry itself: a link is not a directory here
        except OSError:
            continue
        if not m or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or _pid_exists(int(m.group(1))):
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def with_option(argv: list[str], name: str, value: str) -> list[str]:
    """``argv`` with ``name``'s value replaced (or appended)."""
    if name not in argv:
        return [*argv, name, value]
    out = list(argv)
    out[out.index(name) + 1] = value
    return out


def ended(rc: int) -> str:  # Popen's -9 is no exit status: the child died of signal 9 (the OOM killer's SIGKILL)
    return f"was killed by signal {-rc} ({signal.strsignal(-rc)})" if rc < 0 else f"exited with status {rc}"


def backoff_delay(failures: int, initial: float = 0.5, maximum: float = 10.0) -> float:
    """Delay before restart number ``failures`` (1, 2, ...): 0.5, 1, 2, 4, 8, 10, 10 ... s."""
    return min(maximum, initial * 2 ** max(0, failures - 1))


@dataclass
class Child:
    name: str
    argv: list[str]  # after "serve <name>"
    ready_file: Path
    proc: subprocess.Popen | None = None
    info: dict = field(default_factory=dict)  # its ready file, once SERVING
    ready_at: float | None = None
    failures: int = 0  # consecutive deaths (reset once it stays up stable_s)
    restarts: int = 0
    restart_at: float | None = None  # when a dead child is due to start again


class Supervisor:
    """Starts, watches, restarts and stops the ``serve all`` children."""

    def __init__(self, grace: float, *, initial: float = 0.5, maximum: float = 10.0, stable_s: float = 30.0):
        self.grace = grace
        self.initial, self.maximum, self.stable_s = initial, maximum, stable_s
        self.children: dict[str, Child] = {}
        self.stop = threading.Event()
        self.on_change: Callable[[], None] = lambda: None  # a child (re)became SERVING

    @property
    def procs(self) -> dict[str, subprocess.Popen]:
        return {n: c.proc for n, c in self.children.items() if c.proc is not None}

    def spawn(self, name: str, argv: list[str], ready_file: Path) -> subprocess.Popen:
        from kakeya.runtime.lifecycle import ENV_PARENT_PID

        child = self.children.get(name) or Child(name, list(argv), Path(ready_file))
        self.children[name] = child
        child.ready_file.unlink(missing_ok=True)
        child.ready_at, child.restart_at = None, None
        env = dict(os.environ, **{ENV_PARENT_PID: str(os.getpid())})
        child.proc = subprocess.Popen(
            [sys.executable, "-m", "kakeya.app.main", "serve", name, *child.argv],
            env=env,
            start_new_session=True,  # a terminal's Ctrl-C reaches only us; we stop the children in order
            # one prctl call between fork and exec, no locks taken: safe beside our threads
            preexec_fn=_pdeathsig if sys.platform.startswith("linux") else None,  # noqa: PLW1509
        )
        return child.proc

    def _check_ready(self, child: Child) -> bool:
        if child.ready_at is None and child.ready_file.is_file():
            child.info = json.loads(child.ready_file.read_text())
            child.ready_at = time.monotonic()
            # A restart comes back where it was: the others (clients, probes and scrapers) keep their addresses.
            for key in ("port", "metrics_port", "http_port", "health_port"):
                if key in child.info:
                    child.argv = with_option(child.argv, f"--{key.replace('_', '-')}", str(child.info[key]))
            return True
        return False

    def wait_ready(self, names: list[str], timeout: float) -> dict[str, dict]:
        deadline = time.monotonic() + timeout
        while True:
            for n in names:
                c = self.children[n]
                self._check_ready(c)
                if c.ready_at is None and c.proc.poll() is not None:
                    raise RuntimeError(f"{n} {ended(c.proc.returncode)} before it was ready")
            if all(self.children[n].ready_at is not None for n in names):
                return {n: self.children[n].info for n in names}
            if self.stop.is_set():
                raise KeyboardInterrupt
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"not ready after {timeout:.0f} s: {[n for n in names if self.children[n].ready_at is None]}"
                )
            time.sleep(0.1)

    def watch(self, interval: float = 0.25) -> None:
        """Until ``stop``: restart dead children with backoff, report the ones back to SERVING."""
        while not self.stop.wait(interval):
            self.poll()

    def poll(self) -> None:
        now = time.monotonic()
        for c in self.children.values():
            if c.restart_at is None and c.proc is not None and c.proc.poll() is not None:
                if c.ready_at is not None and now - c.ready_at >= self.stable_s:
                    c.failures = 0  # it had been fine for a while: a fresh series of backoffs
                c.failures += 1
                delay = backoff_delay(c.failures, self.initial, self.maximum)
                c.restart_at = now + delay
                log.error("%s (pid %d) %s: restarting it in %.1f s (failure %d in a row)",
                          c.name, c.proc.pid, ended(c.proc.returncode), delay, c.failures)  # fmt: skip
            elif c.restart_at is not None and now >= c.restart_at and not self.stop.is_set():
                c.restarts += 1
                p = self.spawn(c.name, c.argv, c.ready_file)
                log.warning("%s restarted (pid %d, restart %d)", c.name, p.pid, c.restarts)
            elif c.ready_at is None and c.proc is not None and self._check_ready(c):
                log.info("%s SERVING again on %s", c.name, c.info.get("addr"))
                self.on_change()

    def terminate(self, names) -> None:
        live = [c.proc for n, c in self.children.items() if n in names and c.proc is not None and c.proc.poll() is None]
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
        self.stop.set()  # no restarts from here on
        for names in STOP_ORDER:
            self.terminate(names)


def cmd_serve_all(args) -> int:
    from kakeya.checkpoints.config import check_pair, load_draft_config, load_target_config
    from kakeya.orchestrator.assembly import pair_paths, refuse_torch_flags
    from kakeya.runtime.lifecycle import port_in_use, write_ready_file
    from kakeya.runtime.logs import setup_logging
    from kakeya.runtime.security.auth import new_token, write_token

    setup_logging("all", args.log_format)
    target, draft = pair_paths(args.target, args.draft)
    check_pair(load_target_config(target), load_draft_config(draft))  # here, as one usage error, not a child's exit
    serve_flags.restore_sources(args)  # bad --restore specs: a usage error now, not a child's exit
    serve_flags.ServerTLS.from_args(args), serve_flags.auth_token(args)
    serve_flags.session_limits(args)
    for port in filter(None, (args.port, args.http_port)):  # None: no HTTP; 0: any free port
        if taken := port_in_use(args.host, port):
            print(f"kakeya: error: serve all: cannot listen on {args.host}:{port}: {taken}", file=sys.stderr)
            return 2
    vback, dback = child_backend(args, "verifier"), child_backend(args, "drafter")
    refuse_torch_flags((vback[1], dback[1]), args.device, args.dtype)
    if args.ready_file:
        Path(args.ready_file).unlink(missing_ok=True)
    sup = Supervisor(args.grace)

    def on_signal(signum, _frame):
        if sup.stop.is_set():  # a second Ctrl-C: the user will not wait out the drain
            log.warning("received %s again: killing the children now", signal.Signals(signum).name)
            for proc in sup.procs.values():
                proc.kill()  # Popen's: a child already reaped is left alone
            return
        log.info("received %s: stopping orchestrator, then verifier and drafter", signal.Signals(signum).name)
        sup.stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    common = ["--grace", str(args.grace), "--log-format", args.log_format]

    def metrics(i: int) -> list[str]:  # orchestrator: the base port, verifier +1, drafter +2 (0: any free ports)
        if args.metrics_port is None:
            return []
        return ["--metrics-port", str(args.metrics_port + i if args.metrics_port else 0)]

    cpus = _placement(args.placement, [vback, dback], log)
    pinned = {role: ["--cpus", c] for role, c in cpus.items()}
    rc = 0
    with run_dir() as tmp:
        files = {n: Path(tmp) / f"{n}.json" for n in ("verifier", "drafter", "orchestrator")}
        token_file = str(write_token(Path(tmp) / "backend.token", new_token()))
        try:
            back = ["--host", "127.0.0.1", "--port", "0"]  # loopback only: the orchestrator is their one client
            cache = ["--cache", args.cache, "--sink", str(args.sink), "--full-kv-bits", str(args.full_kv_bits),
                     *(["--window", str(args.window)] if args.window is not None else [])]  # fmt: skip

            def spawn(role: str, *argv: str, port: int) -> None:  # port: the i-th of --metrics-port
                child = serve_flags.child_argv(args, role, token_file)
                sup.spawn(role, [*argv, "--ready-file", str(files[role]), *common, *child, *metrics(port),
                                 *pinned.get(role, [])], files[role])  # fmt: skip

            spawn("verifier", *back, "--target", target, "--draft", draft, *vback, *cache, port=1)
            spawn("drafter", *back, "--draft", draft, "--target", target, *dback, port=2)
            ready = sup.wait_ready(["verifier", "drafter"], args.start_timeout)
            health = ["--health-port", str(args.health_port)] if args.health_port is not None else []
            spawn("orchestrator", "--host", args.host, "--port", str(args.port), "--verifier",
                  ready["verifier"]["addr"], "--drafter", ready["drafter"]["addr"], "--tokenizer", target,
                  "--max-tokens-limit", str(args.max_tokens_limit), *health, port=0)  # fmt: skip
            ready.update(sup.wait_ready(["orchestrator"], args.start_timeout))

            def summary() -> dict:
                c = sup.children
                out = {"addr": c["orchestrator"].info["addr"], "verifier": c["verifier"].info["addr"],
                       "drafter": c["drafter"].info["addr"], "pids": {n: p.pid for n, p in sup.procs.items()},
                       "restarts": {n: ch.restarts for n, ch in c.items()}, "pid": os.getpid(),
                       "cpus": cpus}  # fmt: skip
                if args.metrics_port is not None:
                    out["metrics_ports"] = {n: ch.info.get("metrics_port") for n, ch in c.items()}
                for key in ("http_port", "health_port"):  # the orchestrator's OpenAI API, its plaintext health
                    if getattr(args, key) is not None:
                        out[key] = c["orchestrator"].info.get(key)
                return out

            def publish() -> None:  # the ready file follows restarts (new pids)
                if args.ready_file:
                    write_ready_file(args.ready_file, summary())

            s = summary()  # the line says where to connect: the gRPC API, and the HTTP one where it listens
            http = f", HTTP (OpenAI API) http://{args.host}:{s['http_port']}/v1" if "http_port" in s else ""
            log.info("all SERVING: orchestrator %s%s, verifier %s, drafter %s", s["addr"], http, s["verifier"],
                     s["drafter"])  # fmt: skip
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

    # both on torch with --device cpu: what was measured (not MLX's CPU backend)
    cpus = placement.for_split(choice, all(b[1] == "torch" and b[b.index("--device") + 1] == "cpu" for b in backends))
    if cpus:
        log.info("placement: verifier on CPUs %s, drafter and orchestrator on %s (--placement off: none)",
                 cpus["verifier"], cpus["drafter"])  # fmt: skip
    return cpus


def child_backend(args, role: str) -> list[str]:
    """A child's backend flags (its --ROLE-backend, else --backend), auto resolved here as the children see it."""
    from kakeya.orchestrator.assembly import resolve_backend, torch_threads

    choice = getattr(args, f"{role}_backend") or args.backend
    backend, device = resolve_backend(choice, None if choice == "mlx" else args.device)
    threads = torch_threads(args.torch_threads, device, embedded=args.target is None)  # children get explicit paths
    if backend != "torch":
        return ["--backend", backend, "--torch-threads", str(threads)]
    dtype = ["--dtype", args.dtype] if args.dtype else []
    return ["--backend", "torch", "--device", device, *dtype, "--torch-threads", str(threads)]
