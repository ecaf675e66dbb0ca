"""One generation's verifier state: prefill, verify a block in one forward, commit/trim.

Backend-neutral: the model object (``model_mlx.TargetMLX`` or
``model_torch.TargetTorch``) supplies the forward, the caches and the few
array operations; the cache policy and ring bookkeeping live in ``cache.py``.
A session owns its caches; nothing is shared between sessions but the weights.
Per block there is one host sync (the target's choices as ints); aux hidden
states stay on the device and only the kept rows are handed on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from services.checkpoints.config import load_target_config
from services.orchestrator.endpoints import ModelInfo

from .cache import CachePolicy, RingLayout

PREFILL_CHUNK = 512  # bounds prefill attention memory, like mlx-lm's prefill_step_size


class VerifierSession:
    def __init__(self, target, aux_layers: Sequence[int], policy: CachePolicy):
        self.target = target
        self.aux_layers = tuple(aux_layers)
        self.policy = policy.resolve(target.args.sliding_window)
        self.layout = RingLayout(self.policy.sink, self.policy.window, self.policy.slack)
        self.cache = target.make_cache(self.layout, self.policy)
        self._pending = None  # (block length, aux of the block) between verify and commit
        self.closed = False

    @property
    def offset(self) -> int:
        return self.layout.offset

    def _forward(self, ids: Sequence[int]):
        out = self.target.run(ids, self.cache, self.aux_layers, self.layout.plan(len(ids)))
        self.layout.applied()
        return out

    def prefill(self, prompt_ids: Sequence[int]):
        self._check_open()
        if self.offset != 0:
            raise RuntimeError("prefill must be the first call of a session")
        if not prompt_ids:
            raise ValueError("prompt_ids is empty")
        chunks = []
        for start in range(0, len(prompt_ids), PREFILL_CHUNK):
            out = self._forward(prompt_ids[start : start + PREFILL_CHUNK])
            chunks.append(out.aux)
            self.target.materialize(out, self.cache)  # never one huge graph for a long prompt
        first = self.target.greedy(out.hidden[:, -1:])[0]
        return first, self.target.cat(chunks)

    def verify(self, block_ids: Sequence[int]) -> list[int]:
        self._check_open()
        if self._pending is not None:
            raise RuntimeError("commit the previous block before verifying another")
        if not 1 <= len(block_ids) <= self.policy.slack:
            raise ValueError(f"block length must be 1..{self.policy.slack}, got {len(block_ids)}")
        out = self._forward(block_ids)
        self._pending = (len(block_ids), out.aux)
        return self.target.greedy(out.hidden)

    def commit(self, n_keep: int):
        self._check_open()
        if self._pending is None:
            raise RuntimeError("nothing to commit: verify a block first")
        n, aux = self._pending
        if not 0 <= n_keep <= n:
            raise ValueError(f"n_keep must be 0..{n}, got {n_keep}")
        if n - n_keep:
            self.layout.trim(n - n_keep)
            self.target.trim_full(self.cache, n - n_keep)
        self._pending = None
        return aux[:n_keep]

    def stats(self) -> dict:
        return {
            "cache_policy": self.policy.label,
            "bounded": self.policy.kind != "native",
            "positions": self.offset,
            "kv_bytes": self.target.kv_bytes(self.cache),
        }

    def close(self) -> None:
        self.cache, self._pending, self.closed = [], None, True

    def _check_open(self):
        if self.closed:
            raise RuntimeError("session is closed")


class LocalVerifier:
    """A loaded target in this process; hands out independent sessions."""

    def __init__(self, target, target_dir: str | Path, aux_layers: Sequence[int], policy: CachePolicy = CachePolicy()):
        cfg = load_target_config(target_dir)
        self.target = target
        self.aux_layers = tuple(aux_layers)
        self.policy = policy
        eos = cfg.get("eos_token_id", [])
        args = target.args
        self.info = ModelInfo(
            name=str(target_dir),
            vocab_size=args.vocab_size,
            eos_token_ids=tuple(eos if isinstance(eos, list) else [eos]),
            hidden_size=args.hidden_size,
            num_layers=args.num_hidden_layers,
            sliding_window=args.sliding_window,
            backend=target.backend,
        )

    def open_session(self, policy: CachePolicy | None = None) -> VerifierSession:
        return VerifierSession(self.target, self.aux_layers, policy or self.policy)


def mlx_verifier(target_dir: str | Path, aux_layers: Sequence[int], policy: CachePolicy = CachePolicy()) -> LocalVerifier:
    from .model_mlx import TargetMLX

    return LocalVerifier(TargetMLX.load(target_dir), target_dir, aux_layers, policy)
