"""mlx-lm's own greedy autoregressive decoding: the yardstick for "lossless".

Deliberately independent of our cache and forward: it uses mlx-lm's
``generate_step`` with the model's own ``RotatingKVCache``/``KVCache``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import mlx.core as mx
from mlx_lm.generate import generate_step


def greedy_reference(model, prompt_ids: Sequence[int], max_tokens: int, stop_ids: Iterable[int] = ()):
    """Return ``(token_ids, prefill_s, decode_s)``; stops after a stop token (included), like the loop."""
    stop = set(stop_ids)
    ids: list[int] = []
    t0 = time.perf_counter()
    t_first = None
    steps = generate_step(
        mx.array(list(prompt_ids)), model, max_tokens=max_tokens, sampler=lambda x: mx.argmax(x, axis=-1)
    )
    for tok, _ in steps:
        if t_first is None:
            t_first = time.perf_counter()
        ids.append(int(tok))
        if ids[-1] in stop:
            break
    t_end = time.perf_counter()
    return ids, t_first - t0, t_end - t_first
