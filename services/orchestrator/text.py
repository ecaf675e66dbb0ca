"""Text <-> token ids with the checkpoint's own tokenizer.json (the ``tokenizers`` library, no model
framework); streamed text cut at stop strings; chat messages rendered with the checkpoint's chat template.

The template is ``chat_template.jinja`` beside the tokenizer or ``chat_template`` in ``tokenizer_config.json`` (a
string, or named templates of which ``default`` is used), rendered as transformers' ``apply_chat_template`` renders it
(jinja2's sandbox, ``trim_blocks``/``lstrip_blocks``, loop controls, ``raise_exception``, ``tojson``, ``strftime_now``,
the special tokens as variables); the text is tokenized without adding special tokens (the template writes its own).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from kakeya.checkpoints.config import chat_template_source, read_json
from kakeya.checkpoints.tokenizer import read_tokenizer
from kakeya.core.constraints import load_json
from kakeya.core.request import Chat, ToolCall
from kakeya.orchestrator.tools.calls import MARKERS, NAME
from kakeya.orchestrator.tools.grammar import ToolProblem, check_tools
from kakeya.runtime.lifecycle import quote

ROLES = ("system", "developer", "user", "assistant", "tool")
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker for continue_final_message


class ChatError(ValueError):
    """A conversation the template cannot render (raise_exception, a bad message); the message says why."""


def _raise(message: str):
    raise ChatError(message)


class ChatTemplate:
    """One checkpoint's chat template, compiled once; :meth:`render` is pure (thread-safe)."""

    def __init__(self, source: str, special_tokens: dict[str, str]):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = functools.partial(json.dumps, ensure_ascii=False)  # as transformers'
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"chat template: {exc}") from None
        self.special_tokens = dict(special_tokens)

    @classmethod
    def load(cls, checkpoint_dir: str | Path) -> ChatTemplate | None:
        """The template of the tokenizer files in ``checkpoint_dir``; None when it ships none."""
        source = chat_template_source(Path(checkpoint_dir))  # chat_template.jinja or tokenizer_config.json's
        try:
            return cls(source, _special_tokens(_tokenizer_config(checkpoint_dir))) if source else None
        except ValueError as exc:  # a template that does not compile: the user's file, so its checkpoint named
            raise ValueError(f"checkpoint {checkpoint_dir}: {exc}") from None

    def render(
        self,
        messages: Sequence[dict],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """The prompt text of ``messages`` (``{"role", "content"}`` dicts): with the model's turn opened after
        them (``add_generation_prompt``), or the last (assistant) message left open to be continued."""
        check_messages(messages)
        messages = [dict(m) for m in messages]
        if continue_final_message:  # as transformers: a tag after the final content, the text cut where it lands
            if messages[-1]["role"] != "assistant":
                raise ChatError("continue_final_message: the last message must be the assistant's")
            messages[-1]["content"] += CONTINUE_TAG
            add_generation_prompt = False
        try:
            text = self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        **self.special_tokens, **kwargs)  # fmt: skip
        except ChatError:
            raise
        except jinja2.TemplateError as exc:  # the template cannot take these messages
            raise ChatError(f"chat template: {exc}") from None
        except (TypeError, ValueError, LookupError, AttributeError, RecursionError) as exc:  # nor these tools
            raise ChatError(f"chat template: {type(exc).__name__}: {exc}") from None
        if continue_final_message:
            at = text.rfind(CONTINUE_TAG.strip())
            if at < 0:
                raise ChatError("continue_final_message: the template drops the final message's content")
            text = text[:at] if text[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()
        return text


def template_inputs(chat: Chat) -> tuple[list[dict], list[dict] | None]:
    """A :class:`Chat`'s messages and tools as a chat template reads them: OpenAI's shapes, as transformers'
    ``apply_chat_template`` takes them, but for a call's arguments, given as the object its JSON text holds (as
    vLLM hands them to templates, which serialise them in the model's own call syntax)."""
    messages = []
    called: set[str] = set()  # ids of the calls made so far: a tool message answers one of them
    for i, m in enumerate(chat.messages):
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        called.update(c.id for c in m.tool_calls)
        if m.role == "tool":
            if m.tool_call_id not in called:
                raise ChatError(
                    f"messages[{i}].tool_call_id: {quote(m.tool_call_id)} answers no call of an earlier assistant"
                    " message (a tool message answers one of their tool_calls by its id)"
                )
            message["tool_call_id"] = m.tool_call_id
        elif m.tool_call_id:  # a tool message's own field: the template would never see it
            raise ChatError(f"messages[{i}].tool_call_id: only for role 'tool'")
        if m.name:  # a participant's name, a tool message's function: the template's to render (as vLLM's)
            message["name"] = m.name
        if m.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": _arguments(c, i, j)}}
                for j, c in enumerate(m.tool_calls)
            ]
        messages.append(message)
    try:
        check_tools(chat.tools)
    except ToolProblem as exc:
        raise ChatError(str(exc)) from None
    tools = [
        {"type": "function", "function": {"name": t.name, "description": t.description}
         | ({"parameters": dict(t.parameters)} if t.parameters is not None else {})}
        for t in chat.tools
    ]  # fmt: skip
    return messages, tools or None


