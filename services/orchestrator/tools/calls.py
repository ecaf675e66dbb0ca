"""The model's tool calls, in Gemma-4's syntax, read out of its text into OpenAI's ``tool_calls``.

A call is ``<|tool_call>call:NAME{ARGS}<tool_call|>``: ARGS are ``key:value`` pairs, keys bare or quoted, strings
between ``<|"|>`` marks, other values as in JSON. :func:`parse_arguments` turns ARGS into the JSON object
``function.arguments`` carries; a call that does not parse stays in the text as content.

:class:`CallStream` reads streamed text: a tail that may start a marker is held back until the next block says what it
is. A call comes out whole once its end marker arrived; or, where a grammar holds every call well-formed, as OpenAI
streams one (:class:`ArgumentsStream`). Under ``auto`` a call waits for its end: a streamed call cannot be taken back.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
from dataclasses import dataclass, field

from kakeya.core.request import ToolCall

CALL_START, CALL_END, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
RESULT_START = "<|tool_response>"  # where the model stops to wait for a call's results
# The markers a tokenizer may hold as special tokens (Gemma-4's does): they stay in the decoded text.
MARKERS = (CALL_START, CALL_END, QUOTE, RESULT_START, "<tool_response|>")
NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
log = logging.getLogger(__name__)
_BARE_KEY = re.compile(r"[^:{}\[\],<\s]+")
_WORDS = {"true": True, "false": False, "null": None, "None": None}  # Gemma-4's template writes a null as None


def call_id() -> str:
    return "call_" + secrets.token_hex(12)


class _Malformed(ValueError):
    pass


class _Reader:
    """Recursive descent over Gemma-4's argument syntax (strict: anything else is :class:`_Malformed`)."""

    def __init__(self, text: str):
        self.text, self.at = text, 0

    def _skip(self) -> None:
        while self.at < len(self.text) and self.text[self.at].isspace():
            self.at += 1

    def _take(self, s: str) -> bool:
        self._skip()
        if self.text.startswith(s, self.at):
            self.at += len(s)
            return True
        return False

    def _quoted(self) -> str:
        end = self.text.find(QUOTE, self.at)
        if end < 0:
            raise _Malformed("an unterminated string")
        s, self.at = self.text[self.at : end], end + len(QUOTE)
        return s

    def members(self, close: str) -> dict:
        """``key:value,...`` up to ``close`` (consumed)."""
        out: dict = {}
        if self._take(close):
            return out
        while True:
            self._skip()
            if self._take(QUOTE):
                key = self._quoted()
            else:
                m = _BARE_KEY.match(self.text, self.at)
                if not m:
                    raise _Malformed(f"a key expected at {self.at}")
                key, self.at = m.group(), m.end()
            if not self._take(":"):
                raise _Malformed(f"':' expected at {self.at}")
            out[key] = self.value()
            if self._take(close):
                return out
            if not self._take(","):
                raise _Malformed(f"',' or {close!r} expected at {self.at}")

    def value(self):
        self._skip()
        if self._take(QUOTE):
            return self._quoted()
        if self._take("{"):
            return self.members("}")
        if self._take("["):
            items: list = []
            if self._take("]"):
                return items
            while True:
                items.append(self.value())
                if self._take("]"):
                    return items
                if not self._take(","):
                    raise _Malformed(f"',' or ']' expected at {self.at}")
        for word, v in _WORDS.items():
            if self.text.startswith(word, self.at):
                self.at += len(word)
                return v
        m = _NUMBER.match(self.text, self.at)
        if not m:
            raise _Malformed(f"a value expected at {self.at}")
        self.at = m.end()
        return json.loads(m.group())


def parse_arguments(args: str) -> dict | None:
    """``{key:value,...}`` (Gemma-4's arguments, braces included) as a JSON object; None if it does not parse."""
    reader = _Reader(args)
    try:
        if not reader._take("{"):
            return None
        out = reader.members("}")
        reader._skip()
        return out if reader.at == len(args) else None
    except _Malformed:
        return None


def parse_call(body: str) -> ToolCall | None:
    """``call:NAME{ARGS}`` (the text between the markers) as a call with a fresh id; None if malformed."""
    m = re.match(r"call:([^{]*)", body)
    if not m or not NAME.fullmatch(m[1]):
        return None
    args = parse_arguments(body[m.end() :])
    return None if args is None else ToolCall(call_id(), m[1], json.dumps(args, ensure_ascii=False))


