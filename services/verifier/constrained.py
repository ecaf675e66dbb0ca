"""A constrained request's grammar, opened for one verifier session against the target's own tokenizer.

The request's :class:`~kakeya.core.constraints.Constraint` reaches the verifier as what the client sent (in
``SessionOptions``, or the ``Open`` message over gRPC); the verifier compiles it against the tokenizer beside its
weights (``tokenizer.json``), over the model's vocabulary (the logits may have more rows than the tokenizer has
tokens: those are never allowed), with the model's first EOS id as the token that ends a finished grammar. The
session then restricts every choice to what the grammar allows (``session.py``: ``_logits``), advancing it by what
each block commits.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer

from kakeya.core.constraints import Constraint, ConstraintError, Grammar, tokenizer


@functools.lru_cache(maxsize=4)
def _tokenizer_json(target_dir: str) -> str | None:
    """The checkpoint's tokenizer as ``tokenizers`` writes it (``to_str``): the text the front's codec hands its
    checks and guide, so that a colocated verifier shares their llguidance tokenizer and compiled grammars."""
    path = Path(target_dir) / "tokenizer.json"
    return Tokenizer.from_file(str(path)).to_str() if path.is_file() else None


def available(target_dir: str | Path) -> bool:
    """Whether a verifier of ``target_dir`` can take constraints (it has the checkpoint's tokenizer)."""
    return _tokenizer_json(str(target_dir)) is not None


def open_grammar(constraint: Constraint, target_dir: str | Path, vocab: int, eos_ids: Sequence[int]) -> Grammar:
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
