"""A loaded target in this process (:class:`LocalVerifier`): the Verifier protocol without a wire (over gRPC:
``orchestrator/remote/verifier.py``); many sessions' blocks decided in one forward (``session.decide_batch``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

from kakeya.checkpoints.config import load_target_config
from kakeya.checkpoints.tokenizer import read_tokenizer
from kakeya.core.constraints import Constraint, ConstraintError, Grammar, tokenizer
from kakeya.core.contract import ModelInfo, SessionOptions
from kakeya.core.prefix import PrefixCache
from kakeya.core.request import CachePolicy, SamplingParams
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
        self.target_dir = str(target_dir)
        self.constrains = _tokenizer_json(self.target_dir) is not None  # it can take constraints
        self.target = target
        self.prefixes = prefixes
        self.aux_layers = tuple(aux_layers)
        self.policy = policy
        cfg = load_target_config(target_dir)
        eos = cfg["eos_token_id"]  # generation_config.json's when it has one (load_target_config)
        args = target.args
        self.info = ModelInfo(
            name=str(Path(target_dir).absolute()),  # GetInfo's: a split orchestrator reads it in another cwd
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
        """``constraint`` compiled for a new session against the target's own tokenizer (over the model's
        vocabulary; its first EOS id ends a finished grammar); ValueError naming its field."""
        info = self.info
        return _open_grammar(constraint, self.target_dir, info.vocab_size, info.eos_token_ids)

    def healthy(self, timeout: float = 1.0) -> bool:
        return True  # in this process: it answers whenever it is asked

    decide_batch = staticmethod(decide_batch)  # ``session.decide_batch`` itself: no wrapper a round passes through


def mlx_verifier(
    target_dir: str | Path, aux_layers: Sequence[int], policy: CachePolicy = CachePolicy(), prefixes=None
) -> LocalVerifier:
    from kakeya.verifier.mlx_backend.target import TargetMLX

    return LocalVerifier(TargetMLX.load(target_dir), target_dir, aux_layers, policy, prefixes)


@functools.lru_cache(maxsize=4)
def _tokenizer_json(target_dir: str) -> str | None:
    """The checkpoint's tokenizer as ``tokenizers`` writes it (``to_str``): the text the front's codec hands its
    checks and guide, so that a colocated verifier shares their llguidance tokenizer and compiled grammars."""
    return None if (tok := read_tokenizer(target_dir)) is None else tok.to_str()


def _open_grammar(constraint: Constraint, target_dir: str | Path, vocab: int, eos_ids: Sequence[int]) -> Grammar:
    """``constraint``'s grammar state at the start of a generation; ValueError naming the field if it does not
    compile (the orchestrator checked it already; a remote client may not have)."""
    text = _tokenizer_json(str(target_dir))
    if text is None:
        raise ValueError("constraint: this verifier has no tokenizer to compile a constraint against")
    if not eos_ids:
        raise ValueError("constraint: the model declares no EOS token to end a constrained generation")
    try:
        return Grammar(constraint.grammar(), tokenizer(text, vocab, (int(eos_ids[0]),)))
    except ConstraintError as exc:
        raise ValueError(f"constraint.spec: {exc}") from None
