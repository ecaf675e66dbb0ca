"""JSON carried inside a request's strings: a tool call's arguments, a gRPC tool's ``parameters_json``, a
schema constraint's text. Parsed as the HTTP front parses a body, refusing what it refuses there: text that
is not JSON, nesting beyond what the parser can follow, and a lone surrogate (JSON's ``\\ud800`` escape,
which ASCII text may carry), which no tokenizer, chat template or grammar compiler takes.
"""

from __future__ import annotations

import json


def valid_unicode(value) -> bool:
    """Whether every string of a JSON value (keys too) is valid Unicode: no lone surrogate."""
    try:
        json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return False
    return True


def loads(text: str):
    """The value ``text`` holds, or ValueError saying why it holds none this server takes."""
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
