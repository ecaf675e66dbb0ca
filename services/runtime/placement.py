"""Which CPUs the processes of a split on one machine run on (Linux): ``serve --cpus``, ``serve all --placement``.

A split block wakes its three processes in turn. Pinned, the orchestrator and the drafter share one core (they
never work at once) and the verifier has the others, so a wake-up lands on a core its process just ran on (what
it buys: ``docs/operations.md``, "History: split cost and pre-drafting"). For torch on the CPU, where it was
measured, and only where the platform can pin (``os.sched_setaffinity``).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable


def can_pin() -> bool:
    return hasattr(os, "sched_setaffinity") and hasattr(os, "sched_getaffinity")


def available() -> list[int]:  # the CPUs this process runs on now, in order
    return sorted(os.sched_getaffinity(0))


def parse_cpus(text: str, field: str = "--cpus") -> frozenset[int]:
    """``"0,2-3"`` as {0, 2, 3}; ValueError naming ``field`` for anything else."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"{field}: {text!r} is not a CPU list (e.g. 0,2-3)") from None
        if first < 0 or last < first:
            raise ValueError(f"{field}: {part.strip()!r} is not a CPU or a rising range of CPUs")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def format_cpus(cpus: Iterable[int]) -> str:
    """The inverse of :func:`parse_cpus`: ranges where they run, e.g. ``"0,2-3"``."""
    runs = itertools.groupby(enumerate(sorted(set(cpus))), key=lambda ic: ic[1] - ic[0])  # a run: c - i constant
    runs = [[c for _, c in run] for _, run in runs]
    return ",".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)


def split_placement(cpus: Iterable[int]) -> dict[str, frozenset[int]] | None:
    """Each role's CPUs out of ``cpus``: the drafter and the orchestrator share the last quarter (at
    least one CPU), the verifier has the rest. None with fewer than two CPUs: nothing to separate."""
    cpus = sorted(set(cpus))
    if len(cpus) < 2:
        return None
    shared = frozenset(cpus[-max(1, len(cpus) // 4) :])
    return {"verifier": frozenset(cpus) - shared, "drafter": shared, "orchestrator": shared}


def for_split(choice: str, on_cpu: bool) -> dict[str, str]:
    """Each role's ``--cpus`` for a split on this machine (``serve all --placement``, ``benchmarks/split.py``):
    with ``auto``, where this platform can pin, the models run on torch's CPU backend (``on_cpu``) and this
    process may use two CPUs or more; else {} (no pinning)."""
    if choice == "off" or not on_cpu or not can_pin():
        return {}
    roles = split_placement(available())
    return {} if roles is None else {role: format_cpus(c) for role, c in roles.items()}


def pin_process(cpus: Iterable[int], field: str = "--cpus") -> frozenset[int]:
    """Pin every thread of this process (threads it starts later inherit it) to ``cpus``; ValueError naming
    ``field`` where the platform cannot pin or some of ``cpus`` are not this process's to use (outside the
    machine, or outside its cpuset: a container's)."""
    cpus = frozenset(cpus)
    if not can_pin():
        raise ValueError(f"{field}: this platform cannot pin a process to CPUs (Linux only)")
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no /proc: this thread alone (before any other starts, that is the process)
        threads = [0]
    for tid in threads:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
        except OSError:  # none of them usable (EINVAL): said below, as when only some are
            break
    got = frozenset(os.sched_getaffinity(0))  # the kernel keeps only the CPUs this process may use
    if got != cpus:
        raise ValueError(f"{field}: CPUs {format_cpus(cpus - got) or format_cpus(cpus)} are not available to this"
                         f" process")  # fmt: skip
    return cpus