def _arguments(call: ToolCall, i: int, j: int) -> dict:
    """A call's arguments as the object their JSON text holds (ChatError naming its field if not one, or its name)."""
    try:
        args = load_json(call.arguments)
    except ValueError as exc:
        raise ChatError(f"messages[{i}].tool_calls[{j}].arguments: {exc}") from None
    if not isinstance(args, dict):
        raise ChatError(f"messages[{i}].tool_calls[{j}].arguments: must be a JSON object's text")
    if not NAME.fullmatch(call.name):
        raise ChatError(f"messages[{i}].tool_calls[{j}].name: must be 1-64 letters, digits, '_', '.' or '-'")
    return args


def check_messages(messages: Sequence[dict]) -> None:
    """ChatError naming the first bad message: each needs a known role and a string content."""
    if not messages:
        raise ChatError("messages: at least one message is needed")
    for i, m in enumerate(messages):
        if m.get("role") not in ROLES:
            raise ChatError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {quote(m.get('role'))}")
        if not isinstance(m.get("content"), str):
            raise ChatError(f"messages[{i}].content must be a string")


def _tokenizer_config(checkpoint_dir: str | Path) -> dict:
    path = Path(checkpoint_dir) / "tokenizer_config.json"
    return read_json(path, "target") if path.is_file() else {}  # a garbled one named


