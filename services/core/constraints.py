"""Constrained decoding: what a request may ask its output to match, and the grammar state that enforces it.

A :class:`Constraint` is what a client sent: a JSON schema, any JSON object, a regex, a choice among strings, or a Lark
grammar. :meth:`Constraint.grammar` turns it into llguidance's grammar text, which depends on no tokenizer, so it is
what travels. :class:`Grammar` is that grammar run against a tokenizer: it consumes committed tokens, rolls back, and
writes the bitmask of the tokens allowed next.

llguidance (rather than xgrammar): Lark grammars with special tokens named by id (the tool-call grammar), the tokens a
grammar forces (guided drafting), and a HF ``tokenizers`` JSON taken as it is.
"""

from __future__ import annotations

import functools
import json
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass

import llguidance
import numpy as np

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")

# JSON is written compactly but readably, as ``json.dumps`` writes it: one separator each, no free
# whitespace (free whitespace lets a model pad forever, and fixed separators are tokens the grammar forces).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_SPEC_CHARS = 100_000  # a constraint's text (schema, regex, grammar, choices) at most
MAX_ERROR_CHARS = 300  # what a refusal quotes of the grammar compiler's message
_ONE_OF = "oneOf constraints are not supported. Enable 'coerce_one_of' option to approximate oneOf with anyOf"


class ConstraintError(ValueError):
    """A constraint that does not compile: the message says why (bounded), for the field that carried it."""


def valid_unicode(value) -> bool:
    """Whether every string of a JSON value (keys too) is valid Unicode: no lone surrogate (JSON's ``\\ud800``
    escape, which ASCII text may carry), which no tokenizer, chat template or grammar compiler takes."""
    try:
        json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return False
    return True


def load_json(text: str):
    """JSON carried inside a request's strings (a tool call's arguments, a gRPC tool's ``parameters_json``, a
    schema constraint's text), parsed as the HTTP front parses a body: the value, or ValueError saying why it
    holds none this server takes (not JSON, nested beyond what the parser follows, a lone surrogate)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    except ValueError as exc:
        raise ValueError(f"not valid JSON ({exc})") from None
    try:
        if valid_unicode(value):
            return value
    except RecursionError:
        raise ValueError("nested too deeply") from None
    raise ValueError("contains a lone surrogate (\\ud800-\\udfff): not valid Unicode")


@dataclass(frozen=True)
class Constraint:
    """What the output must match. ``spec``: the JSON schema (a JSON text or a dict), the regex, the list
    of choices (strings), or the Lark grammar; ``json_object`` takes none (any JSON object)."""

    kind: str
    spec: str | dict | tuple[str, ...] | None = None

    def __post_init__(self):
        if isinstance(self.spec, list):
            object.__setattr__(self, "spec", tuple(self.spec))

    def grammar(self) -> str:
        """llguidance's grammar text for this constraint; :class:`ConstraintError` if its spec is malformed."""
        if self.kind not in KINDS:
            raise ConstraintError(f"kind must be one of {', '.join(KINDS)}, got {str(self.kind)[:40]!r}")
        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if self.kind == "choice":
            spec = self.spec
            if not isinstance(spec, tuple) or not spec or not all(isinstance(s, str) and s for s in spec):
                raise ConstraintError("choice needs a non-empty list of non-empty strings")
            if sum(map(len, spec)) > MAX_SPEC_CHARS:
                raise ConstraintError(f"choices longer than {MAX_SPEC_CHARS} characters in all")
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(s) for s in spec))
        if self.kind == "json_schema":
            return _schema_grammar(self.spec)
        if not isinstance(self.spec, str) or not self.spec:
            raise ConstraintError(f"{self.kind} needs a non-empty string")
        _check_size(len(self.spec))
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.spec)
        return llguidance.LLMatcher.grammar_from_lark(self.spec)


def _schema_grammar(spec) -> str:
    if isinstance(spec, str):  # measured once parsed, as compact JSON, not as sent (the transport bounds the text)
        try:
            spec = load_json(spec)
        except ValueError as exc:
            raise ConstraintError(str(exc)) from None
    if not isinstance(spec, dict):
        raise ConstraintError("a JSON schema must be a JSON object")
    try:
        _check_size(len(json.dumps(spec, separators=(",", ":"), ensure_ascii=False)))  # as compact JSON text
        spec = plain_formats(spec)
    except RecursionError:
        raise ConstraintError("nested too deeply") from None
    try:  # as text: llguidance reads a dict's integers only up to 64 bits (pydantic's Field(le=10**20))
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(spec | {"x-guidance": JSON_OPTIONS}))
    except ValueError as exc:
        raise ConstraintError(_bounded(str(exc))) from None


