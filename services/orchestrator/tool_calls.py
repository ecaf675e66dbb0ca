"""The model's tool calls, in Gemma-4's syntax, read out of its text into OpenAI's ``tool_calls``.

A call is ``<|tool_call>call:NAME{ARGS}<tool_call|>`` (what Gemma-4's chat template writes for an assistant's
``tool_calls`` and the model writes back; ``checkpoints/chat_template.py`` renders the demo pair's the same way):
ARGS are ``key:value`` pairs, keys bare (or quoted), strings between ``<|"|>`` marks, numbers, ``true``,
``false``, ``null`` (or ``None``, as Gemma-4's template writes it), objects ``{...}`` and lists ``[...]`` as in JSON. :func:`parse_arguments` turns ARGS into
the JSON object OpenAI's ``function.arguments`` carries; a call that does not parse stays in the text, as the
model wrote it (it is content, not a call this server could hand a client).

:class:`CallStream` reads the text as it streams, whatever a block commits: text before a call streams as
content, a call comes out once its end marker has arrived, and a block's tail that may be the start of a
marker (``<|tool``) is held back until the next block says what it is.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from kakeya.core.request import ToolCall

CALL_START, CALL_END, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
RESULT_START = "<|tool_response>"  # where the model stops to wait for a call's results
# The markers a tokenizer may hold as special tokens (Gemma-4's does): they stay in the decoded text.
MARKERS = (CALL_START, CALL_END, QUOTE, RESULT_START, "<tool_response|>")
NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
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


@dataclass
class CallStream:
    """Streamed text -> events: content (``str``) and whole calls (:class:`ToolCall`), in the text's order."""

    buffer: str = ""
    in_call: bool = False
    calls: int = 0

    def feed(self, text: str) -> list:
        self.buffer += text
        out: list = []
        while True:
            if not self.in_call:
                at = self.buffer.find(CALL_START)
                if at < 0:
                    cut = len(self.buffer) - _held(self.buffer, CALL_START)
                    self._content(out, self.buffer[:cut])
                    self.buffer = self.buffer[cut:]
                    return out
                self._content(out, self.buffer[:at])
                self.buffer, self.in_call = self.buffer[at + len(CALL_START) :], True
            else:
                at = self.buffer.find(CALL_END)
                if at < 0:
                    return out
                body, self.buffer, self.in_call = self.buffer[:at], self.buffer[at + len(CALL_END) :], False
                call = parse_call(body)
                if call is None:
                    self._content(out, CALL_START + body + CALL_END)
                else:
                    self.calls += 1
                    out.append(call)

    def end(self) -> list:
        """What the text's end leaves: a held-back tail, or an unfinished call, as content."""
        rest = (CALL_START if self.in_call else "") + self.buffer
        self.buffer, self.in_call = "", False
        out: list = []
        self._content(out, rest)
        return out

    @staticmethod
    def _content(out: list, text: str) -> None:
        if text:
            out.append(text)
