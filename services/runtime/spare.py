"""The prefix cache's default budget (``--prefix-cache-bytes auto``): a tenth of the memory its snapshots live in,
at most 4 GiB, measured once when the server starts: the device's free memory when they live on a CUDA device
(the caller measures it), else the host's available memory bounded by the process's container (its cgroup).
"""

from __future__ import annotations

import os
from contextlib import suppress
from pathlib import Path

AUTO_FRACTION = 0.10
AUTO_CAP_BYTES = 4 * 2**30
_CGROUP = Path("/sys/fs/cgroup")


def auto_prefix_cache_bytes(device_free: int | None = None) -> int:
    """The ``auto`` budget: :data:`AUTO_FRACTION` of ``device_free`` (the snapshots' device, when they live
    on one) or of :func:`available_host_bytes`, at most :data:`AUTO_CAP_BYTES`; 0 (off) when unknown."""
    spare = device_free if device_free is not None else available_host_bytes()
    return 0 if not spare else min(int(spare * AUTO_FRACTION), AUTO_CAP_BYTES)


def available_host_bytes() -> int | None:
    """Host memory this process could still take: the system's available memory (psutil where installed,
    else Linux's MemAvailable, else free pages, else -- macOS without psutil -- the physical memory),
    at most what its cgroup (a container's memory limit) leaves; None when nothing says."""
    found = [b for b in (_system_available(), _cgroup_spare()) if b is not None]
    return min(found) if found else None


def _system_available() -> int | None:
    with suppress(ImportError):
        import psutil

        return int(psutil.virtual_memory().available)
    with suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    for pages in ("SC_AVPHYS_PAGES", "SC_PHYS_PAGES"):
        with suppress(ValueError, OSError, AttributeError):
            return os.sysconf(pages) * os.sysconf("SC_PAGE_SIZE")
    return None


def _cgroup_spare(root: Path = _CGROUP) -> int | None:
    """The cgroup's memory limit less its usage (v2, else v1), or None without a limit."""
    for limit, usage in (
        ("memory.max", "memory.current"),
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"),
    ):
        with suppress(OSError, ValueError):
            text = (root / limit).read_text().strip()
            if text == "max" or int(text) >= 2**60:  # v1 writes "no limit" as a huge number
                return None
            return max(int(text) - int((root / usage).read_text().strip()), 0)
    return None
