"""A loaded target in this process (:class:`LocalVerifier`): the Verifier protocol without a wire (over gRPC:
``orchestrator/remote/verifier.py``); many sessions' blocks decided in one forward (``session.decide_batch``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kakeya.checkpoints.config import load_target_config
from kakeya.core.constraints import Constraint, Grammar
from kakeya.core.contract import ModelInfo, SessionOptions
from kakeya.core.prefix import PrefixCache
from kakeya.core.request import CachePolicy, SamplingParams
from kakeya.verifier import constrained
from kakeya.verifier.backend import Target
from kakeya.verifier.session import LocalVerifierSession, decide_batch


class LocalVerifier:
    """A loaded target in this process; hands out independent sessions (``prefixes``: their prefix cache)."""

    def __init__(
        self,
        target: Target,
        target_dir: str | Path,
        aux_layers: Sequence[int],
        policy: CachePolicy = CachePolicy(),
        prefixes: PrefixCache | None = None,
    ):
        cfg = load_target_config(target_dir)
        self.target_dir = str(target_dir)
        self.constrains = constrained.available(target_dir)
        self.target = target
        self.prefixes = prefixes
        self.aux_layers = tuple(aux_layers)
        self.policy = policy
        eos = cfg["eos_token_id"]  # generation_config.json's when it has one (load_target_config)
        args = target.args
        self.info = ModelInfo(
            name=str(target_dir),
            vocab_size=args.vocab_size,
            eos_token_ids=tuple(eos),
            hidden_size=args.hidden_size,
            num_layers=args.num_hidden_layers,
            sliding_window=args.sliding_window,
            backend=target.backend,
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 0),
        )

    def open_session(
        self,
        policy: CachePolicy | None = None,
        sampling: SamplingParams | None = None,
        options: SessionOptions | None = None,
    ) -> LocalVerifierSession:
        grammar = None if options is None or options.constraint is None else self.open_grammar(options.constraint)
        logprobs = options.logprobs if options is not None else None
        return LocalVerifierSession(
            self.target,
            self.aux_layers,
            policy or self.policy,
            sampling,
            self.prefixes,
            logprobs=logprobs,
            grammar=grammar,
        )

    def open_grammar(self, constraint: Constraint) -> Grammar:
        """``constraint`` compiled for a new session (``verifier/constrained.py``); ValueError naming its field."""
        info = self.info
        return constrained.open_grammar(constraint, self.target_dir, info.vocab_size, info.eos_token_ids)

    def healthy(self, timeout: float = 1.0) -> bool:
        return True  # in this process: it answers whenever it is asked

    decide_batch = staticmethod(decide_batch)  # ``session.decide_batch`` itself: no wrapper a round passes through


def mlx_verifier(
    target_dir: str | Path, aux_layers: Sequence[int], policy: CachePolicy = CachePolicy(), prefixes=None
) -> LocalVerifier:
    from kakeya.verifier.mlx_backend.target import TargetMLX

    return LocalVerifier(TargetMLX.load(target_dir), target_dir, aux_layers, policy, prefixes)
