"""KV bytes one verifier session holds at a given context, per cache policy, from the config alone: the numbers a live
session reports (``stats().kv_bytes``), so a deployment can size its memory before loading anything:

    kakeya memory --preset gemma-4-26b-a4b --context 32768
    kakeya memory --config /models/gemma-4-26b-a4b --context 4096 --json

Policies: ``full`` (the yardstick), ``native`` (sliding layers keep the model's window), ``sink-window`` (sinks + a
smaller window), each also with 8- and 4-bit quantized full layers. Sliding layers hold a ring of ``window - 1 + slack``
slots (+ sinks): the price of exact rollback (``cache.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from kakeya.core.contract import FULL, SLIDING
from kakeya.core.request import CachePolicy

# Published text configs (only the fields the KV size depends on): the two models differ in depth and heads.
_GEMMA4 = {"sliding_window": 1024, "layer_pattern": 6, "head_dim": 256, "global_head_dim": 512}
_GEMMA4 |= {"attention_k_eq_v": True, "num_kv_shared_layers": 0, "dtype": "bfloat16"}
PRESETS = {
    "gemma-4-26b-a4b": {**_GEMMA4, "num_hidden_layers": 30, "num_key_value_heads": 8, "num_global_key_value_heads": 2},
    "gemma-4-31b": {**_GEMMA4, "num_hidden_layers": 60, "num_key_value_heads": 16, "num_global_key_value_heads": 4},
}

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class KVShape:
    layer_types: tuple[str, ...]  # of the layers that hold their own K/V
    sliding_window: int
    sliding_kv_heads: int
    sliding_head_dim: int
    full_kv_heads: int
    full_head_dim: int
    dtype_bytes: int

    @classmethod
    def from_config(cls, cfg: dict, dtype: str | None = None) -> KVShape:
        n = cfg["num_hidden_layers"]
        types = cfg.get("layer_types")
        if not types:
            pattern = cfg.get("layer_pattern") or cfg.get("sliding_window_pattern", 5)
            types = [(FULL if (i + 1) % pattern == 0 else SLIDING) for i in range(n)]
        cached = n - cfg.get("num_kv_shared_layers", 0)
        dtype = dtype or cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
        kv = cfg.get("num_key_value_heads", 1)
        head = cfg.get("head_dim", 256)
        # mlx-lm's rule: full layers use the global KV head count only together with K=V
        global_kv = cfg.get("num_global_key_value_heads")
        full_kv = global_kv if cfg.get("attention_k_eq_v") and global_kv else kv
        return cls(
            layer_types=tuple(types[:cached]),
            sliding_window=cfg["sliding_window"],
            sliding_kv_heads=kv,
            sliding_head_dim=head,
            full_kv_heads=full_kv,
            full_head_dim=cfg.get("global_head_dim") or head,
            dtype_bytes=DTYPE_BYTES[dtype],
        )

    def per_position(self, kind: str, bits: int = 0, group: int = 64) -> int:
        """Bytes of K and V for one position of one layer."""
        if kind == SLIDING:
            return 2 * self.sliding_kv_heads * self.sliding_head_dim * self.dtype_bytes
        if not bits:
            return 2 * self.full_kv_heads * self.full_head_dim * self.dtype_bytes
        group = min(group, self.full_head_dim)
        packed = self.full_head_dim * bits // 8
        scales_biases = 2 * (self.full_head_dim // group) * self.dtype_bytes
        return 2 * self.full_kv_heads * (packed + scales_biases)


def session_bytes(shape: KVShape, policy: CachePolicy | None, context: int) -> dict:
    """``{"sliding_bytes", "full_bytes", "total_bytes"}``; ``policy=None`` is the unbounded ``full`` yardstick."""
    n_sliding = shape.layer_types.count(SLIDING)
    n_full = len(shape.layer_types) - n_sliding
    if policy is None:
        sliding_positions, bits, group = context, 0, 64
    else:
        p = policy.resolve(shape.sliding_window)
        sliding_positions = p.sink + p.window - 1 + p.slack
        bits, group = p.full_kv_bits, p.full_kv_group_size
    sliding = n_sliding * sliding_positions * shape.per_position(SLIDING)
    full = n_full * context * shape.per_position(FULL, bits, group)
    return {"total_bytes": sliding + full, "sliding_bytes": sliding, "full_bytes": full}


def restored_bytes(shape: KVShape, policy: CachePolicy, rank: int) -> int:
    """f_theta's latent ring: ``2 * rank`` float32 per slot, ``model window - 1 + slack`` slots, all layers together."""
    return (shape.sliding_window - 1 + policy.slack) * 2 * rank * 4


def policy_table(shape: KVShape, context: int, sink: int = 4, window: int = 64, restore_rank: int = 0) -> dict:
    table = {"full": session_bytes(shape, None, context)}
    for bits in (0, 8, 4):
        suffix = f"+kv{bits}" if bits else ""
        table["native" + suffix] = session_bytes(shape, CachePolicy("native", full_kv_bits=bits), context)
        table["sink-window" + suffix] = session_bytes(
            shape, CachePolicy("sink-window", sink=sink, window=window, full_kv_bits=bits), context
        )
    if restore_rank and window < shape.sliding_window:  # restoration needs evicted positions
        for bits in (0, 8):
            suffix = f"+kv{bits}" if bits else ""
            row = dict(table["sink-window" + suffix])
            row["restored_bytes"] = restored_bytes(
                shape, CachePolicy("sink-window", sink=sink, window=window), restore_rank
            )
            row["total_bytes"] += row["restored_bytes"]
            table["sink-window" + suffix + "+restore"] = row
    return table