def plain_formats(node, names: bool = False):
    """A JSON schema without what llguidance refuses though it asks for nothing: a ``format`` it has no regex for
    (:data:`FORMATS`; an annotation, ``docs/structured.md``), ``uniqueItems: false`` (a tool's parameters take it).
    ``names``: ``node`` maps names to schemas (``properties``), its keys no keywords."""
    if isinstance(node, list):
        return [plain_formats(n) for n in node]
    if not isinstance(node, dict):
        return node
    values, maps = {"enum", "const", "default", "examples"}, {"properties", "patternProperties", "$defs", "definitions"}
    return {k: v if k in values and not names else plain_formats(v, k in maps and not names)
            for k, v in node.items() if names or (k != "format" or not isinstance(v, str) or v in FORMATS)
            and (k, v) != ("uniqueItems", False)}  # fmt: skip


def placed(error: str, c: Constraint) -> str:
    """llguidance's refusal of schema keywords (``Unimplemented keys: ["uniqueItems"]``) led by where the first one
    sits in ``c``'s JSON schema (``$defs.Inner.properties.tags.uniqueItems``), as a tool's schema names its places."""
    keys = re.findall(r'"([^"]+)"', error.partition("Unimplemented keys: ")[2])
    if c.kind != "json_schema" or not keys:
        return error
    where = _place(load_json(c.spec) if isinstance(c.spec, str) else c.spec, keys[0], "")
    return f"{where}: {error}" if where else error


def _place(node, key: str, where: str) -> str | None:
    """Where schema keyword ``key`` first sits in ``node`` (the schema at ``where``), or None."""
    if isinstance(node, list):
        return next(filter(None, (_place(v, key, f"{where}[{i}]") for i, v in enumerate(node))), None)
    if not isinstance(node, dict):
        return None
    here = lambda k: f"{where}.{k}" if where else k
    return here(key) if key in node else next(filter(None, (_place(v, key, here(k)) for k, v in node.items())), None)


def _check_size(chars: int) -> None:
    if chars > MAX_SPEC_CHARS:
        raise ConstraintError(f"longer than {MAX_SPEC_CHARS} characters")


def _bounded(message: str) -> str:
    message = " ".join(message.split())
    return message if len(message) <= MAX_ERROR_CHARS else message[: MAX_ERROR_CHARS - 3] + "..."


@functools.lru_cache(maxsize=8)
def tokenizer(tokenizer_json: str, n_vocab: int, eos_ids: tuple[int, ...]) -> llguidance.LLTokenizer:
    """llguidance's view of a checkpoint's tokenizer (a HF ``tokenizer.json`` text) over the model's
    ``n_vocab`` logits, ``eos_ids`` the tokens that end a finished grammar. Built once per checkpoint."""
    return llguidance.LLTokenizer(tokenizer_json, n_vocab=n_vocab, eos_token=list(eos_ids))


class CompiledGrammars:
    """A bounded, thread-safe LRU of grammars compiled against a tokenizer (keyed by the grammar text and the
    tokenizer object): every request of an agent repeats its schema, and its check, the verifier's session and
    the loop's guide each take a copy of one compiled matcher (``deep_copy``: microseconds, a compile
    milliseconds). A grammar that does not compile is not kept."""

    def __init__(self, maxsize: int):
        self.maxsize = maxsize
        self.hits = self.misses = 0
        self._matchers: OrderedDict[tuple[str, llguidance.LLTokenizer], llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._matchers)

    def matcher(self, grammar: str, tok: llguidance.LLTokenizer) -> llguidance.LLMatcher:
        """A fresh matcher of ``grammar`` over ``tok`` at its start; :class:`ConstraintError` if it does not compile."""
        key = (grammar, tok)
        with self._lock:
            pristine = self._matchers.get(key)
            if pristine is not None:
                self._matchers.move_to_end(key)
                self.hits += 1
                _raise_if_failed(pristine)  # a copy failed at run time (a lexer's budget): the grammar with it
                return pristine.deep_copy()
            self.misses += 1
        pristine = llguidance.LLMatcher(tok, grammar, log_level=0)  # compiled outside the lock
        if pristine.is_error():  # its advice to set its own option (x-guidance: an annotation here) is none to give
            why = pristine.get_error().replace(_ONE_OF, "oneOf branches one value may match are not held: use anyOf")
            raise ConstraintError(_bounded(why))
        with self._lock:
            self._matchers[key] = pristine
            self._matchers.move_to_end(key)
            while len(self._matchers) > self.maxsize:
                self._matchers.popitem(last=False)
        return pristine.deep_copy()