def _special_tokens(cfg: dict) -> dict[str, str]:
    """The tokenizer's special tokens as the template sees them (a token may be written as a dict)."""
    toks = {name: cfg.get(name) for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
    return {name: (tok.get("content") if isinstance(tok, dict) else tok) or "" for name, tok in toks.items()}


class TextCodec:
    def __init__(self, checkpoint_dir: str | Path, model_vocab: int | None = None):
        path = Path(checkpoint_dir)
        self.tokenizer = read_tokenizer(path)
        if self.tokenizer is None:
            raise FileNotFoundError(f"{path}: no tokenizer.json")
        if model_vocab is not None and self.vocab_size > model_vocab:  # another model's: ids past the embedding
            raise ValueError(f"{path}: tokenizer.json has {self.vocab_size} tokens, vocab_size is {model_vocab}")
        cfg = _tokenizer_config(path)
        self.add_bos = bool(cfg.get("add_bos_token", True))
        bos = _special_tokens(cfg)["bos_token"]  # none named: what tokenizer.json prepends, as transformers reads it
        self.bos_id = self.tokenizer.token_to_id(bos) if bos else next(iter(self.tokenizer.encode("").ids), None)
        self.chat = ChatTemplate.load(path)  # None: the checkpoint ships no chat template
        # Special tokens are skipped in the text, but for tool-call markers (Gemma-4's ``<|tool_call>`` ...):
        # the front reads calls out of the text (``tools/calls.py``), as vLLM keeps them for its tool parsers.
        self.special = {i: t.content for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.special}
        self._quoted = [json.dumps(t)[1:-1] for t in self.special.values() if t]  # as a JSON text spells them
        kept = {i for i, content in self.special.items() if content in MARKERS}
        self.hidden = frozenset(self.special) - kept if kept else None  # None: skip every special token

    @functools.cached_property
    def tokenizer_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` text: what a constraint is compiled against (``core/constraints.py``)."""
        return self.tokenizer.to_str()

    def encode_chat(self, messages, **options) -> list[int]:
        """The prompt ids of a conversation, rendered by the chat template: its markers are special tokens, a
        message's content is text (``<end_of_turn>`` typed in it cannot end its turn, as in OpenAI's API)."""
        if self.chat is None:
            raise ChatError(
                "messages: this model's checkpoint ships no chat template (chat_template.jinja or"
                " tokenizer_config.json's chat_template); send a text or token prompt"
            )
        held = json.dumps([[m | {"content": ""} for m in messages], options.get("tools")], default=str)  # not contents
        if typed := next((t for t in self._quoted if t in held), ""):  # (checks.py names the tools where they hold it)
            raise ChatError(f"holds a special token's text ({typed}) outside a message's content")
        text = self.chat.render(messages, **options)
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids  # the whole at once, as transformers does
        marked = [m | {"content": f"\ue000{i}\ue001"} if m["content"] else m for i, m in enumerate(messages)]
        parts = re.split("\ue000([0-9]+)\ue001", self.chat.render(marked, **options))
        template = self.tokenizer.encode("".join(parts[::2]), add_special_tokens=False).ids
        if sum(t in self.special for t in ids) <= sum(t in self.special for t in template):
            return ids  # every special token is the template's (with a mark for each content)
        contents = (self.tokenizer.encode(m["content"], add_special_tokens=False).ids for m in messages)
        typed = [i for i, c in enumerate(contents) if self.special.keys() & set(c)]  # those holding a special's text
        if not typed:  # the template wrote other tokens for the marks
            return ids
        pieces = sum(zip(parts[::2], [messages[int(i)]["content"] for i in parts[1::2]] + [""]), ())
        if "".join(pieces) != text:  # the contents are not where the marks were: the template changed them
            raise ChatError(f"messages[{typed[0]}].content: holds a special token's text, and the template alters it")
        tokenizers = (self.tokenizer, self._plain)  # the template's pieces, the contents
        return [
            t for k, piece in enumerate(pieces) for t in tokenizers[k % 2].encode(piece, add_special_tokens=False).ids
        ]

    @functools.cached_property
    def _plain(self) -> Tokenizer:
        """The tokenizer reading a special token's text as text (its own copy: that is a setting of the tokenizer)."""
        plain = Tokenizer.from_str(self.tokenizer_json)
        plain.encode_special_tokens = True
        return plain

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
        if self._byte_level and all(c in _UNBYTE for c in piece) and token_id not in self.special:
            return text, bytes(_UNBYTE[c] for c in piece)
        return text, text.encode()

    @functools.cached_property
    def _byte_level(self) -> bool:
        """Whether pieces are spelled in GPT-2's byte alphabet (the decoder, or one of a sequence, is ByteLevel)."""
        decoder = self.tokenizer.decoder  # its own JSON, not the whole tokenizer's (a 262k vocabulary)
        return decoder is not None and b'"ByteLevel"' in decoder.__getstate__()


def _gpt2_bytes() -> dict[str, int]:
    """GPT-2's byte -> printable character table (what byte-level BPE pieces are spelled in), inverted."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in keep]  # the others, spelled from U+0100 on in byte order
    return {chr(b): b for b in keep} | {chr(256 + i): b for i, b in enumerate(moved)}


_UNBYTE = _gpt2_bytes()
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class StreamDecoder:
    """Streamed text without stop strings (no tokenizer: no text), ``add`` and ``flush`` as :class:`StopStrings`': no
    multi-byte character split, and only a short trailing window re-decoded per chunk (O(chunk) per block)."""

    def __init__(self, codec: TextCodec | None):
        self.codec = codec
        self.ids: list[int] = []
        self.prefix = 0  # window start: ids[prefix:read] are already emitted
        self.read = 0

    def add(self, ids: Sequence[int], final: bool = False) -> tuple[list[int], str, bool]:
        self.ids.extend(ids)
        done = self.codec.decode(self.ids[self.prefix : self.read]) if self.codec else ""
        text = self.codec.decode(self.ids[self.prefix :]) if self.codec else ""
        if not final and (text.endswith("\ufffd") or len(text) <= len(done)):  # an incomplete UTF-8 sequence: wait
            return list(ids), "", False
        self.prefix, self.read = self.read, len(self.ids)
        return list(ids), text[len(done) :], False

    def flush(self) -> str:
        return self.add((), final=True)[1]


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
        # trailing U+FFFDs may be a character whose last bytes are still to come: searched and sent again then
        self.searched = len(text.rstrip("\ufffd"))
        safe = self.searched - self.hold
        out = text[self.sent : safe] if safe > self.sent else ""
        self.sent = max(self.sent, safe)
        return list(tokens), out, False

    def flush(self) -> str:
        """The held-back text at the end (nothing after a stop string)."""
        return "" if self.stopped else self.codec.decode(self.ids)[self.sent :]


def text_stream(codec: TextCodec | None, stop_strings: Sequence[str] = ()) -> StopStrings | StreamDecoder:
    """How a front streams a run's text: ``add(block tokens) -> (ids, text, stop string hit)``, then ``flush()``."""
    return StopStrings(codec, stop_strings) if stop_strings else StreamDecoder(codec)
