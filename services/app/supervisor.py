"""The children of ``kakeya serve all``: started in order, restarted when they die, stopped in order.

A child that exits while ``serve all`` serves is restarted on the same ports after an exponential backoff
(0.5 s doubling to 10 s, reset once it stayed up ``stable_s``); meanwhile the others keep serving (without
the drafter, requests finish through the verifier alone; without the verifier they end ``UNAVAILABLE``).
Only SIGTERM/SIGINT of ``serve all`` stops everything.
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
    removed = sweep_run_dirs()
    if removed:
        log.info(
            "removed %d run director%s left by a serve all that was killed",
            len(removed),
            "y" if len(removed) == 1 else "ies",
        )
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
    out = list(argv)
    if name in out:
        out[out.index(name) + 1] = value
    else:
        out += [name, value]
    return out


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
            # A restart comes back where it was: the others (and scrapers) keep their addresses.
            child.argv = with_option(child.argv, "--port", str(child.info["port"]))
            if "metrics_port" in child.info:
                child.argv = with_option(child.argv, "--metrics-port", str(child.info["metrics_port"]))
            return True
        return False

    def wait_ready(self, names: list[str], timeout: float) -> dict[str, dict]:
        deadline = time.monotonic() + timeout
        while True:
            for n in names:
                c = self.children[n]
                self._check_ready(c)
                if c.ready_at is None and c.proc.poll() is not None:
                    raise RuntimeError(f"{n} exited with status {c.proc.returncode} before it was ready")
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
                log.error("%s (pid %d) exited with status %s: restarting it in %.1f s (failure %d in a row)",
                          c.name, c.proc.pid, c.proc.returncode, delay, c.failures)  # fmt: skip
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
