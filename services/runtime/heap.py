"""Keep freed heap memory in the process (Linux, glibc): a batched step's large temporaries reuse mapped pages instead
of faulting fresh ones in.

glibc unmaps a freed chunk above its mmap threshold and trims a thread arena's free top, so each step's temporaries
fault zeroed pages in again. Fixed thresholds (``mallopt``) keep that memory for the next step, at the price of the
high-water mark of temporaries up to :data:`MMAP_THRESHOLD` each, as jemalloc or tcmalloc would. Every ``kakeya``
command sets them first; ``KAKEYA_MALLOC=system`` keeps glibc's defaults; elsewhere nothing changes.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # <malloc.h>
MMAP_THRESHOLD = 32 << 20  # glibc's largest: bigger chunks are still mapped (and given back) one by one
TRIM_THRESHOLD = 1 << 30  # free memory at a heap's top kept up to this much
TOP_PAD = 16 << 20  # what a heap grows by at least, so growing is rare too
SETTINGS = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD))

ENV = "KAKEYA_MALLOC"  # "system": glibc's defaults; unset: the thresholds above; anything else is refused


@functools.cache
def keep_freed_memory() -> bool:
    """Set the thresholds above once per process; True where they are set (glibc, no opt-out). ValueError
    naming ``KAKEYA_MALLOC`` for a value it does not know."""
    choice = os.environ.get(ENV, "")
    if choice not in ("", "system"):
        raise ValueError(f"{ENV} must be 'system' (glibc's defaults) or unset, got {choice!r}")
    if choice == "system" or not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version"):  # musl: its mallopt does nothing
        return False
    libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(libc.mallopt(param, value) == 1 for param, value in SETTINGS)
