"""Text <-> token ids with the checkpoint's own tokenizer.json (the ``tokenizers`` library, no model
framework); streamed text cut at stop strings."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer

from kakeya.orchestrator.chat import ChatError, ChatTemplate
from kakeya.orchestrator.tools.calls import MARKERS


class TextCodec:
    def __init__(self, checkpoint_dir: str | Path):
        path = Path(checkpoint_dir)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{path}: no tokenizer.json")
        self.tokenizer = Tokenizer.from_file(str(tok_file))
        cfg_file = path / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        self.add_bos = bool(cfg.get("add_bos_token", True))
        bos = cfg.get("bos_token")
        if isinstance(bos, dict):
            bos = bos.get("content")
        self.bos_id = self.tokenizer.token_to_id(bos) if bos else None
        self.chat = ChatTemplate.load(path)  # None: the checkpoint ships no chat template
        # Special tokens are skipped in the text, but for tool-call markers (Gemma-4's ``<|tool_call>`` ...):
        # the front reads calls out of the text (``tools/calls.py``), as vLLM keeps them for its tool parsers.
        special = {i: t.content for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.special}
        kept = {i for i, content in special.items() if content in MARKERS}
        self.hidden = frozenset(special) - kept if kept else None  # None: skip every special token

    @functools.cached_property
    def tokenizer_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` text: what a constraint is compiled against (``core/constraints.py``)."""
        return self.tokenizer.to_str()

    def encode_chat(self, messages, **options) -> list[int]:
        """The prompt ids of a conversation: rendered by the checkpoint's chat template (``chat.py``), then
        tokenized without adding special tokens (the template writes its own), as transformers does."""
        if self.chat is None:
            raise ChatError(
                "messages: this model's checkpoint ships no chat template (chat_template.jinja or"
                " tokenizer_config.json's chat_template); send a text or token prompt"
            )
        return self.tokenizer.encode(self.chat.render(messages, **options), add_special_tokens=False).ids

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        if self.hidden is None:
            return self.tokenizer.decode(list(ids), skip_special_tokens=True)
        return self.tokenizer.decode([i for i in ids if i not in self.hidden], skip_special_tokens=False)

    def token(self, token_id: int) -> tuple[str, bytes]:
        """One token as logprobs name it: its text alone (special tokens by name; a token holding part of a
        character decodes to U+FFFD) and its exact bytes (a byte-fallback piece ``<0xE2>``, a byte-level
        BPE piece mapped back through GPT-2's byte alphabet, else the text's UTF-8)."""
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        piece = self.tokenizer.id_to_token(token_id) or ""
        if _BYTE_PIECE.fullmatch(piece):
            return text, bytes([int(piece[3:5], 16)])
        if self._byte_level and all(c in _UNBYTE for c in piece) and not self._special(token_id):
            return text, bytes(_UNBYTE[c] for c in piece)
        return text, text.encode()

    @functools.cached_property
    def _byte_level(self) -> bool:
        """Whether pieces are spelled in GPT-2's byte alphabet (the decoder, or one of a sequence, is ByteLevel)."""
        decoder = self.tokenizer.decoder  # its own JSON, not the whole tokenizer's (a 262k vocabulary)
        return decoder is not None and b'"ByteLevel"' in decoder.__getstate__()

    def _special(self, token_id: int) -> bool:
        return self.tokenizer.decode([token_id], skip_special_tokens=True) == ""


def _gpt2_bytes() -> dict[str, int]:
    """GPT-2's byte -> printable character table (what byte-level BPE pieces are spelled in), inverted."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_UNBYTE = _gpt2_bytes()
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class StreamDecoder:
    """Turns token chunks into text chunks without splitting multi-byte characters; only a short trailing
    window is re-decoded per chunk, so a long stream costs O(chunk) per block."""

    def __init__(self, codec: TextCodec):
        self.codec = codec
        self.ids: list[int] = []
        self.prefix = 0  # window start: ids[prefix:read] are already emitted
        self.read = 0

    def add(self, ids: Sequence[int]) -> str:
        self.ids.extend(ids)
        done = self.codec.decode(self.ids[self.prefix : self.read])
        text = self.codec.decode(self.ids[self.prefix :])
        if text.endswith("\ufffd") or len(text) <= len(done):  # an incomplete UTF-8 sequence: wait
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(done) :]

    def flush(self) -> str:
        done = self.codec.decode(self.ids[self.prefix : self.read])
        text = self.codec.decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return text[len(done) :]


class StopStrings:
    """Cuts streamed text at the first stop string (not part of the output; the token that completed it is the
    last id sent), holding back text that may still become one."""

    def __init__(self, codec: TextCodec, stops: Sequence[str]):
        self.codec, self.stops = codec, tuple(stops)
        self.hold = max(len(s) for s in self.stops) - 1
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded text already streamed
        self.searched = 0  # characters already searched for stop strings
        self.stopped = False

    def _find(self, text: str) -> int:
        start = max(0, self.searched - self.hold)
        hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        return min(hits) if hits else -1

    def add(self, tokens: Sequence[int]) -> tuple[list[int], str, bool]:
        """Return (token ids to send, text to send, stop string hit)."""
        base = len(self.ids)
        self.ids.extend(tokens)
        text = self.codec.decode(self.ids)
        if self._find(text) >= 0:  # find the token that completed it
            del self.ids[base:]
            for i, tok in enumerate(tokens):
                self.ids.append(tok)
                text = self.codec.decode(self.ids)
                at = self._find(text)
                if at >= 0:
                    out = text[self.sent : at] if at > self.sent else ""
                    self.sent, self.stopped = max(self.sent, at), True
                    return list(tokens[: i + 1]), out, True
        self.searched = len(text)
        safe = len(text) - self.hold
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for more tokens
            safe = min(safe, len(text) - 1)
        out = text[self.sent : safe] if safe > self.sent else ""
        self.sent = max(self.sent, safe)
        return list(tokens), out, False

    def flush(self) -> str:
        """The held-back text at the end (nothing after a stop string)."""
        if self.stopped:
            return ""
        text = self.codec.decode(self.ids)
        out, self.sent = text[self.sent :], len(text)
        return out


class PlainText:
    """Streamed text without stop strings (no tokenizer: no text); ``add`` and ``flush`` as :class:`StopStrings`'."""

    def __init__(self, codec: TextCodec | None):
        self.dec = StreamDecoder(codec) if codec is not None else None

    def add(self, tokens):
        return list(tokens), (self.dec.add(tokens) if self.dec else ""), False

    def flush(self) -> str:
        return self.dec.flush() if self.dec else ""


def text_stream(codec: TextCodec | None, stop_strings: Sequence[str] = ()) -> StopStrings | PlainText:
    """How a front streams a run's text: ``add(block tokens) -> (ids, text, stop string hit)``, then ``flush()``."""
    return StopStrings(codec, stop_strings) if stop_strings else PlainText(codec)