def split(text: str) -> tuple[str, list[ToolCall]]:
    """A whole answer's text: its content (the text outside the calls) and its calls."""
    stream = CallStream()
    events = stream.feed(text) + stream.end()
    return "".join(e for e in events if isinstance(e, str)), [e for e in events if isinstance(e, ToolCall)]


def _held(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` may be the start of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


@dataclass(frozen=True)
class CallOpened:
    """A streamed call's start: its id and name (``call.arguments`` is empty; :class:`ArgumentsPiece` follow)."""

    call: ToolCall


@dataclass(frozen=True)
class ArgumentsPiece:
    """The next piece of the JSON arguments of the call last opened."""

    text: str


_HEADER = re.compile(r"call:([^{]*)\{")


@dataclass
class CallStream:
    """Streamed text -> events in the text's order: content (``str``) and calls, whole (:class:`ToolCall`) or,
    with ``arguments``, streamed (:class:`CallOpened`, then :class:`ArgumentsPiece`)."""

    arguments: bool = False  # stream each call's arguments as they come: the calls are grammar-held
    buffer: str = ""
    in_call: bool = False
    _args: ArgumentsStream | None = field(default=None, repr=False)  # the call being streamed
    _body: str = ""  # its arguments' text so far
    _opening: bool = True  # nothing but calls so far, or since the last call: a marker's start here opens one

    def feed(self, text: str) -> list:
        self.buffer += text
        out: list = []
        while True:
            if not self.in_call:
                at = self.buffer.find(CALL_START)
                if at < 0:  # hold a possible call mark; where only calls came, the results mark too
                    held = max(_held(self.buffer, CALL_START), self._opening and _held(self.buffer, RESULT_START))
                    cut = len(self.buffer) - held
                    self._content(out, self.buffer[:cut])
                    self.buffer = self.buffer[cut:]
                    return out
                self._content(out, self.buffer[:at])
                self.buffer, self.in_call = self.buffer[at + len(CALL_START) :], True
            elif self._args is not None:
                if not self._stream(out):
                    return out
            elif not (self.arguments and self._open(out)):
                at = self.buffer.find(CALL_END)
                if at < 0:
                    return out
                body, self.buffer, self.in_call = self.buffer[:at], self.buffer[at + len(CALL_END) :], False
                call = parse_call(body)
                if call is None:
                    self._content(out, CALL_START + body + CALL_END)
                else:
                    self._opening = True
                    out.append(call)

    def _open(self, out: list) -> bool:
        """A call's header (``call:NAME{``) complete and well-formed: open the call, stream what follows."""
        m = _HEADER.match(self.buffer)
        end = self.buffer.find(CALL_END)
        if not m or not NAME.fullmatch(m[1]) or 0 <= end < m.end():
            return False
        self._opening = True
        out.append(CallOpened(ToolCall(call_id(), m[1], "")))
        self._args, self._body, self.buffer = ArgumentsStream(), "", self.buffer[m.end() - 1 :]
        return True

    def _stream(self, out: list) -> bool:
        """The open call's arguments as far as they are written; True once its end marker has come."""
        at = self.buffer.find(CALL_END)
        cut = len(self.buffer) - _held(self.buffer, CALL_END) if at < 0 else at
        text, self.buffer = self.buffer[:cut], self.buffer[cut:]
        self._body += text
        piece = self._args.feed(text)
        if piece:
            out.append(ArgumentsPiece(piece))
        if at < 0:
            return False
        args = parse_arguments(self._body)
        if args is None or "".join(self._args.sent) != json.dumps(args, ensure_ascii=False):
            # a grammar-held call always parses: say so loudly if one did not, its pieces are sent
            log.error("a streamed tool call's arguments did not parse as they were streamed")
        self.buffer, self.in_call, self._args = self.buffer[len(CALL_END) :], False, None
        return True

    def end(self) -> list:
        """What the text's end leaves: a held-back tail, as content -- unless only calls came before it, where it is
        a mark's start cut (under a grammar-held ``tool_choice`` no other text can stand there); a call the text
        ends inside as the call so far (its arguments' JSON cut where the call was, as OpenAI reports a call cut by
        ``length``; dropped if its name was not whole). A streamed call sent these very arguments already: answer
        and stream agree."""
        out: list = []
        if self.in_call and self._args is None:
            m = _HEADER.match(self.buffer)
            if m and NAME.fullmatch(m[1]):
                body = self.buffer[m.end() - 1 :]
                body = body[: len(body) - _held(body, CALL_END)]  # as a stream holds back a possible end mark
                out.append(ToolCall(call_id(), m[1], ArgumentsStream().feed(body)))
        elif not self.in_call and not self._opening:
            self._content(out, self.buffer)
        self.buffer, self.in_call, self._args = "", False, None
        return out

    def _content(self, out: list, text: str) -> None:
        if text:
            out.append(text)
            self._opening = False


_ENDS = ",:{}[]"  # what ends a bare key, a number or a word (besides white space)


class ArgumentsStream:
    """Gemma-4 arguments text (from their ``{``), fed in pieces -> OpenAI's JSON text, each piece translated as far as
    the text so far decides it; joined, exactly ``json.dumps(parse_arguments(whole), ensure_ascii=False)``. The input is
    trusted to be well-formed (grammar-held); text it cannot read stops it (:attr:`broken`)."""

    def __init__(self):
        self.rest = ""  # text read but not yet translated
        self.stack: list[str] = []  # the open containers: "{" or "["
        self.key_next = False  # in an object, where a key (not a value) comes next
        self.in_string = False
        self.broken = False
        self.sent: list[str] = []  # every piece returned, for the caller's final check

    def feed(self, text: str) -> str:
        """The JSON text ``text`` (appended to what came before) decides; "" if none yet."""
        if self.broken:
            return ""
        self.rest += text
        out: list[str] = []
        try:
            while self.rest and self._step(out):
                pass
        except ValueError:
            self.broken = True
        piece = "".join(out)
        if piece:
            self.sent.append(piece)
        return piece

    def _step(self, out: list[str]) -> bool:
        """Translate what the start of ``rest`` decides; False when it must wait for more text."""
        if self.in_string:
            end = self.rest.find(QUOTE)
            if end < 0:
                cut = len(self.rest) - _held(self.rest, QUOTE)
                out.append(_escaped(self.rest[:cut]))
                self.rest = self.rest[cut:]
                return False
            out.append(_escaped(self.rest[:end]) + '"')
            self.rest, self.in_string = self.rest[end + len(QUOTE) :], False
            self.key_next = False  # a value ended
            return True
        c = self.rest[0]
        if c.isspace():
            self.rest = self.rest[1:]
            return True
        if self.rest.startswith(QUOTE):
            out.append('"')
            self.rest, self.in_string = self.rest[len(QUOTE) :], True
            return True
        if QUOTE.startswith(self.rest):  # a mark's first characters: wait
            return False
        if c in "{[":
            self.stack.append(c)
            self.key_next = c == "{"
            out.append(c)
        elif c in "}]":
            if not self.stack or "{[".index(self.stack.pop()) != "}]".index(c):
                raise ValueError(c)
            out.append(c)
            self.key_next = False  # a value ended
        elif c == ",":
            self.key_next = self.stack[-1:] == ["{"]
            out.append(", ")
        elif c == ":":
            self.key_next = False
            out.append(": ")
        else:
            return self._bare(out)
        self.rest = self.rest[1:]
        return True

    def _bare(self, out: list[str]) -> bool:
        """A bare key, number or word: translated once the character after it has come."""
        end = next((i for i, ch in enumerate(self.rest) if ch in _ENDS or ch.isspace() or ch == "<"), -1)
        if end < 0:
            return False
        word, self.rest = self.rest[:end], self.rest[end:]
        if self.key_next:
            out.append(json.dumps(word, ensure_ascii=False))
            return True
        if word in _WORDS:
            out.append(json.dumps(_WORDS[word]))
        elif _NUMBER.fullmatch(word):
            out.append(json.dumps(json.loads(word)))  # as json.dumps writes the parsed number: 2.5e1 -> 25.0
        else:
            raise ValueError(word)
        self.key_next = False  # a value ended
        return True


def _escaped(text: str) -> str:
    """``text`` as it stands inside a JSON string (json.dumps escapes character by character)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]
