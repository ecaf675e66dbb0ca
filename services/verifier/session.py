"""One generation's verifier state on MLX: prefill, verify a block in one forward, commit/trim.

A session owns its caches; nothing is shared between sessions but the weights.
Per block there is one host sync (the target's choices as ints); aux hidden
states stay on the device and only the kept rows are handed on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import mlx.core as mx

from services.checkpoints.config import load_target_config
from services.orchestrator.endpoints import ModelInfo

from .cache import CachePolicy, RingLayout
from .model_mlx import TargetMLX

PREFILL_CHUNK = 512  # bounds prefill attention memory, like mlx-lm's prefill_step_size


class MLXVerifierSession:
    def __init__(self, target: TargetMLX, aux_layers: Sequence[int], policy: CachePolicy):
        self.target = target
        self.aux_layers = tuple(aux_layers)
        self.policy = policy.resolve(target.args.sliding_window)
        self.layout = RingLayout(self.policy.sink, self.policy.window, self.policy.slack)
        self.cache = target.make_cache(self.layout)
        self._rings = [c for c in self.cache if hasattr(c, "layout")]
        self._full = [c for c in self.cache if not hasattr(c, "layout")]
        self._pending: tuple[int, mx.array] | None = None  # (block length, aux of the block)
        self.closed = False

    @property
    def offset(self) -> int:
        return self.layout.offset

    def _forward(self, ids: Sequence[int]):
        plan = self.layout.plan(len(ids))
        for ring in self._rings:
            ring.plan = plan
        out = self.target.forward(mx.array([list(ids)]), self.cache, self.aux_layers, mx.array(plan.mask))
        self.layout.applied()
        return out

    def prefill(self, prompt_ids: Sequence[int]) -> tuple[int, mx.array]:
        self._check_open()
        if self.offset != 0:
            raise RuntimeError("prefill must be the first call of a session")
        if not prompt_ids:
            raise ValueError("prompt_ids is empty")
        aux_chunks = []
        for start in range(0, len(prompt_ids), PREFILL_CHUNK):
            out = self._forward(prompt_ids[start : start + PREFILL_CHUNK])
            aux_chunks.append(out.aux)
            # Materialise chunk by chunk so a long prompt never builds one huge graph.
            mx.eval(out.aux, [c.keys for c in self.cache])
        logits = self.target.logits(out.hidden[:, -1:])
        aux = aux_chunks[0] if len(aux_chunks) == 1 else mx.concatenate(aux_chunks, axis=0)
        return int(mx.argmax(logits[0, -1]).item()), aux

    def verify(self, block_ids: Sequence[int]) -> list[int]:
        self._check_open()
        if self._pending is not None:
            raise RuntimeError("commit the previous block before verifying another")
        if not 1 <= len(block_ids) <= self.policy.slack:
            raise ValueError(f"block length must be 1..{self.policy.slack}, got {len(block_ids)}")
        out = self._forward(block_ids)
        choices = mx.argmax(self.target.logits(out.hidden)[0], axis=-1)
        self._pending = (len(block_ids), out.aux)
        return choices.tolist()

    def commit(self, n_keep: int) -> mx.array:
        self._check_open()
        if self._pending is None:
            raise RuntimeError("nothing to commit: verify a block first")
        n, aux = self._pending
        if not 0 <= n_keep <= n:
            raise ValueError(f"n_keep must be 0..{n}, got {n_keep}")
        drop = n - n_keep
        if drop:
            self.layout.trim(drop)
            for c in self._full:
                c.trim(drop)
        self._pending = None
        return aux[:n_keep]

    def stats(self) -> dict:
        return {
            "cache_policy": self.policy.kind,
            "bounded": self.policy.kind != "native",
            "positions": self.offset,
            "kv_bytes": {
                "sliding": sum(r.nbytes for r in self._rings),
                "full": sum(c.nbytes for c in self._full),
            },
        }

    def close(self) -> None:
        self.cache, self._rings, self._full, self._pending = [], [], [], None
        self.closed = True

    def _check_open(self):
        if self.closed:
            raise RuntimeError("session is closed")


class MLXVerifier:
    """The loaded target; hands out independent sessions."""

    def __init__(self, target_dir: str | Path, aux_layers: Sequence[int], policy: CachePolicy = CachePolicy()):
        cfg = load_target_config(target_dir)
        self.target = TargetMLX.load(target_dir)
        self.aux_layers = tuple(aux_layers)
        self.policy = policy
        eos = cfg.get("eos_token_id", [])
        self.info = ModelInfo(
            name=str(target_dir),
            vocab_size=self.target.args.vocab_size,
            eos_token_ids=tuple(eos if isinstance(eos, list) else [eos]),
            hidden_size=self.target.args.hidden_size,
            num_layers=self.target.args.num_hidden_layers,
            sliding_window=self.target.args.sliding_window,
            backend="mlx",
        )

    def open_session(self, policy: CachePolicy | None = None) -> MLXVerifierSession:
        return MLXVerifierSession(self.target, self.aux_layers, policy or self.policy)
