"""What a client asks for: one generation (:class:`Request`), how its tokens are sampled
(:class:`SamplingParams`) and how its verifier cache is bounded (:class:`CachePolicy`).

Every front (CLI, gRPC, HTTP) builds a :class:`Request` and the engine validates it; the
checks here name the public field a bad value came in.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

# The largest block a loop drafts, a verifier verifies and a drafter drafts,
# and so the ring's rollback slack: one number for every layer.
MAX_BLOCK_SIZE = 16


def check_block_size(block_size: int) -> None:
    if not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"block_size must be between 1 and {MAX_BLOCK_SIZE}, got {block_size}")


@dataclass(frozen=True)
class CachePolicy:
    """How a session bounds its sliding-layer K/V. Full-attention layers always stay exact (S5).

    ``native``: the model's own sliding window, no sinks. Not bounded as a
    whole: full-attention layers still grow with the context.
    ``sink-window``: ``sink`` first positions are kept forever, plus a window of
    ``window`` positions (including the query itself).
    """

    kind: str = "native"
    sink: int = 0
    window: int | None = None  # None: the model's sliding_window
    slack: int = MAX_BLOCK_SIZE  # largest block that can be verified and rolled back exactly
    full_kv_bits: int = 0  # 0: exact full-attention K/V; 4 or 8: affine-quantized
    full_kv_group_size: int = 64  # capped at the full layers' head dim
    restore: str | None = None  # an f_theta directory: restore evicted sliding positions (sink-window only)

    def resolve(self, model_window: int) -> CachePolicy:
        """Fill in the model's defaults and check the values; raise ValueError naming the field."""
        if self.kind not in ("native", "sink-window"):
            raise ValueError(f"cache policy kind must be 'native' or 'sink-window', got {self.kind!r}")
        if self.full_kv_bits not in (0, 4, 8):
            raise ValueError(f"full_kv_bits must be 0 (exact), 4 or 8, got {self.full_kv_bits}")
        if self.full_kv_group_size not in (32, 64, 128):
            raise ValueError(f"full_kv_group_size must be 32, 64 or 128, got {self.full_kv_group_size}")
        if not 1 <= self.slack <= MAX_BLOCK_SIZE:
            raise ValueError(f"slack must be 1..{MAX_BLOCK_SIZE} (the largest block), got {self.slack}")
        if self.restore is not None and (self.kind != "sink-window" or not str(self.restore)):
            raise ValueError("restore (an f_theta directory) needs kind 'sink-window': full layers stay exact (S5)")
        if self.kind == "native":
            if self.sink or self.window not in (None, model_window):
                raise ValueError("the native policy takes no sink/window: use kind 'sink-window'")
            return replace(self, sink=0, window=model_window)
        window = self.window if self.window is not None else model_window
        if window < 1 or self.sink < 0:
            raise ValueError(f"sink-window needs window >= 1 and sink >= 0 (got window={window}, sink={self.sink})")
        if self.restore is not None and window >= model_window:
            raise ValueError(
                f"restore needs a window smaller than the model's sliding window {model_window} "
                f"(got window={window}): nothing is evicted that the model would still attend to"
            )
        return replace(self, window=window)

    @property
    def label(self) -> str:
        """A short name for reports, e.g. ``sink-window(4+64)+kv8``."""
        name = self.kind if self.kind == "native" else f"sink-window({self.sink}+{self.window})"
        return name + (f"+kv{self.full_kv_bits}" if self.full_kv_bits else "") + ("+restore" if self.restore else "")


# The sampling rules (``services/core/sampling.py``). Coupled (the default): every token is
# argmax(processed logits + G(seed, position, token)), the drafter proposes with the same noise
# and the verifier keeps the candidates equal to its own choices, so the output is AR sampling
# with that seed, token for token, whatever the drafter or the block schedule. Rejection: the
# drafter samples from a proposal it sends and the verifier accepts with min(1, p/q'); exact in
# distribution, but its tokens depend on the drafter's proposals and the block sizes.
COUPLED, REJECTION = "coupled", "rejection"
SAMPLING_RULES = (COUPLED, REJECTION)

# The smallest temperature that samples (0 is greedy). Below it logits / temperature can leave
# float32's range (1e-39 makes every logit infinite): such a request is refused, naming the field.
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How the target's next-token distribution p is processed and sampled.

    p = softmax(logits / temperature) restricted by top-k, then top-p (the
    smallest most-probable set reaching ``top_p``; the top token always stays),
    then min-p (tokens with p >= ``min_p * max p``), renormalised. Temperature 0
    is greedy: argmax, no randomness, token-identical to greedy AR. ``seed``
    seeds the sampling (None: the engine draws one); ``rule`` is how
    speculative blocks sample (:data:`COUPLED` or :data:`REJECTION`).
    """

    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off
    seed: int | None = None
    rule: str = COUPLED

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def filtered(self) -> bool:
        """Whether top-k, top-p or min-p may cut p's support (else it is all of the vocabulary)."""
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0

    def check(self) -> SamplingParams:
        """Raise ValueError naming the bad field; return self."""
        t = self.temperature
        if not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if 0 < t < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {t!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if not (isinstance(self.min_p, (int, float)) and 0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**64):
            raise ValueError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        if self.rule not in SAMPLING_RULES:
            raise ValueError(f"rule must be one of {', '.join(SAMPLING_RULES)}, got {self.rule!r}")
        return self

    def seeded(self) -> SamplingParams:
        """These params with a seed: an unseeded sampling request draws one here (and reports it)."""
        if self.greedy or self.seed is not None:
            return self
        import secrets

        return replace(self, seed=secrets.randbits(63))

    @property
    def label(self) -> str:
        if self.greedy:
            return "greedy"
        parts = [f"temperature {self.temperature:g}"]
        parts += [f"top-k {self.top_k}"] if self.top_k else []
        parts += [f"top-p {self.top_p:g}"] if self.top_p < 1 else []
        parts += [f"min-p {self.min_p:g}"] if self.min_p > 0 else []
        return ", ".join(parts + [f"{self.rule} rule"])


GREEDY = SamplingParams()


@dataclass
class Request:
    """One generation, as every front (CLI, public API, benchmarks) hands it to the engine.

    Token ids in: turning text into ids, and cutting the streamed text at
    ``stop_strings``, is the front's work with the engine's codec.
    """

    prompt_ids: list[int]
    max_tokens: int = 128
    block_size: int = 0  # 0: auto, sized block by block (``orchestrator/adaptive.py``)
    stop_ids: Sequence[int] = ()  # besides the model's EOS ids, unless ``ignore_eos``
    stop_strings: Sequence[str] = ()
    ignore_eos: bool = False
    cache_policy: CachePolicy | None = None  # None: the verifier's default
    sampling: SamplingParams = GREEDY  # unseeded: the engine draws the seed (and reports it)
    request_id: str = ""  # for logs and the backends' streams
    max_block_size: int = MAX_BLOCK_SIZE  # the largest block auto may pick (the cache policy may cap it lower)