COMPILED = CompiledGrammars(maxsize=64)  # this process's compiled grammars


def _yield_the_cores() -> None:
    """A grammar worker's CPU priority lowered (Linux: ``nice`` is a thread's own), so that a grammar which takes
    seconds to build (a regex bomb's lexer) runs on what the model threads leave (``docs/structured.md``)."""
    with suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


# Where requests' grammars are checked: two at a time, below every other thread's priority.
_CHECKS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-check", initializer=_yield_the_cores)


def check(grammar: str, tok: llguidance.LLTokenizer) -> None:
    """:class:`ConstraintError` if ``grammar`` does not compile against ``tok`` (a bad regex, Lark rule, schema)
    or meets llguidance's budgets at its first masks; one that does is compiled once here for the sessions that
    follow (:data:`COMPILED`). Runs on a low-priority worker (:data:`_CHECKS`); the caller waits for it."""
    _CHECKS.submit(_check, grammar, tok).result()


def _check(grammar: str, tok: llguidance.LLTokenizer) -> None:
    matcher = COMPILED.matcher(grammar, tok)
    mask = np.zeros((tok.vocab_size + 31) // 32, np.int32)
    matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
    _raise_if_failed(matcher)
    # One step further, along the first token allowed: a regex bomb (``b{99999997}``) builds its lexer for
    # seconds at the first mask and fails only once a token is taken. Met here, on the caller's thread
    # (llguidance lets go of the GIL), it is the request's 400 on every deployment, before any session or
    # model thread sees it; the copy is thrown away.
    allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[: tok.vocab_size])
    first = next((int(t) for t in allowed if int(t) not in tok.eos_tokens), None)
    if first is not None and matcher.try_consume_tokens([first]) == 1:
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
    _raise_if_failed(matcher)


