"""The contract types (``services/core/contract.py``) <-> their wire messages: the one place they meet.

Every ``CachePolicy`` field crosses: a policy a client asked for is never narrowed on the way (quantized full layers,
f_theta restoration included). ``ModelInfo`` travels inside the verifier's ``VerifierInfo`` (to the orchestrator) and
the public ``ModelInfo`` (to clients). ``SamplingParams`` crosses as the sessions' ``Sampling`` (and the public
``SamplingParams``), rule included; a rejection-rule drafter's ``Proposal`` as its compact [n, K] ids and probabilities.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from kakeya.core.constraints import Constraint
from kakeya.core.contract import ModelInfo, Proposal, TokenLogprobs
from kakeya.core.request import (
    COUPLED,
    MAX_BLOCK_SIZE,
    MAX_LOGPROBS,
    REJECTION,
    CachePolicy,
    InvalidRequest,
    SamplingParams,
    public_field,
    wire_float,
)
from kakeya.wire.kakeya.v1 import cache_pb2
from kakeya.wire.kakeya.v1 import generate_pb2 as gpb
from kakeya.wire.kakeya.v1 import sampling_pb2 as spb
from kakeya.wire.kakeya.v1 import verifier_pb2 as vpb

KIND_TO_NAME = {cache_pb2.CACHE_KIND_NATIVE: "native", cache_pb2.CACHE_KIND_SINK_WINDOW: "sink-window"}
NAME_TO_KIND = {v: k for k, v in KIND_TO_NAME.items()}


def policy_to_proto(p: CachePolicy) -> cache_pb2.CachePolicy:
    if p.kind not in NAME_TO_KIND:
        raise ValueError(f"cache policy kind must be 'native' or 'sink-window', got {p.kind!r}")
    return cache_pb2.CachePolicy(
        kind=NAME_TO_KIND[p.kind],
        sink=p.sink,
        window=(p.window or 0) if p.kind != "native" else 0,  # native: always the model's own window
        slack=p.slack,
        full_kv_bits=p.full_kv_bits,
        full_kv_group_size=p.full_kv_group_size if p.full_kv_bits else 0,
        restore_path=p.restore or "",
    )


def policy_from_proto(p: cache_pb2.CachePolicy, default: CachePolicy, field: str = "cache_policy") -> CachePolicy:
    """A message with ``kind`` set is a whole policy (0 / "" mean exact, the model's window, no restoration; ``slack``
    0 means the server's); with ``kind`` unset it is ``default``. Raises ValueError naming the field. Only the shape
    is checked here; ``CachePolicy.resolve`` checks the values against the model when a session opens."""
    if p.kind == cache_pb2.CACHE_KIND_UNSPECIFIED:
        given = [f.name for f, _ in p.ListFields()]
        if given:  # never drop what a client asked for
            raise InvalidRequest(f"{field}.kind", f"must be set when {', '.join(given)} is given")
        return default
    if p.kind not in KIND_TO_NAME:
        raise InvalidRequest(f"{field}.kind", f"unknown cache kind {p.kind}")
    kind = KIND_TO_NAME[p.kind]
    if p.sink < 0:
        raise InvalidRequest(f"{field}.sink", f"must be >= 0, got {p.sink}")
    if p.window < 0:
        raise InvalidRequest(f"{field}.window", f"must be >= 0 (0 = the model's window), got {p.window}")
    if not 0 <= p.slack <= MAX_BLOCK_SIZE:
        raise InvalidRequest(f"{field}.slack", f"must be 0 (default) or 1..{MAX_BLOCK_SIZE}, got {p.slack}")
    if kind == "native" and (p.sink or p.window):
        raise InvalidRequest(field, "sink and window apply to CACHE_KIND_SINK_WINDOW only")
    if p.full_kv_group_size and not p.full_kv_bits:  # it would be dropped: the session runs exact
        raise InvalidRequest(f"{field}.full_kv_group_size", "applies with full_kv_bits 4 or 8 only (0: exact K/V)")
    values = {
        "kind": kind,
        "sink": p.sink,
        "window": p.window or None,
        "slack": p.slack or default.slack,
        "full_kv_bits": p.full_kv_bits,
        "full_kv_group_size": p.full_kv_group_size or default.full_kv_group_size,
        "restore": p.restore_path or None,
    }
    return dataclasses.replace(default, **values)


# ModelInfo fields a VerifierInfo carries under the same name (0: a server that does not say, for the limits)
_VERIFIER_INFO_FIELDS = ("vocab_size", "hidden_size", "num_layers", "sliding_window")


def verifier_info_to_proto(info: ModelInfo, aux_layers, **server_fields) -> vpb.VerifierInfo:
    """What a verifier server publishes: the model's facts plus the server's own (``server_fields``)."""
    same = {f: getattr(info, f) for f in _VERIFIER_INFO_FIELDS}
    return vpb.VerifierInfo(
        model_name=info.name,
        eos_token_ids=list(info.eos_token_ids),
        target_layer_ids=list(aux_layers),
        backend=info.backend,
        **same,
        **server_fields,
    )


def model_info_from_verifier(r: vpb.VerifierInfo, backend: str, extra: dict | None = None) -> ModelInfo:
    """The ``ModelInfo`` of a remote verifier (``backend``: how this side reaches it)."""
    same = {f: getattr(r, f) for f in _VERIFIER_INFO_FIELDS + ("max_position_embeddings", "max_context")}
    return ModelInfo(
        name=r.model_name, eos_token_ids=tuple(r.eos_token_ids), backend=backend, extra=dict(extra or {}), **same
    )


def public_model_info(info: ModelInfo, **api_fields) -> gpb.ModelInfo:
    """The public API's ``ModelInfo``: the target's facts plus the orchestrator's (``api_fields``)."""
    return gpb.ModelInfo(
        vocab_size=info.vocab_size,
        eos_token_ids=list(info.eos_token_ids),
        sliding_window=info.sliding_window,
        max_block_size=MAX_BLOCK_SIZE,
        **api_fields,
    )


# --------------------------------------------------------------------------- sampling


_RULES = {COUPLED: spb.SAMPLING_RULE_COUPLED, REJECTION: spb.SAMPLING_RULE_REJECTION}
_RULE_NAMES = {v: k for k, v in _RULES.items()} | {spb.SAMPLING_RULE_UNSPECIFIED: COUPLED}


def rule_to_proto(rule: str) -> int:
    return _RULES[rule]


def rule_from_proto(value: int):
    """The rule's name (unspecified: the default, coupled); an unknown number as itself, for
    ``SamplingParams.check`` to refuse naming the field."""
    return _RULE_NAMES.get(value, value)


def sampling_to_proto(s: SamplingParams) -> spb.Sampling:
    return spb.Sampling(
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p,
        min_p=s.min_p,
        seed=s.seed or 0,
        rule=rule_to_proto(s.rule),
    )


def sampling_of(m: spb.Sampling | gpb.SamplingParams, seed: int | None) -> SamplingParams:
    """A ``Sampling`` (sessions) or a public ``SamplingParams`` as SamplingParams (proto3 zeros: off), unchecked."""
    top_p = wire_float(m.top_p) if m.top_p else 1.0
    return SamplingParams(wire_float(m.temperature), m.top_k, top_p, wire_float(m.min_p), seed, rule_from_proto(m.rule))


def sampling_from_proto(m: spb.Sampling, field: str = "sampling") -> SamplingParams | None:
    """A session's ``Sampling`` (None: greedy), checked; ValueError naming the field."""
    if not m.temperature:
        return None
    try:
        return sampling_of(m, m.seed).check()
    except InvalidRequest as exc:  # named as the message it came in names it
        raise InvalidRequest(public_field(exc.field, {"sampling": field}), exc.reason) from None


# A constraint's kind -> its field of the Constraint message's oneof (the same names)
CONSTRAINT_FIELDS = ("json_schema", "json_object", "regex", "choice", "grammar")


def constraint_to_proto(c: Constraint) -> spb.Constraint:
    if c.kind == "json_object":
        return spb.Constraint(json_object=True)
    if c.kind == "choice":
        return spb.Constraint(choice=spb.Constraint.Choices(choices=list(c.spec or ())))
    if c.kind == "json_schema":
        spec = c.spec if isinstance(c.spec, str) else json.dumps(c.spec)
        return spb.Constraint(json_schema=spec)
    if c.kind not in CONSTRAINT_FIELDS:
        raise ValueError(f"constraint.kind: {c.kind!r} has no wire form")
    return spb.Constraint(**{c.kind: c.spec})


def constraint_from_proto(m: spb.Constraint, field: str = "constraint") -> tuple[Constraint | None, str]:
    """The Constraint ``m`` carries (None: unset) and the name of the field that carried its spec."""
    which = m.WhichOneof("spec")
    if which is None:
        return None, field
    if which == "json_object":
        if not m.json_object:
            raise ValueError(f"{field}.json_object: must be true (leave the constraint unset for none)")
        return Constraint("json_object"), f"{field}.json_object"
    if which == "choice":
        return Constraint("choice", tuple(m.choice.choices)), f"{field}.choice.choices"
    return Constraint(which, getattr(m, which)), f"{field}.{which}"


def proposal_to_proto(p: Proposal) -> spb.Proposal:
    return spb.Proposal(k=p.ids.shape[1], ids=p.ids.ravel().tolist(), probs=p.probs.ravel().tolist())


def proposal_from_proto(m: spb.Proposal, n: int, vocab: int, field: str = "proposal") -> Proposal:
    """The proposal of ``n`` candidates; ValueError naming the field when its shape or values are off."""
    k = m.k
    if k < 1 or len(m.ids) != n * k or len(m.probs) != n * k:
        raise ValueError(f"{field}: {len(m.ids)} ids and {len(m.probs)} probs with k={k} do not make {n} rows")
    ids = np.asarray(m.ids, np.int32).reshape(n, k)
    probs = np.asarray(m.probs, np.float32).reshape(n, k)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise ValueError(f"{field}.ids: ids outside the vocabulary [0, {vocab})")
    if not np.all(np.isfinite(probs)) or (probs < 0).any() or (n and (probs.sum(-1) <= 0).any()):
        raise ValueError(f"{field}.probs: probabilities must be finite, >= 0, with a positive sum per row")
    return Proposal(ids, probs)


def logprobs_to_proto(lp: TokenLogprobs) -> spb.TokenLogprobs:
    return spb.TokenLogprobs(
        token=lp.token, logprob=lp.logprob, top_ids=[t for t, _ in lp.top], top_logprobs=[v for _, v in lp.top]
    )


def logprobs_from_proto(m: spb.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(m.token, m.logprob, tuple(zip(m.top_ids, m.top_logprobs)))


def check_logprobs(value: int, field: str) -> int:
    """A requested number of top logprobs (``Request.logprobs``): 0..MAX_LOGPROBS, else ValueError naming ``field``."""
    if not 0 <= value <= MAX_LOGPROBS:
        raise ValueError(f"{field}: must be 0..{MAX_LOGPROBS}, got {value}")
    return value
