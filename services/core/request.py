"""What a client asks for: one generation (:class:`Request`), how its tokens are sampled (:class:`SamplingParams`)
and how its verifier cache is bounded (:class:`CachePolicy`).

Every front (the CLI, the gRPC API, the HTTP API) builds a :class:`Request` and hands it to the engine, which checks
it in one place (``orchestrator/decode/checks.py``): the result is a :class:`CheckedRequest`, the only kind a run
accepts. A refused value raises :class:`InvalidRequest` naming the :class:`Request` field it came in
(``max_tokens``, ``sampling.temperature``, ``cache_policy.window``); each front renames the field as its own clients
spell it (``sampling_params.temperature`` on gRPC, ``temperature`` over HTTP).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from kakeya.core.constraints import Constraint


class InvalidRequest(ValueError):
    """A value of a request that is refused: ``field`` is its path in :class:`Request`, ``reason`` why, ``code``
    OpenAI's error code for it where it has its own (``context_length_exceeded``, which agent frameworks act on)."""

    def __init__(self, field: str, reason: str, code: str | None = None):
        super().__init__(f"{field}: {reason}")
        self.field, self.reason, self.code = field, reason, code

    def public(self, names: Mapping[str, str]) -> str:
        """The message with the field renamed by ``names`` (a front's spelling of a field or of one of its
        parents: ``{"sampling": "sampling_params"}`` turns ``sampling.top_p`` into ``sampling_params.top_p``;
        a parent renamed to "" drops it: ``{"sampling": ""}`` gives ``top_p``)."""
        return f"{public_field(self.field, names)}: {self.reason}"


_INDEX = re.compile(r"\[\d+\]")


def public_field(path: str, names: Mapping[str, str]) -> str:
    """``path`` with its longest prefix found in ``names`` replaced (see :meth:`InvalidRequest.public`); an item's index
    stays with its list's new name (``prompt.messages[1].role`` -> ``messages[1].role``). A name whose lists are written
    ``[]`` renames a field inside their items, each index taking its ``[]`` in turn: ``{"prompt.tools[].parameters":
    "tools[].function.parameters"}`` turns ``prompt.tools[2].parameters`` into ``tools[2].function.parameters``."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        head, index = ".".join(parts[:cut]), ""
        indices = _INDEX.findall(head)
        if indices and head not in names and _INDEX.sub("[]", head) in names:
            renamed = names[_INDEX.sub("[]", head)]
            for i in indices:
                renamed = renamed.replace("[]", i, 1)
            return ".".join(p for p in [renamed, *parts[cut:]] if p)
        if head not in names and head.endswith("]") and "[" in head:
            head, index = head[: head.rindex("[")], head[head.rindex("[") :]
        if head in names:
            return ".".join(p for p in [names[head] + index, *parts[cut:]] if p)
    return path


# The most alternatives a request may ask with each token's log-probability (``Request.logprobs``):
# OpenAI's chat ``top_logprobs`` limit (its completions API allows 5).
MAX_LOGPROBS = 20


# The largest block a loop drafts, a verifier verifies and a drafter drafts,
# and so the ring's rollback slack: one number for every layer.
MAX_BLOCK_SIZE = 16


@dataclass(frozen=True)
class CachePolicy:
    """How a session bounds its sliding-layer K/V (full-attention layers always stay exact). ``native``: the
    model's own sliding window, no sinks (not bounded as a whole: full layers grow with the context).
    ``sink-window``: ``sink`` first positions kept forever, plus a window of ``window`` (the query included)."""

    kind: str = "native"
    sink: int = 0
    window: int | None = None  # None: the model's sliding_window
    slack: int = MAX_BLOCK_SIZE  # largest block that can be verified and rolled back exactly
    full_kv_bits: int = 0  # 0: exact full-attention K/V; 4 or 8: affine-quantized
    full_kv_group_size: int = 64  # capped at the full layers' head dim
    restore: str | None = None  # an f_theta directory: restore evicted sliding positions (sink-window only)

    def resolve(self, model_window: int) -> CachePolicy:
        """Fill in the model's defaults and check the values (:class:`InvalidRequest` naming the field)."""
        if self.kind not in ("native", "sink-window"):
            raise InvalidRequest("cache_policy.kind", f"must be 'native' or 'sink-window', got {self.kind!r}")
        if self.full_kv_bits not in (0, 4, 8):
            raise InvalidRequest("cache_policy.full_kv_bits", f"must be 0 (exact), 4 or 8, got {self.full_kv_bits}")
        if self.full_kv_group_size not in (32, 64, 128):
            why = f"must be 32, 64 or 128, got {self.full_kv_group_size}"
            raise InvalidRequest("cache_policy.full_kv_group_size", why)
        if not 1 <= self.slack <= MAX_BLOCK_SIZE:
            why = f"must be 1..{MAX_BLOCK_SIZE} (the largest block), got {self.slack}"
            raise InvalidRequest("cache_policy.slack", why)
        if self.restore is not None and (self.kind != "sink-window" or not str(self.restore)):
            why = "needs kind 'sink-window' (full-attention layers always stay exact)"
            raise InvalidRequest("cache_policy.restore", why)
        if self.kind == "native":
            if self.sink or self.window not in (None, model_window):
                raise InvalidRequest("cache_policy", "the native policy takes no sink/window: use kind 'sink-window'")
            return replace(self, sink=0, window=model_window)
        window = self.window if self.window is not None else model_window
        if window < 1 or self.sink < 0:  # the field that is off, so a refusal names what its caller set
            why = f"sink-window needs window >= 1 and sink >= 0 (got window={window}, sink={self.sink})"
            raise InvalidRequest("cache_policy.window" if window < 1 else "cache_policy.sink", why)
        if self.restore is not None and window >= model_window:
            raise InvalidRequest(
                "cache_policy.window",
                f"restore needs a window smaller than the model's sliding window {model_window} "
                f"(got window={window}): nothing is evicted that the model would still attend to",
            )
        return replace(self, window=window)

    @property
    def label(self) -> str:
        """A short name for reports, e.g. ``sink-window(4+64)+kv8``."""
        name = self.kind if self.kind == "native" else f"sink-window({self.sink}+{self.window})"
        return name + (f"+kv{self.full_kv_bits}" if self.full_kv_bits else "") + ("+restore" if self.restore else "")


