"""Process logging: plain text or JSON lines, each line tagged with the request it serves.

The request id travels from the public API (``GenerateRequest.request_id``, or one the orchestrator makes up) to the
verifier and drafter as ``x-request-id`` gRPC metadata. Each server binds it (and the session id) to the handling
thread's context for the length of the RPC (:func:`bind`), and a logging filter copies them onto every record, so
every line a request causes, in any of the three processes, carries the same id.
"""

from __future__ import annotations

import contextvars
import datetime as _dt
import json
import logging
import os
import sys
from contextlib import suppress

_context: contextvars.ContextVar[dict] = contextvars.ContextVar(
    "kakeya_log_context",
    default={},  # noqa: B039 - never mutated: bind() sets a new dict
)
_FIELDS = ("request_id", "session_id")


def bind(**fields: str) -> contextvars.Token:
    """Add ``fields`` (request_id, session_id) to this thread's log context; returns a reset token."""
    return _context.set(_context.get() | {k: v for k, v in fields.items() if v})


def reset(token: contextvars.Token) -> None:
    with suppress(ValueError):  # a generator finalised on another thread: that thread's context is not ours
        _context.reset(token)


class ContextFilter(logging.Filter):
    """Copies the bound request/session ids onto each record ("" when none)."""

    def filter(self, record: logging.LogRecord) -> bool:
        ctx = _context.get()
        for name in _FIELDS:
            if not getattr(record, name, ""):
                setattr(record, name, ctx.get(name, ""))
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, process, pid, request_id, session_id (+ exc)."""

    def __init__(self, process: str):
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        ts = _dt.datetime.fromtimestamp(record.created, _dt.UTC).isoformat(timespec="milliseconds")
        out = {"ts": ts, "level": record.levelname, "logger": record.name, "msg": record.getMessage(),
               "process": self.process, "pid": record.process}  # fmt: skip
        out |= {name: value for name in _FIELDS if (value := getattr(record, name, ""))}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """The classic line, with ``[request_id=... session_id=...]`` appended when bound."""

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        tags = " ".join(f"{n}={getattr(record, n)}" for n in _FIELDS if getattr(record, n, ""))
        return f"{line} [{tags}]" if tags else line


def setup_logging(process: str, fmt: str = "text") -> None:
    """Log to stderr in ``fmt`` ("text" or "json") at $KAKEYA_LOG_LEVEL (default INFO)."""
    if (level := os.environ.get("KAKEYA_LOG_LEVEL", "INFO").upper()) not in logging.getLevelNamesMapping():
        raise ValueError(f"KAKEYA_LOG_LEVEL must be DEBUG, INFO, WARNING, ERROR or CRITICAL, got {level!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(ContextFilter())
    if fmt == "json":
        handler.setFormatter(JsonFormatter(process))
    else:
        handler.setFormatter(TextFormatter(f"%(asctime)s kakeya-{process}[%(process)d] %(levelname)s %(message)s"))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level)
