"""Counter-based Gumbel noise G(seed, position, token): the same bits in numpy, torch and MLX.

The coupled sampling rule (``sampling.py``) needs one Gumbel variable per (seed, absolute position, token id) that the
verifier and the drafter each make on their own device, in any order and batch, bit for bit alike: a pure function of
those three integers, not a stream.

* ``session_keys(seed)``: two 32-bit words from the 64-bit seed;
* per row: ``ra = mix(position ^ k1)`` and an odd ``step = (mix(ra ^ k2) >> 1) | 1``;
* per token: ``bits = mix(token * step + ra)`` (mod 2**32): a bijection of the token within a row;
* ``u = (2 * (bits >> 9) + 1) * 2**-24``: exact in float32, never 0 or 1; ``G = -log(-log(u))`` in float32.

``mix`` is a 32-bit integer hash (Wellons' hash-prospector style): numpy and MLX compute in uint32, where a product
wraps by itself; torch in int64 (``wrap`` masks the product; both multipliers are below 2**31). Only the float32 ``log``
may differ between backends (an ulp), which changes a choice only at a near-exact tie.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

MASK32 = 0xFFFFFFFF
M1, M2 = 0x21F0AAAD, 0x735A2D97  # odd, below 2**31 (see the module note)
SALT1, SALT2 = 0x9E3779B9, 0x85EBCA6B  # keep seed 0 from starting at the all-zero key
U_SCALE = 2.0**-24


def _same(x):
    return x


def wrap32(x):
    """The low 32 bits (a torch int64 tensor or a Python int)."""
    return x & MASK32


def mix(x, wrap: Callable = _same):
    """A 32-bit integer hash of each element of ``x`` (values in [0, 2**32)); ``wrap`` takes a product
    back to 32 bits where the type does not (torch int64, Python ints: :func:`wrap32`)."""
    x = x ^ (x >> 16)
    x = wrap(x * M1)
    x = x ^ (x >> 15)
    x = wrap(x * M2)
    return x ^ (x >> 15)


def session_keys(seed: int) -> tuple[int, int]:
    """The two 32-bit keys of a seed in [0, 2**64): each depends on all 64 bits."""
    lo, hi = seed & MASK32, (seed >> 32) & MASK32
    return mix(lo ^ mix(hi ^ SALT1, wrap32), wrap32), mix(hi ^ mix(lo ^ SALT2, wrap32), wrap32)


def bits(keys: tuple[int, int], positions, tokens, wrap: Callable = _same):
    """The 32-bit hash of every (position, token): ``positions`` [L, 1] and ``tokens`` [V] broadcast to [L, V]."""
    k1, k2 = keys
    ra = mix(positions ^ k1, wrap)
    step = (mix(ra ^ k2, wrap) >> 1) | 1  # odd, below 2**31
    return mix(wrap(tokens * step + ra), wrap)


def uniform_levels(h):
    """The odd integers ``2 * (h >> 9) + 1`` < 2**24: times :data:`U_SCALE`, a uniform in (0, 1), exact in float32."""
    return (h >> 9) * 2 + 1


def gumbel(keys: tuple[int, int], first_position: int, rows: int, vocab: int) -> np.ndarray:
    """The reference noise [rows, vocab] (float32) at positions ``first_position ..``."""
    positions = np.arange(first_position, first_position + rows, dtype=np.uint32)[:, None]
    h = bits(keys, positions, np.arange(vocab, dtype=np.uint32))
    u = uniform_levels(h).astype(np.float32) * np.float32(U_SCALE)
    return -np.log(-np.log(u))