# The sampling rules (``core/sampling.py``): coupled (the default) gives AR sampling's tokens with the seed, whatever
# the drafter or the block schedule; rejection is exact in distribution, its tokens depend on the block sizes.
COUPLED, REJECTION = "coupled", "rejection"
SAMPLING_RULES = (COUPLED, REJECTION)

# The smallest temperature that samples (0 is greedy). Below it logits / temperature can leave
# float32's range (1e-39 makes every logit infinite): such a request is refused, naming the field.
MIN_TEMPERATURE = 1e-5
F32_TINY, F32_MAX = (float(v) for v in (np.finfo(np.float32).smallest_subnormal, np.finfo(np.float32).max))


def wire_float(x: float) -> float:
    """``x`` as the wire's float32 carries it, read back as the shortest decimal that round-trips it (0.7f -> 0.7),
    so a split deployment samples with the very numbers a colocated one does. 0 stays 0; past float32's range, the
    nearest value that keeps its meaning and sign (a top-p of 1e-50 keeps the top token alone; -0.5 stays refused)."""
    return float(str(np.float32(math.copysign(min(max(abs(x), F32_TINY), F32_MAX), x)))) if x else 0.0


@dataclass(frozen=True)
class SamplingParams:
    """How the target's next-token distribution p is processed and sampled.

    p = softmax(logits / temperature) restricted by top-k, then top-p (the top token always stays), then min-p,
    renormalised. Temperature 0 is greedy: token-identical to greedy AR. ``seed``: None, the engine draws one; ``rule``:
    how speculative blocks sample (:data:`COUPLED` or :data:`REJECTION`)."""

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
        """Raise :class:`InvalidRequest` naming the bad field (``sampling.<name>``); return self."""
        t = self.temperature
        if not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise InvalidRequest("sampling.temperature", f"must be a finite number >= 0 (0 = greedy), got {t!r}")
        if 0 < t < MIN_TEMPERATURE:
            why = f"must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {t!r}"
            raise InvalidRequest("sampling.temperature", why)
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequest("sampling.top_k", f"must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise InvalidRequest("sampling.top_p", f"must be in (0, 1] (1 = off), got {self.top_p!r}")
        if not (isinstance(self.min_p, (int, float)) and 0 <= self.min_p <= 1):
            raise InvalidRequest("sampling.min_p", f"must be in [0, 1] (0 = off), got {self.min_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**64):
            raise InvalidRequest("sampling.seed", f"must be an integer in [0, 2**64), got {self.seed!r}")
        if self.rule not in SAMPLING_RULES:
            raise InvalidRequest("sampling.rule", f"must be one of {', '.join(SAMPLING_RULES)}, got {self.rule!r}")
        return replace(self, temperature=wire_float(t), top_p=wire_float(self.top_p), min_p=wire_float(self.min_p))

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


@dataclass(frozen=True)
class ToolCall:
    """A call of a function tool, as OpenAI's ``tool_calls`` carry it: ``arguments`` is a JSON object's text."""

    id: str
    name: str
    arguments: str = "{}"


@dataclass(frozen=True)
class Tool:
    """A function the model may call (OpenAI's function tool): ``parameters`` is its arguments' JSON schema;
    ``strict``: its calls' arguments are held to that schema even where the model may answer in text instead."""

    name: str
    description: str = ""
    parameters: Mapping | None = None
    strict: bool = False


@dataclass(frozen=True)
class Message:
    """One turn of a conversation, as the checkpoint's chat template reads it (``name``: its participant's, or a
    ``tool`` message's function): an assistant's turn may call tools; a ``tool`` message answers ``tool_call_id``."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""
    name: str = ""


# ``Chat.tool_choice``: whether the model may call a tool (``auto``), must not (``none``), must call one
# (``required``), or must call the function named (any other value: its name).
AUTO, NONE, REQUIRED = "auto", "none", "required"


@dataclass(frozen=True)
class Chat:
    """A conversation to render with the checkpoint's chat template (``orchestrator/text.py``).

    ``continue_final_message``: the last message is left open for the model to continue, as transformers'
    ``apply_chat_template`` does. ``tools``: the functions the template declares; ``tool_choice`` (:data:`AUTO`,
    :data:`NONE`, :data:`REQUIRED` or a function's name) decides whether calls are parsed. ``parallel_tool_calls``
    False: at most one call (a grammar stops the model after one)."""

    messages: tuple[Message, ...]
    continue_final_message: bool = False
    tools: tuple[Tool, ...] = ()
    tool_choice: str = AUTO
    parallel_tool_calls: bool = True


Prompt = Sequence[int] | str | Chat  # token ids, a text to tokenize, or a conversation to render


@dataclass(frozen=True)
class Request:
    """One generation, as every front hands it to the engine.

    ``prompt`` is what the client sent: token ids, a text, or a :class:`Chat`. ``Engine.check`` returns it as a
    :class:`CheckedRequest`: the prompt as token ids (``prompt_ids``), defaults filled in and every value checked."""

    prompt: Prompt
    max_tokens: int | None = None  # None: the server's default (the CLI's: 128)
    block_size: int = 0  # 0: auto, sized block by block (``orchestrator/decode/block_sizing.py``)
    stop_ids: Sequence[int] = ()  # besides the model's EOS ids, unless ``ignore_eos``
    stop_strings: Sequence[str] = ()
    ignore_eos: bool = False
    cache_policy: CachePolicy | None = None  # None: the verifier's default
    sampling: SamplingParams = GREEDY  # unseeded: the engine draws the seed (and reports it)
    request_id: str = ""  # for logs and the backends' streams; "": the engine makes one
    max_block_size: int = MAX_BLOCK_SIZE  # the largest block auto may pick (the cache policy may cap it lower)
    # None: none. k (0..MAX_LOGPROBS): every committed token comes with its log-probability and the k most
    # probable tokens at its position, from the target's raw distribution (``core.contract.TokenLogprobs``).
    logprobs: int | None = None
    constraint: Constraint | None = None  # what the output must match (``core/constraints.py``); None: anything
    # A stream resumed: the tokens its client already received of this very request (same prompt, sampling, seed,
    # limits); the run continues after them and streams only what follows (``decode/takeover.py``).
    resume_ids: Sequence[int] = ()


@dataclass(frozen=True)
class CheckedRequest(Request):
    """A :class:`Request` as it runs: what ``Engine.check`` returns (``orchestrator/decode/checks.py``, nothing
    else builds one) and a ``Run`` accepts. ``prompt`` is token ids, ``max_tokens`` and ``request_id`` are
    filled in, a sampling request has its seed, and every value was checked against the model and the limits."""

    @property
    def prompt_ids(self) -> list[int]:
        return list(self.prompt)
