"""What a generation produced: its committed blocks, the record kept as they come (:class:`Generation`),
the one report every front translates when it ends (:class:`Report`), and its quality gate.

The gate flags output that collapsed into runaway repetition: not a proxy like "more tokens than the window",
but what the output *is*: a short unit of tokens tiled many times in a row, the signature of the cache-desync
collapse (``由于由于…``), with or without newlines.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kakeya.core.contract import KVBytes, TokenLogprobs, VerifierStats
from kakeya.core.request import GREEDY, SamplingParams

MAX_UNIT = 16  # longest repeating unit considered, in tokens
MIN_REPEATS = 8  # how many back-to-back copies make a runaway


@dataclass(frozen=True)
class Runaway:
    start: int  # index of the first token of the tiled span
    unit: tuple[int, ...]
    repeats: int


def find_runaway(token_ids: Sequence[int], max_unit: int = MAX_UNIT, min_repeats: int = MIN_REPEATS) -> Runaway | None:
    """The first span where a unit of <= ``max_unit`` tokens repeats >= ``min_repeats`` times back to back."""
    ids = list(token_ids)
    n = len(ids)
    for unit in range(1, max_unit + 1):
        # run[i] counts how far ids[i] == ids[i - unit] has held up to i.
        run = 0
        for i in range(unit, n):
            run = run + 1 if ids[i] == ids[i - unit] else 0
            if run >= unit * (min_repeats - 1):
                start = i - unit * min_repeats + 1
                return Runaway(start, tuple(ids[start : start + unit]), min_repeats)
    return None


def quality_report(token_ids: Sequence[int]) -> dict:
    hit = find_runaway(token_ids)
    if hit is None:
        return {"degenerate": False}
    return {"degenerate": True, "runaway": {"start": hit.start, "unit": list(hit.unit), "repeats": hit.repeats}}


@dataclass
class Block:
    """What one step of the loop committed (the prefill's first token is a block of its own)."""

    tokens: list[int]
    drafted: int  # candidates proposed (0 for the prefill token and block size 1)
    accepted: int  # candidates accepted
    draft_s: float = 0.0
    verify_s: float = 0.0  # the verifier's one step: verify and commit
    total_s: float = 0.0
    copied: bool = False  # its candidates were copied from earlier in the context (``proposers.py``)
    forced: bool = False  # its candidates were the tokens a constraint's grammar forces (``proposers.py``)
    logprobs: list[TokenLogprobs] | None = None  # one per token (a request with ``logprobs``); cut with ``tokens``

    def cut(self, keep: int) -> None:
        """Keep the first ``keep`` tokens (a stop token or string ended the generation inside the block)."""
        del self.tokens[keep:]
        if self.logprobs is not None:
            del self.logprobs[keep:]


@dataclass
class Generation:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    blocks: list[Block] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens resumed from a prefix cache's snapshot instead of prefilled
    finish_reason: str = "length"  # "stop" | "length" | "abort" | "error"
    prefill_s: float = 0.0
    decode_s: float = 0.0
    drafter_fallback: bool = False  # the drafter failed and the verifier finished alone
    verifier_stats: VerifierStats = VerifierStats()  # the verifier session's stats() at the end
    sampling: SamplingParams = GREEDY  # as run: with the seed used when sampling

    @property
    def acceptance_lengths(self) -> list[int]:
        """Tokens committed per speculative block (the prefill token is not a block)."""
        return [len(b.tokens) for b in self.blocks[1:]]

    mean_acceptance = property(lambda self: _mean(self.acceptance_lengths))

    @property
    def decode_tok_s(self) -> float:
        """Tokens after the first block (the prefill's token, or the ids a resumed stream sent) per second of decoding."""
        n = len(self.token_ids) - (len(self.blocks[0].tokens) if self.blocks else 1)
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


def _mean(lengths) -> float:
    return sum(lengths) / len(lengths) if lengths else 0.0


@dataclass(frozen=True)
class Report:
    """One finished generation, built once when it ends (``Run.report``) and translated by every front.

    ``block_size`` is the size asked for (0: auto), ``block_sizes`` each speculative block's size (candidates + 1) and
    ``acceptance_lengths`` the tokens each committed; the prefill's first token is no block. ``sampling`` is what ran,
    with the seed it drew; ``device``: where the models ran, when this process knows it (None: a remote server's)."""

    target: str
    draft: str
    backend: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    block_size: int
    block_sizes: tuple[int, ...] = ()
    acceptance_lengths: tuple[int, ...] = ()
    copied_blocks: int = 0  # blocks drafted by copying the context (n-gram), not by the drafter
    forced_blocks: int = 0  # blocks whose candidates a constraint's grammar forced, not the drafter's
    cached_tokens: int = 0  # prompt tokens resumed from the prefix cache instead of prefilled
    decode_tok_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    total_s: float = 0.0  # end to end, as the server saw it (0: not measured)
    drafter_fallback: bool = False  # the drafter failed and the verifier finished alone
    kv_bytes: KVBytes = KVBytes()  # the verifier session's, at the end
    cache_policy: str = ""
    cache_bounded: bool = False
    sampling: SamplingParams = GREEDY
    error: str = ""  # why, when ``finish_reason`` is "error"
    error_code: str = ""  # and its status's name, as a refusal's (``UNAVAILABLE`` ...): an HTTP answer's status
    device: str | None = None

    mean_acceptance = property(lambda self: _mean(self.acceptance_lengths))

    @property
    def quality(self) -> dict:
        """The runaway-repetition gate on the tokens (:func:`quality_report`)."""
        return quality_report(self.token_ids)

    def to_json(self) -> dict:
        """The ``kakeya generate --json`` object (and ``kakeya client generate --json``'s)."""
        s = self.sampling
        plain = ("target", "draft", "backend", "device", "block_size", "block_sizes", "copied_blocks", "forced_blocks",
                 "prompt_token_ids", "cached_tokens", "token_ids", "text", "finish_reason",
                 "acceptance_lengths")  # fmt: skip
        out = {k: list(v) if isinstance(v := getattr(self, k), tuple) else v for k in plain}
        sampling = {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "min_p": s.min_p}
        out |= {
            "mean_acceptance": round(self.mean_acceptance, 4),
            "decode_tok_s": round(self.decode_tok_s, 3),
            "prefill_s": round(self.prefill_s, 6),
            "drafter_fallback": self.drafter_fallback,
            "verifier_kv_bytes": self.kv_bytes.as_dict(),
            "cache_policy": self.cache_policy,
            "cache_bounded": self.cache_bounded,
            "quality": self.quality,
            "sampling": sampling | {"rule": None if s.greedy else s.rule},
            "seed": s.seed,
        }
        return out | ({"error": self.error} if self.error else {})
