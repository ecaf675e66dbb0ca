"""``mx.array`` <-> host numpy arrays, for the one tensor codec (``kakeya.wire.codec``).

bfloat16 has no numpy dtype: it crosses as its 16-bit patterns (``bf16=True``).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def owns(array) -> bool:
    return isinstance(array, mx.array)


def to_host(array: mx.array) -> tuple[np.ndarray, str]:
    """A host numpy view of ``array`` (evaluates it) and mlx's dtype name; bfloat16 as its uint16 bit patterns."""
    name = str(array.dtype).rsplit(".", 1)[-1]
    if array.dtype == mx.bfloat16:  # numpy cannot take bfloat16 through the buffer protocol
        return np.asarray(array.view(mx.uint16)), name
    return np.asarray(array), name  # a view of mlx's memory


def from_host(arr: np.ndarray, bf16: bool, device=None) -> mx.array:
    """An ``mx.array`` copy of ``arr`` (mlx copies into its own memory); ``bf16``: ``arr`` holds bfloat16 bits."""
    out = mx.array(arr)
    return out.view(mx.bfloat16) if bf16 else out