class Grammar:
    """One generation's grammar state over the tokens committed so far (an llguidance matcher).

    :meth:`bitmask` gives, for a block ``[last, c1 .. c_{L-1}]``, the tokens allowed after the committed prefix and after
    each run of candidates, leaving the state as it was; :meth:`advance` consumes what a block committed. Once the
    grammar is finished only the EOS ids are allowed."""

    def __init__(self, grammar: str, tok: llguidance.LLTokenizer):
        self.matcher = COMPILED.matcher(grammar, tok)
        self.vocab = tok.vocab_size
        self.eos = tok.eos_token
        self.words = (self.vocab + 31) // 32
        self.specials = _specials(tok)
        self.ended = False  # no token could continue the grammar: the generation ended at EOS (:meth:`_fill`)
        # The first row, computed now, where the grammar is opened: a verifier opens it on the session's
        # handler thread, so the first mask's cost (a large regex's lexer: up to seconds) and a budget met
        # there (ConstraintError, the request's) stay off the model thread; used by the first bitmask.
        self._first: np.ndarray | None = np.full(self.words, -1, np.int32)
        self._fill(self._first)

    def bitmask(self, candidates: Sequence[int]) -> np.ndarray:
        """Allowed tokens, llguidance's packed rows [len(candidates) + 1, ceil(vocab / 32)] (int32, token t at
        bit t % 32 of word t // 32; the backends expand them on the device): row i after the committed prefix and
        ``candidates[:i]``. A row after a candidate the grammar refuses is all allowed: the acceptance rule
        never reaches it (the choice before it, being allowed, differs from that candidate)."""
        bits = np.full((len(candidates) + 1, self.words), -1, np.int32)
        consumed = 0
        for i in range(len(candidates) + 1):
            if i == 0 and self._first is not None:
                bits[0] = self._first
            else:
                self._fill(bits[i])
            if i == len(candidates) or self.matcher.try_consume_tokens([int(candidates[i])]) != 1:
                break
            consumed += 1
        if consumed:
            self.matcher.rollback(consumed)
        return bits

    def _fill(self, row: np.ndarray) -> None:
        if not self.finished and self._allowed(row):
            return
        # finished, or no token continues the grammar: it ends here (the loop stops at the EOS it commits)
        row[:] = 0
        row[self.eos // 32] |= np.int32(np.uint32(1 << (self.eos % 32)).view(np.int32))

    def _allowed(self, row: np.ndarray) -> bool:
        """Write the tokens allowed next into ``row``; whether there is any."""
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        _raise_if_failed(self.matcher)
        self._drop_refused_specials(row)
        return bool(row.any())

    def _dead_end(self) -> bool:
        """Whether no token continues the grammar from here (its next text is one only a special token spells)."""
        return not self._allowed(np.zeros(self.words, np.int32))

    def _drop_refused_specials(self, row: np.ndarray) -> None:
        """Clear the special tokens a mask allows but the matcher would not consume: llguidance 1.9 allows one whose
        text the grammar spells next (``<pad>`` of a choice ``["<pad>"]``), then refuses it when committed."""
        words = row.view(np.uint32)
        ids, at, bit = self.specials
        hit = words[at] & bit  # one gather: most masks allow no special token, and cost no more than this
        if not hit.any():
            return
        for t in ids[hit != 0].tolist():
            if self.matcher.validate_tokens([t]) != 1:
                words[t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)

    def advance(self, tokens: Sequence[int]) -> None:
        """Consume committed ``tokens`` (each one a mask allowed); past the end of the grammar nothing is kept."""
        self._first = None  # the state moves on: the first row no longer describes it
        for t in tokens:
            if self.finished:
                return
            if int(t) == self.eos and self.matcher.validate_tokens([self.eos]) != 1 and self._dead_end():
                self.ended = True  # the EOS _fill allowed where no token could continue the grammar
                return
            # refused: never committed silently (a 500: ours), unless validating or taking it met a budget of the
            # grammar's (a refusal: the request's)
            if self.matcher.validate_tokens([int(t)]) != 1 or not self.matcher.consume_token(int(t)):
                _raise_if_failed(self.matcher)
                raise RuntimeError(f"constraint: committed token {int(t)} is outside the grammar")

    def allowed_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` the grammar would take in a row from here (the state is left as it is)."""
        return 0 if self.finished else int(self.matcher.validate_tokens([int(t) for t in tokens]))

    def choose(self, ranked: Sequence[Sequence[int]]) -> list[int]:
        """Walk a drafted block: at each position the first of its ``ranked`` ids the grammar allows after the
        state here and the ids chosen before it; the block ends at the first position where none is (or
        where the grammar has finished). The state is left as it was."""
        chosen: list[int] = []
        for row in ranked:
            if self.finished:
                break
            pick = next((t for t in row if self.matcher.try_consume_tokens([t]) == 1), None)
            if pick is None:
                break
            chosen.append(pick)
        if chosen:
            self.matcher.rollback(len(chosen))
        return chosen

    def forced(self) -> list[int]:
        """The tokens the grammar forces next, whatever the model would pick (may be empty)."""
        return [] if self.finished else list(self.matcher.compute_ff_tokens())

    @property
    def finished(self) -> bool:
        return self.ended or self.matcher.is_stopped()


def _raise_if_failed(matcher: llguidance.LLMatcher) -> None:
    """:class:`ConstraintError` (the request's, never a 500) where ``matcher`` failed as it ran: a grammar that
    compiles can still exceed llguidance's budgets once followed (``a{99999999}``, issue 43's fuzz)."""
    if matcher.is_error():
        reason = matcher.get_error().split("\n")[0]  # the rest is the parser's state
        raise ConstraintError(f"the constraint cannot be followed: {_bounded(reason)}")


@functools.lru_cache(maxsize=8)
def _specials(tok: llguidance.LLTokenizer) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The special tokens of ``tok``, EOS too (a mask allows it by its text, ``["<eos>x"]``): their ids, and the
    word and bit of each in a mask row."""
    ids = np.array([i for i in range(tok.vocab_size) if tok.is_special_token(i)], np.int64)
    return ids, ids >> 5, (np.uint32(1) << (ids & 31).astype(np.uint32)).astype(np.uint32)


def unpack(bits: np.ndarray, vocab: int) -> np.ndarray:
    """llguidance's bitmask rows (32 tokens an int32, lowest bit first) as bool [rows, vocab]."""
    return np.unpackbits(bits.view(np.uint8), axis=-1, bitorder="little")[:, :vocab].astype(bool)


# The string formats llguidance's JSON-schema compiler enforces, as its own regexes (llguidance
# parser/src/json/formats.rs, MIT licence; named groups made plain): a tool call's grammar holds the same.
FORMATS = {
    "date-time": (
        r"(?:[0-9]{4}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|("
        r"?:02)-(?:0[1-9]|1[0-9]|2[0-9])))[tT](?:(?:[01][0-9]|2[0-3]):[0-5][0-9]:(?:[0-5][0-9]|60)(?:\.[0-9]+)"
        r"?(?:[zZ]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9]))"
    ),
    "time": (
        r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:(?:[0-5][0-9]|60)(?:\.[0-9]+)?(?:[zZ]|[+-](?:[01][0-9]|2[0-3]):[0-5]"
        r"[0-9])"
    ),
    "date": (
        r"(?:[0-9]{4}-(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01]))|(?:[0-9]{4}-(?:0[469]|11)-(?:0[1-9]|[12]["
        r"0-9]|30))|(?:[0-9]{4}-02-(?:0[1-9]|1[0-9]|2[0-9]))"
    ),
    "duration": (
        r"P(?:(?:(?:(?:[0-9]+Y(?:[0-9]+M(?:[0-9]+D)?)?)|(?:[0-9]+M(?:[0-9]+D)?)|(?:[0-9]+D))(?:T(?:(?:[0-9]+H("
        r"?:[0-9]+M(?:[0-9]+S)?)?)|(?:[0-9]+M(?:[0-9]+S)?)|(?:[0-9]+S)))?)|(?:T(?:(?:[0-9]+H(?:[0-9]+M(?:[0-9]"
        r"+S)?)?)|(?:[0-9]+M(?:[0-9]+S)?)|(?:[0-9]+S)))|(?:[0-9]+W))"
    ),
    "email": (
        r"(?:(?:[a-zA-Z0-9!#$%&'*+\-/=?\^_`{|}~]+(\.[a-zA-Z0-9!#$%&'*+\-/=?\^_`{|}~]+)*))@((?:(?:[a-zA-Z0-9](["
        r"a-zA-Z0-9-]*[a-zA-Z0-9])?)(\.(?:[a-zA-Z0-9]([a-zA-Z0-9-]*[a-zA-Z0-9])?))*)|\[(?:((([0-9])|(([1-9])[0"
        r"-9]|(25[0-5]|(2[0-4]|(1)[0-9])[0-9])))\.){3}(([0-9])|(([1-9])[0-9]|(25[0-5]|(2[0-4]|(1)[0-9])[0-9]))"
        r"))\])"
    ),
    "hostname": r"[a-zA-Z0-9]([a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?(\.[a-zA-Z0-9]([a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?)*",
    "ipv4": (
        r"((([0-9])|(([1-9])[0-9]|(25[0-5]|(2[0-4]|(1)[0-9])[0-9])))\.){3}(([0-9])|(([1-9])[0-9]|(25[0-5]|(2[0"
        r"-4]|(1)[0-9])[0-9])))"
    ),
    "ipv6": (
        r"(?:(?:(?:[0-9a-fA-F]{1,4}:){7}[0-9a-fA-F]{1,4}))|(?:::(?:[0-9a-fA-F]{1,4}:){0,5}(?:[0-9a-fA-F]{1,4}:"
        r"[0-9a-fA-F]{1,4}))|(?:(?:[0-9a-fA-F]{1,4})?::(?:[0-9a-fA-F]{1,4}:){0,4}(?:[0-9a-fA-F]{1,4}:[0-9a-fA-"
        r"F]{1,4}))|(?:((?:[0-9a-fA-F]{1,4}:){0,1}[0-9a-fA-F]{1,4})?::(?:[0-9a-fA-F]{1,4}:){0,3}(?:[0-9a-fA-F]"
        r"{1,4}:[0-9a-fA-F]{1,4}))|(?:((?:[0-9a-fA-F]{1,4}:){0,2}[0-9a-fA-F]{1,4})?::(?:[0-9a-fA-F]{1,4}:){0,2"
        r"}(?:[0-9a-fA-F]{1,4}:[0-9a-fA-F]{1,4}))|(?:((?:[0-9a-fA-F]{1,4}:){0,3}[0-9a-fA-F]{1,4})?::[0-9a-fA-F"
        r"]{1,4}:(?:[0-9a-fA-F]{1,4}:[0-9a-fA-F]{1,4}))|(?:((?:[0-9a-fA-F]{1,4}:){0,4}[0-9a-fA-F]{1,4})?::(?:["
        r"0-9a-fA-F]{1,4}:[0-9a-fA-F]{1,4}))|(?:((?:[0-9a-fA-F]{1,4}:){0,5}[0-9a-fA-F]{1,4})?::(?:[0-9a-fA-F]{"
        r"1,4}))|(?:((?:[0-9a-fA-F]{1,4}:){0,6}[0-9a-fA-F]{1,4})?::)"
    ),
    "uuid": (
        r"(?:[0-9a-fA-F]{8})-(?:[0-9a-fA-F]{4})-(?:[0-9a-fA-F]{4})-(?:[0-9a-fA-F]{2})(?:[0-9a-fA-F]{2})-(?:[0-"
        r"9a-fA-F]{12})"
    ),
    "uri": (
        r"(?:[a-zA-Z][a-zA-Z0-9+\-.]*):(?://(?:(?:(?:[a-zA-Z0-9\-._~!$&'()*+,;=:]|%[0-9a-fA-F]{2})*)@)?(?:\[(?"
        r":(?:[0-9a-fA-F]{1,4}:){7}[0-9a-fA-F]{1,4}|(?:[0-9a-fA-F]{1,4}:){1,7}:|(?:[0-9a-fA-F]{1,4}:){1,6}:[0-"
        r"9a-fA-F]{1,4}|(?:[0-9a-fA-F]{1,4}:){1,5}(?::[0-9a-fA-F]{1,4}){1,2}|(?:[0-9a-fA-F]{1,4}:){1,4}(?::[0-"
        r"9a-fA-F]{1,4}){1,3}|(?:[0-9a-fA-F]{1,4}:){1,3}(?::[0-9a-fA-F]{1,4}){1,4}|(?:[0-9a-fA-F]{1,4}:){1,2}("
        r"?::[0-9a-fA-F]{1,4}){1,5}|[0-9a-fA-F]{1,4}:(?::[0-9a-fA-F]{1,4}){1,6}|:(?::[0-9a-fA-F]{1,4}){1,7}|::"
        r"|v[0-9a-fA-F]+\.[a-zA-Z0-9\-._~!$&'()*+,;=:]+)\]|(?:(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])\.)"
        r"{3}(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])|(?:[a-zA-Z0-9\-._~!$&'()*+,;=]|%[0-9a-fA-F]{2})*)(?"
        r"::(?:[0-9]*))?(?:(?:/(?:[a-zA-Z0-9\-._~!$&'()*+,;=:@]|%[0-9a-fA-F]{2})*)*)|(?:/(?:(?:[a-zA-Z0-9\-._~"
        r"!$&'()*+,;=:@]|%[0-9a-fA-F]{2})+(?:/(?:[a-zA-Z0-9\-._~!$&'()*+,;=:@]|%[0-9a-fA-F]{2})*)*)?)|(?:(?:[a"
        r"-zA-Z0-9\-._~!$&'()*+,;=:@]|%[0-9a-fA-F]{2})+(?:/(?:[a-zA-Z0-9\-._~!$&'()*+,;=:@]|%[0-9a-fA-F]{2})*)"
        r"*)|(?:))(?:\?(?:(?:[a-zA-Z0-9\-._~!$&'()*+,;=:@/?]|%[0-9a-fA-F]{2})*))?(?:\#(?:(?:[a-zA-Z0-9\-._~!$&"
        r"'()*+,;=:@/?]|%[0-9a-fA-F]{2})*))?"
    ),
}  # fmt: skip
