"""The HTTP front against what a client may send (issue 43, point 4), on the tiny pair, colocated.

A client that leaves a non-streamed request frees its session; a lone surrogate or a 400-digit
number in any field is a 400 naming it (a fuzz over every parameter finds no 500); an error quotes
a client's value bounded; every OpenAI parameter is honoured, refused naming it, or accepted as
harmless (:data:`OPENAI`, checked against ``http_params.PARAMS`` and against the server); a model is
retrieved by id; slow headers and bodies are cut off; the bearer scheme matches in any case.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import socket
import time
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kakeya.orchestrator.assembly import build_local_engine
from kakeya.orchestrator.fronts import http_params
from kakeya.orchestrator.fronts.grpc_server import GenerationServicer
from kakeya.orchestrator.fronts.http_params import HARMLESS, HONOURED, REFUSED
from kakeya.orchestrator.fronts.http_server import HttpFront
from kakeya.runtime.bounds import HttpTimeouts
from kakeya.runtime.security.auth import authorized, bearer_ok

from ..fuzz_shapes import (
    CHOICES,
    GRAMMARS,
    HUGE,
    JSON,
    KEYS,
    NAMES,
    NASTY,
    NUMBERS,
    OBJECT_SCHEMAS,
    PLAIN,
    REGEXES,
    SCHEMAS,
    STRINGS,
    TEXT,
    VALUES,
    mostly,
)  # fmt: skip

TOKEN = "s3cret-token-for-tests"
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
BASE = {COMPLETIONS: {"prompt": [2, 40, 41, 42], "max_tokens": 2},
        CHAT: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}  # fmt: skip


@pytest.fixture(scope="module")
def front(tiny_pair):
    servicer = GenerationServicer(
        lambda: build_local_engine(str(tiny_pair.target), str(tiny_pair.draft), "mlx"),
        colocated=True, auth_token=TOKEN,
    )  # fmt: skip
    servicer.load()
    servicer.ready = True
    http = HttpFront(servicer, 0, "tiny")
    port = http.start("127.0.0.1")
    yield servicer, port
    http.drain()
    http.join(5)


def _wait(predicate, timeout: float, what: str) -> None:
    """Poll ``predicate`` (observable server state) until true, or fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


class Client:
    """Requests to the front, each on a connection of its own (closed once its answer is read)."""

    def __init__(self, port: int, auth: str | None = f"Bearer {TOKEN}"):
        self.port, self.auth = port, auth

    def call(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        headers = {"content-type": "application/json"} | ({"authorization": self.auth} if self.auth else {})
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            conn.request(method, path, body, headers)
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()

    def post(self, path: str, body) -> tuple[int, dict | bytes]:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        status, data = self.call("POST", path, raw)
        return status, _json_or_raw(data)

    def get(self, path: str) -> tuple[int, dict | bytes]:
        status, data = self.call("GET", path)
        return status, _json_or_raw(data)


def _json_or_raw(data: bytes):
    try:
        return json.loads(data)
    except ValueError:
        return data  # a stream's events


def _refusal(answer) -> str | None:
    """The parameter an OpenAI error names (asserting the error's shape)."""
    assert set(answer["error"]) == {"message", "type", "param", "code"}, answer
    return answer["error"]["param"]


def _aborted(servicer) -> float:
    sample = {"finished_reason": "abort"}
    return servicer.metrics.registry.get_sample_value("kakeya_request_success_total", sample) or 0


def _errors(servicer, code: str) -> float:
    return servicer.metrics.registry.get_sample_value("kakeya_errors_total", {"code": code}) or 0


# --------------------------------------------------------------------------- 1. a client that leaves


def _open_request(port: int, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    head = (f"POST {COMPLETIONS} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {TOKEN}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n")  # fmt: skip
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(head.encode() + data)
    return sock


def test_clients_that_leave_whole_answers_free_their_sessions(front):
    """Three non-streamed requests whose clients closed their sockets used to run to max_tokens and keep
    --max-sessions 3 full; now each run is cancelled (finish reason abort) and its session freed."""
    servicer, port = front
    _wait(lambda: servicer.active == 0, 60, "earlier runs to end")
    limit, servicer.max_sessions = servicer.max_sessions, 3
    before = _aborted(servicer)
    long = {"prompt": [2] + list(range(100, 140)), "max_tokens": 4000, "ignore_eos": True}
    try:
        socks = [_open_request(port, long) for _ in range(3)]
        _wait(lambda: servicer.active == 3, 60, "three generations in flight")
        status, answer = Client(port).post(COMPLETIONS, BASE[COMPLETIONS])
        assert status == 429, answer  # full, as the issue measured
        for sock in socks:
            sock.close()
        _wait(lambda: servicer.active == 0, 30, "the abandoned generations to end")
        assert _aborted(servicer) == before + 3  # cancelled, not run to their 4000 tokens
        status, answer = Client(port).post(COMPLETIONS, BASE[COMPLETIONS])
        assert status == 200 and answer["usage"]["completion_tokens"] == 2
    finally:
        servicer.max_sessions = limit


def test_a_client_that_leaves_a_whole_answer_is_counted_cancelled_as_over_grpc(front):
    """A client that gives up on a non-streamed request (the ``openai`` SDK's ``timeout``) was counted in
    ``kakeya_errors_total{code="UNAVAILABLE"}``, the code of a server that cannot serve (loading, draining):
    a dashboard read client timeouts as an outage. gRPC counts a caller's cancel as CANCELLED; so does HTTP now."""
    servicer, port = front
    _wait(lambda: servicer.active == 0, 60, "earlier runs to end")
    before = {code: _errors(servicer, code) for code in ("CANCELLED", "UNAVAILABLE")}
    sock = _open_request(port, {"prompt": [2] + list(range(100, 140)), "max_tokens": 4000, "ignore_eos": True})
    _wait(lambda: servicer.active == 1, 60, "the generation to start")
    sock.close()
    _wait(lambda: servicer.active == 0, 30, "the abandoned generation to end")
    _wait(lambda: sum(_errors(servicer, code) for code in before) > sum(before.values()), 30, "its error's count")
    assert {code: _errors(servicer, code) for code in before} == before | {"CANCELLED": before["CANCELLED"] + 1}


def test_clients_that_leave_the_queue_free_their_places_at_once(front):
    """With ``--queue``, two agents whose requests waited for room gave up (the ``openai`` SDK's timeout): their
    requests kept their places in the queue (``kakeya_num_requests_waiting`` 2, a third client 429 with a
    --queue 2) until room freed, then each opened its sessions and prefilled before it was cancelled. Now a queued
    request whose client leaves goes at once, and never runs; it is counted a caller's cancel (CANCELLED, as over
    gRPC), not ``kakeya_errors_total{code="INTERNAL"}``: the server's own faults, which page an operator."""
    servicer, port = front
    _wait(lambda: servicer.active == 0, 60, "earlier runs to end")
    limits = servicer.max_sessions, servicer.queue, servicer.queue_timeout_s
    servicer.max_sessions, servicer.queue, servicer.queue_timeout_s = 1, 2, 600
    long = _open_request(port, {"prompt": [2] + list(range(100, 140)), "max_tokens": 2000, "ignore_eos": True})
    try:
        _wait(lambda: servicer.active == 1, 60, "the long generation to start")
        admitted, aborted = servicer.total, _aborted(servicer)
        internal, cancelled = _errors(servicer, "INTERNAL"), _errors(servicer, "CANCELLED")
        queued = [_open_request(port, BASE[COMPLETIONS]) for _ in range(2)]
        _wait(lambda: len(servicer._waiting) == 2, 60, "two requests in the queue")
        for sock in queued:
            sock.close()
        _wait(lambda: not servicer._waiting, 60, "the queue to empty")
        assert (servicer.total, _aborted(servicer)) == (admitted, aborted)  # neither ran
        assert servicer.active == 1  # the long one goes on: the queue emptied without room being made
        counts = lambda: (_errors(servicer, "INTERNAL"), _errors(servicer, "CANCELLED"))
        _wait(lambda: sum(counts()) == internal + cancelled + 2, 60, "the two requests' answers")
        assert counts() == (internal, cancelled + 2)
    finally:
        long.close()
        servicer.max_sessions, servicer.queue, servicer.queue_timeout_s = limits
        _wait(lambda: servicer.active == 0, 60, "the long generation to end")


# --------------------------------------------------------------------------- 2. invalid Unicode, huge numbers


SURROGATE = "\ud800"


@pytest.mark.parametrize(
    "path,field,value",
    [
        (COMPLETIONS, "prompt", SURROGATE),
        (COMPLETIONS, "prompt", ["a" + SURROGATE]),
        (COMPLETIONS, "model", SURROGATE),
        (COMPLETIONS, "stop", ["x", "\udfff"]),
        (COMPLETIONS, "request_id", SURROGATE),
        (COMPLETIONS, "user", SURROGATE),
        (CHAT, "messages", [{"role": "user", "content": "a" + SURROGATE}]),
        (CHAT, "messages", [{"role": SURROGATE, "content": "a"}]),
        (CHAT, "messages", [{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}]),
        (CHAT, "response_format", {"type": SURROGATE}),
        (CHAT, "metadata", {SURROGATE: "x"}),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_its_field(front, path, field, value):
    status, answer = Client(front[1]).post(path, BASE[path] | {field: value})
    assert status == 400 and _refusal(answer) == field, answer
    assert "surrogate" in answer["error"]["message"]


@pytest.mark.parametrize(
    "field", ["temperature", "top_p", "min_p", "max_tokens", "seed", "top_k", "block_size", "presence_penalty", "n"]
)
def test_a_number_of_400_digits_is_a_400_naming_its_field(front, field):
    for path in (COMPLETIONS, CHAT):
        for value in (HUGE, -HUGE):
            status, answer = Client(front[1]).post(path, BASE[path] | {field: value})
            assert status == 400 and _refusal(answer) == field, answer
            assert len(answer["error"]["message"]) < 200  # the number is quoted, not echoed


@pytest.mark.parametrize(
    "field, value, allowed",
    [("temperature", -1, ">= 0"), ("max_tokens", 0, ">= 1"), ("top_k", -2, ">= -1"), ("seed", -1, ">= 0"),
     ("seed", 2**64, f"< {2**64}")],
)  # fmt: skip
def test_a_number_out_of_range_is_refused_saying_the_bound_it_crossed(front, field, value, allowed):
    """A client told only "-1 is out of range" cannot tell what to send instead: the refusal says the bound."""
    for path in (COMPLETIONS, CHAT):
        status, answer = Client(front[1]).post(path, BASE[path] | {field: value})
        assert status == 400 and _refusal(answer) == field, answer
        assert answer["error"]["message"] == f"{field}: {value} is out of range (must be {allowed})", answer


MESSAGES = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]) | STRINGS, "content": JSON}),
    min_size=1,
    max_size=2,
)
FUNCTIONS = st.fixed_dictionaries(
    {"name": NAMES},
    optional={"description": TEXT, "parameters": mostly(OBJECT_SCHEMAS, PLAIN), "strict": mostly(st.booleans(), PLAIN)},
)
TOOLS = st.lists(
    mostly(st.fixed_dictionaries({"type": st.just("function"), "function": FUNCTIONS}),
           st.fixed_dictionaries({"type": TEXT, "function": FUNCTIONS | PLAIN})),
    min_size=1, max_size=2,
)  # fmt: skip
TOOL_CHOICES = mostly(
    st.sampled_from(["auto", "none", "required"])
    | st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries({"name": NAMES})}),
    PLAIN,
)
ARGUMENTS = mostly(st.builds(json.dumps, st.dictionaries(KEYS, VALUES, max_size=2)), STRINGS | JSON)
CALLS = st.lists(
    mostly(
        st.fixed_dictionaries({"id": st.just("call_1"), "type": st.just("function"),
                               "function": st.fixed_dictionaries({"name": NAMES, "arguments": ARGUMENTS})}),
        st.fixed_dictionaries({"id": PLAIN, "type": PLAIN, "function": PLAIN}),
    ),
    max_size=2,
)  # fmt: skip
TURNS = st.lists(  # a conversation with calls and their results
    st.fixed_dictionaries({"role": st.just("user"), "content": TEXT})
    | st.fixed_dictionaries({"role": st.just("assistant"), "content": st.none() | TEXT, "tool_calls": CALLS})
    | st.fixed_dictionaries(
        {"role": st.just("tool"), "content": mostly(TEXT, PLAIN)},
        optional={"tool_call_id": mostly(st.just("call_1"), PLAIN), "name": mostly(NAMES, PLAIN)},
    ),
    min_size=1,
    max_size=3,
)
JSON_SCHEMA_FORMATS = st.fixed_dictionaries(
    {"type": st.just("json_schema")},
    optional={"json_schema": mostly(st.fixed_dictionaries({"name": TEXT}, optional={
        "schema": mostly(SCHEMAS, PLAIN), "strict": mostly(st.booleans(), PLAIN)}), PLAIN)},
)  # fmt: skip
STRUCTURED = mostly(
    st.one_of(*(st.fixed_dictionaries({k: v}) for k, v in [
        ("json", SCHEMAS | st.builds(json.dumps, SCHEMAS)), ("regex", REGEXES), ("choice", CHOICES),
        ("grammar", GRAMMARS), ("json_object", st.just(True))])),
    st.fixed_dictionaries({}, optional={"json": PLAIN, "regex": REGEXES, "json_object": PLAIN, "other": PLAIN}),
)  # fmt: skip
FIELD_VALUES = {  # shapes near the valid ones, so the fuzz reaches past the first type check
    "messages": MESSAGES | TURNS,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": JSON, "include_obfuscation": JSON}),
    "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"]) | STRINGS})
    | JSON_SCHEMA_FORMATS,
    "stop": st.lists(STRINGS, max_size=3),
    "prompt": st.lists(NUMBERS | NASTY, min_size=1, max_size=3),
    "tools": mostly(TOOLS, PLAIN),
    "tool_choice": TOOL_CHOICES,
    "logprobs": mostly(st.just(True) | st.integers(0, 5), st.booleans() | st.integers(-1, 25)),
    "top_logprobs": mostly(st.integers(0, 20), st.integers(-1, 25)),
    "structured_outputs": STRUCTURED,
    "guided_json": SCHEMAS | st.builds(json.dumps, SCHEMAS),
    "guided_regex": REGEXES,
    "guided_choice": CHOICES,
    "guided_grammar": GRAMMARS,
}
ALL_FIELDS = sorted(http_params.PARAMS) + ["unknown_field"]


@st.composite
def bodies(draw):
    path = draw(st.sampled_from([COMPLETIONS, CHAT]))
    fields = draw(st.lists(st.sampled_from(ALL_FIELDS), min_size=1, max_size=3, unique=True))
    body = dict(BASE[path])
    for name in fields:
        body[name] = draw(NASTY | FIELD_VALUES.get(name, JSON) | JSON)  # a third of them nasty at the top
    return path, body


@pytest.fixture
def short_max_tokens(front):
    """At most 4 tokens (2 by default) while the fuzz runs, so that no example generates for long."""
    servicer, _ = front
    limits = servicer.limits
    servicer.limits = replace(limits, default_max_tokens=2, max_tokens_limit=4)
    yield
    servicer.limits = limits


def _answered_well(path: str, body: dict, status: int, answer) -> None:
    """A 200 (a stream ends with [DONE] and no error event) or a 4xx in OpenAI's error shape whose ``param`` is
    a parameter of this API (or one the client sent), its message spelling the field as the client sent it."""
    assert status < 500, (body, answer)
    if status >= 400:
        param = _refusal(answer)
        if param is not None:
            root = param.split(".")[0].split("[")[0]
            api = http_params.CHAT if path == CHAT else http_params.COMPLETIONS
            known = http_params.PARAMS.get(root)
            assert root in body or (known and known.api in (api, http_params.BOTH)), (body, answer)
            assert status == 404 or answer["error"]["message"].startswith(param), (body, answer)
    elif isinstance(answer, bytes):  # a stream: it ends well, no event an error (a token's text may say "error")
        assert answer.endswith(b"data: [DONE]\n\n"), answer
        events = [json.loads(e[6:]) for e in answer.split(b"\n\n") if e.startswith(b"data: {")]
        assert events and not any("error" in e for e in events), answer


FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.mark.usefixtures("short_max_tokens")
@settings(FUZZ, max_examples=400)
@given(case=bodies())
def test_fuzzed_fields_never_get_a_500(front, case):
    """Every parameter of both APIs (http_params.PARAMS, and an unknown one) with JSON values, lone
    surrogates and 400-digit numbers among them: a 200 (a stream without an error event) or a 4xx in
    OpenAI's error shape, never a 500."""
    path, body = case
    _answered_well(path, body, *Client(front[1]).post(path, body))


CONSTRAINTS = ["response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
               "guided_grammar"]  # fmt: skip


@st.composite
def structured_bodies(draw):
    """A chat with tools, a tool choice and tool turns, or a completion; a constraint, logprobs, a stream."""
    path = draw(st.sampled_from([CHAT, CHAT, COMPLETIONS]))
    body = dict(BASE[path])
    fields = ["tools", "tool_choice", "messages", "top_logprobs"] if path == CHAT else []
    fields += draw(st.lists(st.sampled_from(CONSTRAINTS[path == COMPLETIONS :]), max_size=2, unique=True))
    shapes = FIELD_VALUES | {"messages": mostly(TURNS, MESSAGES), "stream": st.booleans()}
    if path == COMPLETIONS:
        shapes["logprobs"] = mostly(st.integers(0, 5), FIELD_VALUES["logprobs"])
    else:
        shapes["logprobs"] = mostly(st.just(True), FIELD_VALUES["logprobs"])
    for name in fields + ["logprobs", "stream"]:
        if draw(st.integers(0, 7)):  # each left out one time in eight
            body[name] = draw(shapes[name])
    tools = body.get("tools")
    if path == CHAT and isinstance(tools, list) and tools and draw(st.booleans()):  # a choice that holds calls
        named = [
            t["function"].get("name") for t in tools if isinstance(t, dict) and isinstance(t.get("function"), dict)
        ]
        body["tool_choice"] = draw(st.sampled_from(
            ["required"] + [{"type": "function", "function": {"name": n}} for n in named if isinstance(n, str)]
        ))  # fmt: skip
    return path, body


@pytest.mark.usefixtures("short_max_tokens")
@settings(FUZZ, max_examples=800)
@given(case=structured_bodies())
def test_fuzzed_tools_constraints_and_logprobs_never_get_a_500(front, case):
    """Tools (strict ones, schemas the grammar or llguidance refuses, parameters not an object), tool choices
    naming unknown functions, tool turns, each constraint parameter with schemas, regexes and grammars near
    valid ones, logprobs: answered or refused naming a parameter of the API, never a 500."""
    path, body = case
    _answered_well(path, body, *Client(front[1]).post(path, body))


# --------------------------------------------------------------------------- 4. bounded quotes


@pytest.mark.parametrize(
    "path,field,value,status",
    [
        (COMPLETIONS, "model", "m" * 3_000_000, 404),
        (COMPLETIONS, "stop", ["s" * 1_000_000], 400),
        (COMPLETIONS, "logit_bias", {str(i): 1 for i in range(100_000)}, 400),
        (COMPLETIONS, "suffix", "x" * 1_000_000, 400),
        (CHAT, "messages[0].role", [{"role": "r" * 100_000, "content": "a"}], 400),
        (CHAT, "response_format", {"type": "t" * 1_000_000}, 400),
        (CHAT, "modalities", ["audio"] * 100_000, 400),
    ],
)
def test_an_error_quotes_a_huge_value_bounded(front, path, field, value, status):
    got, answer = Client(front[1]).post(path, BASE[path] | {field.split("[")[0]: value})
    assert got == status and _refusal(answer) == field, str(answer)[:500]
    assert len(answer["error"]["message"]) <= 300, answer["error"]["message"]  # named, not echoed


# --------------------------------------------------------------------------- 5. every parameter


# OpenAI's parameters (the API reference's list for each endpoint) -> what this server does with them.
OPENAI = {
    COMPLETIONS: {
        "model": HONOURED, "prompt": HONOURED, "best_of": REFUSED, "echo": REFUSED, "frequency_penalty": REFUSED,
        "logit_bias": REFUSED, "logprobs": HONOURED, "max_tokens": HONOURED, "n": REFUSED, "presence_penalty": REFUSED,
        "seed": HONOURED, "stop": HONOURED, "stream": HONOURED, "stream_options": HONOURED, "suffix": REFUSED,
        "temperature": HONOURED, "top_p": HONOURED, "user": HARMLESS,
    },
    CHAT: {
        "messages": HONOURED, "model": HONOURED, "audio": REFUSED, "frequency_penalty": REFUSED,
        "function_call": REFUSED, "functions": REFUSED, "logit_bias": REFUSED, "logprobs": HONOURED,
        "max_completion_tokens": HONOURED, "max_tokens": HONOURED, "metadata": HARMLESS, "modalities": REFUSED,
        "n": REFUSED, "parallel_tool_calls": HONOURED, "prediction": HARMLESS, "presence_penalty": REFUSED,
        "prompt_cache_key": HARMLESS, "prompt_cache_retention": HARMLESS, "reasoning_effort": REFUSED,
        "response_format": HONOURED, "safety_identifier": HARMLESS, "seed": HONOURED, "service_tier": HARMLESS,
        "stop": HONOURED, "store": HARMLESS, "stream": HONOURED, "stream_options": HONOURED, "temperature": HONOURED,
        "tool_choice": HONOURED, "tools": HONOURED, "top_logprobs": HONOURED, "top_p": HONOURED, "user": HARMLESS,
        "verbosity": REFUSED, "web_search_options": REFUSED,
    },
}  # fmt: skip
# A value asking for something each refused parameter cannot do, and one each harmless parameter may take.
ASKS = {
    "best_of": 2, "echo": True, "frequency_penalty": 0.5, "logit_bias": {"5": 10}, "n": 2,
    "presence_penalty": -1, "suffix": "end", "audio": {"voice": "alloy", "format": "wav"},
    "function_call": "auto", "functions": [{"name": "f"}], "modalities": ["text", "audio"], "reasoning_effort": "low",
    "verbosity": "low", "web_search_options": {},
}  # fmt: skip
HARMLESS_VALUES = {
    "user": "u-1", "metadata": {"k": "v"}, "store": True,
    "prediction": {"type": "content", "content": "x"}, "prompt_cache_key": "k", "prompt_cache_retention": "24h",
    "safety_identifier": "s", "service_tier": "auto",
}  # fmt: skip


def test_the_table_covers_every_openai_parameter():
    for path, table in OPENAI.items():
        api = http_params.CHAT if path == CHAT else http_params.COMPLETIONS
        for name, kind in table.items():
            param = http_params.PARAMS[name]
            assert param.kind == kind and param.api in (api, http_params.BOTH), (path, name, param)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_each_parameter_is_honoured_refused_or_harmless(front, path):
    client = Client(front[1])
    for name, kind in OPENAI[path].items():
        if kind == REFUSED:
            status, answer = client.post(path, BASE[path] | {name: ASKS[name]})
            assert status == 400 and _refusal(answer) == name, (name, answer)
            status, answer = client.post(path, BASE[path] | {name: None})  # asks for nothing: accepted
            assert status == 200, (name, answer)
        elif kind == HARMLESS:
            status, answer = client.post(path, BASE[path] | {name: HARMLESS_VALUES[name]})
            assert status == 200, (name, answer)
            status, answer = client.post(path, BASE[path] | {name: 12})  # its type is still checked
            assert status == 400 and _refusal(answer) == name, (name, answer)
    for name, value in [
        ("modalities", ["text"]), ("response_format", {"type": "text"}), ("n", 1), ("logprobs", False),
        ("parallel_tool_calls", True), ("parallel_tool_calls", False),
    ]:  # fmt: skip
        if name in OPENAI[path]:
            status, answer = client.post(path, BASE[path] | {name: value})
            assert status == 200, (name, answer)  # the value that asks for nothing more


def test_refusals_the_issue_names(front):
    client = Client(front[1])
    for name, value in [("modalities", ["audio"]), ("response_format.json_schema.schema", {"type": "json_schema",
                        "json_schema": {}}), ("audio", {"voice": "x"}), ("logit_bias", {"1": -100})]:  # fmt: skip
        status, answer = client.post(CHAT, BASE[CHAT] | {name.split(".")[0]: value})
        assert status == 400 and _refusal(answer) == name, answer
    status, answer = client.post(COMPLETIONS, BASE[COMPLETIONS] | {"messages": [{"role": "user", "content": "x"}]})
    assert status == 400 and _refusal(answer) == "messages" and CHAT in answer["error"]["message"], answer
    status, answer = client.post(COMPLETIONS, BASE[COMPLETIONS] | {"max_completion_tokens": 3})
    assert status == 400 and _refusal(answer) == "max_completion_tokens", answer


def test_unknown_parameters_are_ignored(front):
    """As the front always did (and vLLM does): a vendor's field this server does not know changes nothing."""
    status, answer = Client(front[1]).post(COMPLETIONS, BASE[COMPLETIONS] | {"x_vendor_hint": {"a": 1}})
    assert status == 200 and answer["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("name", ["add_special_tokens", "return_tokens_as_token_ids"])
def test_vllm_parameters_that_change_the_output_are_honoured_or_refused(front, name):
    """vLLM's /v1/completions takes ``add_special_tokens`` (false: no BOS before the prompt) and
    ``return_tokens_as_token_ids`` (with logprobs, each token as "token_id:N"); a client that sends one gets it
    or a 400 naming it, never the same answer as without it."""
    client = Client(front[1])
    body = {"prompt": "def add(a, b):", "max_tokens": 2, "temperature": 0, "logprobs": 0}
    status, plain = client.post(COMPLETIONS, body)
    assert status == 200, plain
    status, answer = client.post(COMPLETIONS, body | {name: name == "return_tokens_as_token_ids"})
    if status == 400:
        assert _refusal(answer) == name
        return
    assert status == 200, answer
    if name == "add_special_tokens":  # the prompt without its BOS
        assert answer["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] - 1, answer["usage"]
    else:
        tokens = answer["choices"][0]["logprobs"]["tokens"]
        assert tokens == [f"token_id:{t}" for t in answer["kakeya"]["token_ids"]], tokens


@pytest.mark.parametrize(
    ("path", "name", "neutral", "changing"),
    [(COMPLETIONS, "add_special_tokens", True, False), (CHAT, "add_special_tokens", False, True),
     (COMPLETIONS, "return_tokens_as_token_ids", False, True),
     (CHAT, "repetition_detection", None, {"max_pattern_size": 4, "min_count": 3}),
     (CHAT, "documents", [], [{"title": "a", "text": "b"}])],
)  # fmt: skip
def test_vllm_parameters_are_taken_at_their_default_and_refused_by_name_otherwise(front, path, name, neutral, changing):
    """vLLM's defaults differ by endpoint: ``add_special_tokens`` is true for completions (the tokenizer's BOS)
    and false for chat (the template writes it), which is what this server does; any other value is a 400 naming
    the parameter, never the same answer as without it."""
    client = Client(front[1])
    status, answer = client.post(path, BASE[path] | {name: neutral})
    assert status == 200, answer
    status, answer = client.post(path, BASE[path] | {name: changing})
    assert status == 400 and _refusal(answer) == name, answer


def test_a_request_within_max_model_len_is_not_refused_for_its_length(front):
    """vLLM's ``max_model_len`` (which clients read to fit a conversation) is what prompt + output may hold: a
    prompt of fewer tokens than it, with max_tokens 1, must not be refused for its length."""
    servicer, port = front
    client = Client(port)
    status, listed = client.get("/v1/models")
    assert status == 200
    limit = listed["data"][0]["max_model_len"]
    n = min(limit - 1, servicer.limits.max_prompt_tokens + 1)
    status, answer = client.post(COMPLETIONS, {"prompt": [2] + [40] * (n - 1), "max_tokens": 1})
    assert status == 200, (limit, n, answer)


def test_a_prompt_over_the_limit_is_openais_context_length_exceeded(front):
    """OpenAI answers a prompt longer than the model takes with ``code: context_length_exceeded``, which agent
    frameworks read to trim a conversation and retry; langchain-openai raises its ``ContextOverflowError`` on that
    code or on a message saying "prompt is too long" (with the openai SDK 3.x, whose error text is the message alone,
    only the latter). The code was ``invalid_value``: an agent's history outgrowing the server was any other error."""
    from langchain_core.exceptions import ContextOverflowError
    from langchain_openai import ChatOpenAI

    servicer, port = front
    over = servicer.limits.max_prompt_tokens + 1
    status, answer = Client(port).post(COMPLETIONS, {"prompt": [2] + [40] * over, "max_tokens": 1})
    assert status == 400 and (_refusal(answer), answer["error"]["code"]) == ("prompt", "context_length_exceeded")
    llm = ChatOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=TOKEN, model="tiny", max_tokens=1, max_retries=0)
    with pytest.raises(ContextOverflowError) as caught:
        llm.invoke("hi " * over)
    assert (caught.value.status_code, caught.value.param) == (400, "messages")


def test_a_conversation_near_the_context_end_without_max_tokens_is_not_refused_for_it(front, monkeypatch):
    """A chat app that leaves ``max_tokens`` out (OpenAI's chat then runs to the context's end) sent a history
    within ``max_model_len`` but less than the default 128 tokens short of it, and got a 400 naming ``max_tokens``,
    a field it never sent: the default must shrink to the room the context leaves, as vLLM's does. A prompt that
    leaves no room is too long: ``context_length_exceeded`` naming the prompt. A ``max_tokens`` sent is held."""
    servicer, port = front
    context = 64
    monkeypatch.setattr(servicer, "limits", replace(servicer.limits, max_context=context, max_prompt_tokens=context))
    client = Client(port)
    assert client.get("/v1/models")[1]["data"][0]["max_model_len"] == context
    status, answer = client.post(COMPLETIONS, {"prompt": [2] + [40] * (context - 4)})
    assert status == 200 and answer["usage"]["completion_tokens"] <= 4, answer
    messages = [{"role": "user", "content": "hi"}]
    while True:  # a conversation grown turn by turn up to the limit: every turn answered or refused for its length
        status, answer = client.post(CHAT, {"messages": messages})
        if status != 200:
            break
        assert answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"] <= context, answer
        messages += [answer["choices"][0]["message"], {"role": "user", "content": "hi"}]
    assert (status, _refusal(answer), answer["error"]["code"]) == (400, "messages", "context_length_exceeded"), answer
    status, answer = client.post(COMPLETIONS, {"prompt": [2] + [40] * (context - 1)})
    assert (status, _refusal(answer), answer["error"]["code"]) == (400, "prompt", "context_length_exceeded"), answer
    status, answer = client.post(COMPLETIONS, {"prompt": [2] + [40] * (context - 4), "max_tokens": 5})
    assert status == 400 and _refusal(answer) == "max_tokens", answer


def test_a_prompt_over_the_context_is_refused_naming_the_limit_that_held_it(front, monkeypatch):
    """A server whose context (a verifier's --max-context, or the model's) is below its --max-prompt-tokens refused
    a longer prompt saying it exceeded ``--max-prompt-tokens``, a limit its operator never set that low."""
    servicer, port = front
    monkeypatch.setattr(servicer, "limits", replace(servicer.limits, max_context=64, max_prompt_tokens=64))
    status, answer = Client(port).post(COMPLETIONS, {"prompt": [2] + [40] * 64, "max_tokens": 1})
    assert (status, _refusal(answer), answer["error"]["code"]) == (400, "prompt", "context_length_exceeded"), answer
    assert "--max-prompt-tokens" not in answer["error"]["message"] and "context" in answer["error"]["message"], answer
    assert servicer.max_prompt_tokens_flag == 0  # the flag left at its default, 8192: the context held the prompt


def test_a_prompt_that_fills_the_context_is_refused_naming_the_prompt(front, monkeypatch):
    """A prompt of as many tokens as the context leaves no room for any output: no ``max_tokens`` could fit, so the
    refusal names the prompt (it named ``max_tokens``, which the client could not lower below 1 to fit)."""
    servicer, port = front
    monkeypatch.setattr(servicer, "limits", replace(servicer.limits, max_context=64, max_prompt_tokens=64))
    for extra in ({}, {"max_tokens": 1}):
        status, answer = Client(port).post(COMPLETIONS, {"prompt": [2] + [40] * 63} | extra)
        assert (status, _refusal(answer), answer["error"]["code"]) == (400, "prompt", "context_length_exceeded"), answer


def test_a_prompt_refused_by_its_characters_is_context_length_exceeded_too(front, monkeypatch):
    """A text far beyond the token limit is refused before it is tokenized (over 64 characters a token): that is the
    same refusal as a prompt counted too long, ``context_length_exceeded`` saying "the prompt is too long", which
    langchain-openai raises as ``ContextOverflowError`` so that an agent trims its history; it was ``invalid_value``
    ("N characters, far beyond ..."), so a chat that pasted a huge document failed as any other error."""
    from langchain_core.exceptions import ContextOverflowError
    from langchain_openai import ChatOpenAI

    servicer, port = front
    monkeypatch.setattr(servicer, "limits", replace(servicer.limits, max_context=64, max_prompt_tokens=64))
    huge = "x" * (64 * 64 + 1)
    for path, body, field in [
        (COMPLETIONS, {"prompt": huge}, "prompt"),
        (CHAT, {"messages": [{"role": "user", "content": huge}]}, "messages"),
    ]:
        status, answer = Client(port).post(path, body | {"max_tokens": 1})
        assert (status, _refusal(answer), answer["error"]["code"]) == (400, field, "context_length_exceeded"), answer
        assert "the prompt is too long" in answer["error"]["message"], answer
    llm = ChatOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=TOKEN, model="tiny", max_tokens=1, max_retries=0)
    with pytest.raises(ContextOverflowError):
        llm.invoke(huge)


def test_a_history_that_leaves_max_tokens_no_room_is_context_length_exceeded(front, monkeypatch):
    """A chat app that sends the same ``max_tokens`` every turn sees its history outgrow the context as prompt +
    max_tokens exceeding it, not as the prompt alone. OpenAI answers that with ``context_length_exceeded`` too (its
    "maximum context length ... in the messages, ... in the completion"), which langchain-openai raises as
    ``ContextOverflowError`` so that an agent trims its history; it was ``invalid_value``: any other error."""
    from langchain_core.exceptions import ContextOverflowError
    from langchain_openai import ChatOpenAI

    servicer, port = front
    context = 64
    monkeypatch.setattr(servicer, "limits", replace(servicer.limits, max_context=context, max_prompt_tokens=context))
    messages = [{"role": "user", "content": "hi"}]
    status, answer = Client(port).post(CHAT, {"messages": messages, "max_tokens": 1})
    assert status == 200 and answer["usage"]["prompt_tokens"] < context - 1, answer
    status, answer = Client(port).post(CHAT, {"messages": messages, "max_tokens": context - 1})
    assert (status, _refusal(answer), answer["error"]["code"]) == (400, "max_tokens", "context_length_exceeded"), answer
    llm = ChatOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=TOKEN, model="tiny", max_tokens=60, max_retries=0)
    with pytest.raises(ContextOverflowError):
        llm.invoke("hi " * 8)


@pytest.mark.parametrize("model", [None, 5, ["tiny"]])
def test_a_model_that_is_not_a_string_is_a_400_naming_it(front, model):
    """OpenAI's ``model`` is a string; null may stand for "unset" (the served model, as when it is left out)."""
    status, answer = Client(front[1]).post(COMPLETIONS, BASE[COMPLETIONS] | {"model": model})
    if model is None:  # as every optional field sent null here: the served model
        assert status == 200 and answer["model"] == Client(front[1]).get("/v1/models")[1]["data"][0]["id"], answer
        return
    assert status == 400 and _refusal(answer) == "model", answer
    assert "None" not in answer["error"]["message"], answer


def test_stream_options_are_honoured(front):
    client = Client(front[1])
    stream = BASE[CHAT] | {"stream": True}
    events = [
        json.loads(line[6:]) for line in client.post(CHAT, stream)[1].split(b"\n\n") if line[6:] not in (b"", b"[DONE]")
    ]
    assert "usage" not in events[-1] and all("obfuscation" not in e for e in events)
    options = {"include_usage": True, "include_obfuscation": True}
    answer = client.post(CHAT, stream | {"stream_options": options})[1]
    events = [json.loads(line[6:]) for line in answer.split(b"\n\n") if line[6:] not in (b"", b"[DONE]")]
    assert events[-1]["usage"]["completion_tokens"] == 2 and all(e["obfuscation"] for e in events)
    status, answer = client.post(CHAT, stream | {"stream_options": {"include_usage": "yes"}})
    assert status == 400 and _refusal(answer) == "stream_options.include_usage"
    # strict, as vLLM: without "stream", or with an option it does not know (misspelt), refused by name
    for body, says in [
        (BASE[CHAT] | {"stream_options": {"include_usage": True}}, 'only with "stream": true'),
        (BASE[COMPLETIONS] | {"stream": False, "stream_options": {"include_usage": True}}, 'only with "stream": true'),
        (stream | {"stream_options": {"include_usage": True, "include_usgae": True}}, "unknown option 'include_usgae'"),
    ]:
        status, answer = client.post(CHAT if "messages" in body else COMPLETIONS, body)
        assert status == 400 and _refusal(answer) == "stream_options" and says in answer["error"]["message"], answer
    for empty in (None, {}):  # asks for nothing: as absent
        assert client.post(CHAT, BASE[CHAT] | {"stream_options": empty})[0] == 200


def test_request_id_is_honoured(front):
    status, answer = Client(front[1]).post(COMPLETIONS, BASE[COMPLETIONS] | {"request_id": "has space"})
    assert status == 400 and _refusal(answer) == "request_id", answer


# --------------------------------------------------------------------------- 6. retrieve a model


def test_a_model_is_retrieved_by_id(front):
    client = Client(front[1])
    status, answer = client.get("/v1/models/tiny")
    assert status == 200 and answer["id"] == "tiny" and answer["object"] == "model"
    status, answer = client.get("/v1/models/other")
    assert status == 404 and _refusal(answer) == "model" and answer["error"]["code"] == "model_not_found"
    assert Client(front[1], auth=None).get("/v1/models/tiny")[0] == 401


# --------------------------------------------------------------------------- 7. slow clients


@contextlib.contextmanager
def _front_with(servicer, timeouts: HttpTimeouts):
    http = HttpFront(servicer, 0, "tiny", timeouts=timeouts)
    try:
        yield http.start("127.0.0.1")
    finally:
        http.drain()
        http.join(5)


def _closed_within(sock: socket.socket, timeout: float) -> tuple[float, bytes]:
    """Seconds until the server closes ``sock`` (then closed here too), and what it sent before."""
    sock.settimeout(timeout)
    t0, got = time.monotonic(), b""
    try:
        while chunk := sock.recv(4096):
            got += chunk
    finally:
        sock.close()
    return time.monotonic() - t0, got


def test_slow_headers_and_bodies_are_cut_off(front):
    servicer, _ = front
    with _front_with(servicer, HttpTimeouts(headers_s=0.5, body_s=0.5, keep_alive_s=0.5)) as port:
        silent = socket.create_connection(("127.0.0.1", port))
        partial = socket.create_connection(("127.0.0.1", port))
        partial.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bear")
        for sock in (silent, partial):
            took, got = _closed_within(sock, 10)
            assert took < 5 and got == b"", (took, got)  # closed, not left open forever
        slow_body = socket.create_connection(("127.0.0.1", port))
        slow_body.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer " + TOKEN.encode()
                          + b"\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"pro")  # fmt: skip
        took, got = _closed_within(slow_body, 10)
        assert took < 5 and got.startswith(b"HTTP/1.1 408"), got
        # A request whose headers came in time is not cut off however long its generation; the next
        # request's headers on that keep-alive connection are bounded as the first's were.
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        body = json.dumps({"prompt": [2, 40], "max_tokens": 200, "ignore_eos": True})
        conn.request("POST", COMPLETIONS, body, {"authorization": f"Bearer {TOKEN}"})
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["usage"]["completion_tokens"] == 200
        conn.sock.sendall(b"GET /v1/models HTTP/1.1\r\nhost:")
        took, got = _closed_within(conn.sock, 10)
        conn.close()
        assert took < 5 and got == b"", (took, got)


# --------------------------------------------------------------------------- 8. the bearer scheme


def test_the_bearer_scheme_matches_in_any_case(front):
    for header in (f"Bearer {TOKEN}", f"bearer {TOKEN}", f"BEARER {TOKEN}"):
        assert bearer_ok(header, TOKEN)
        assert Client(front[1], auth=header).get("/v1/models")[0] == 200
    for header in (f"Bearer {TOKEN.upper()}", f"Basic {TOKEN}", f"Bearer{TOKEN}", TOKEN, "", f"Bearer  {TOKEN}"):
        assert not bearer_ok(header, TOKEN)
        assert Client(front[1], auth=header or None).get("/v1/models")[0] == 401

    class Context:  # a gRPC call's metadata, as guard.py checks it
        def invocation_metadata(self):
            return (("authorization", f"bearer {TOKEN}"),)

        def send_initial_metadata(self, metadata):  # grpc's: Generate sends the request id in it
            self.sent_metadata = metadata

        set_trailing_metadata = send_initial_metadata  # and in its trailers

    assert authorized(Context(), TOKEN)


UNIQUE = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}


@pytest.mark.parametrize(
    "extra, param, code",
    [
        ({"max_tokens": -1}, "max_tokens", "invalid_value"),
        ({"n": 2}, "n", "invalid_value"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "u", "schema": UNIQUE}}},
         "response_format.json_schema.schema", "invalid_value"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "u", "schema": {}, "strict": 1}}},
         "response_format.json_schema.strict", "invalid_value"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": UNIQUE}}], "tool_choice": "required"},
         "tools[0].function.parameters", "invalid_function_parameters"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name", "invalid_value"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         "messages[0].content[0]", "invalid_value"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text"}]}]},
         "messages[0].content[1].text", "invalid_value"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "invalid_value"),
    ],
)  # fmt: skip
def test_the_sdk_reads_the_field_and_a_code_from_a_400(front, extra, param, code):
    """What the ``openai`` SDK raises (``BadRequestError``: ``.param``, ``.code``, ``.type``) names the field as
    OpenAI names one -- inside a list too (``tools[0].function.parameters``, ``messages[0].content``), not only the
    top parameter -- with OpenAI's code (``invalid_function_parameters`` for a tool's schema, else ``invalid_value``)."""
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{front[1]}/v1", api_key=TOKEN, max_retries=0)
    body = {"model": "tiny", "messages": BASE[CHAT]["messages"], "max_tokens": 2} | extra
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**body)
    assert (err.value.param, err.value.code, err.value.type) == (param, code, "invalid_request_error"), err.value
    assert f"{param}: " in err.value.message, err.value  # the message leads with the same field


# --------------------------------------------------------------------------- 9. an app migrating from vLLM or OpenAI


def test_a_messages_name_reaches_the_template_and_is_type_checked(front):
    """OpenAI's messages may carry a participant's ``name`` (vLLM hands it to the template, which may render it): it
    is the template's to use, never dropped on the way; one that is not a string is a 400 naming it."""
    from kakeya.orchestrator.fronts import http_api
    from kakeya.orchestrator.text import template_inputs

    messages = [{"role": "system", "content": "s", "name": "rules"}, {"role": "user", "content": "hi", "name": "bob"}]
    chat = http_api.chat_request({"messages": messages}, "tiny")[0].prompt
    assert [m.get("name") for m in template_inputs(chat)[0]] == ["rules", "bob"]
    status, answer = Client(front[1]).post(
        CHAT, BASE[CHAT] | {"messages": [{"role": "user", "content": "hi", "name": 5}]}
    )
    assert status == 400 and _refusal(answer) == "messages[0].name", answer


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    ],
)
def test_a_part_that_is_not_text_is_refused_naming_its_type(part):
    """A chat app that attaches an image (or audio) to a turn hears which part and which type this text model
    refuses, not only that text parts are taken: the 400 names ``messages[i].content[j]`` and the part's type."""
    from kakeya.orchestrator.fronts import http_api

    messages = [{"role": "user", "content": "hi"}, {"role": "user", "content": [{"type": "text", "text": "x"}, part]}]
    with pytest.raises(http_api.ApiError) as err:
        http_api.chat_request({"messages": messages}, "tiny")
    assert err.value.param == "messages[1].content[1]"
    assert repr(part["type"]) in err.value.message and "not supported" in err.value.message, err.value.message


def test_max_tokens_beside_a_different_max_completion_tokens_is_refused(front):
    """OpenAI refuses the two together (``param`` max_tokens); one of two different limits must not be dropped
    silently. The same limit sent under both names (clients that fill in both) is that limit."""
    client = Client(front[1])
    status, answer = client.post(CHAT, BASE[CHAT] | {"max_tokens": 5, "max_completion_tokens": 3})
    assert status == 400 and _refusal(answer) == "max_tokens" and "max_completion_tokens" in answer["error"]["message"]
    status, answer = client.post(CHAT, BASE[CHAT] | {"max_tokens": 3, "max_completion_tokens": 3, "ignore_eos": True})
    assert status == 200 and answer["usage"]["completion_tokens"] == 3, answer


def test_vllms_prefill_flags_are_taken_as_vllm_takes_them(front):
    """vLLM's prefill is ``continue_final_message: true`` with ``add_generation_prompt: false`` (both true is its 400:
    the final message is continued, no new turn opened); alone, ``add_generation_prompt: false`` is refused here."""
    client = Client(front[1])
    prefill = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "He"}],
               "max_tokens": 3, "temperature": 0, "continue_final_message": True}  # fmt: skip
    status, plain = client.post(CHAT, prefill)
    assert status == 200, plain
    status, answer = client.post(CHAT, prefill | {"add_generation_prompt": False})
    assert status == 200 and answer["kakeya"]["token_ids"] == plain["kakeya"]["token_ids"], answer
    status, answer = client.post(CHAT, prefill | {"add_generation_prompt": True})
    assert status == 400 and _refusal(answer) == "add_generation_prompt", answer
    status, answer = client.post(CHAT, BASE[CHAT] | {"add_generation_prompt": False})
    assert status == 400 and _refusal(answer) == "add_generation_prompt", answer


def test_a_wrong_method_is_counted_as_unimplemented_not_internal(front):
    """An operator alerting on ``kakeya_errors_total{code="INTERNAL"}`` (the server's own faults) was paged by a
    client that GETs a POST route: the 405 fell through the HTTP->gRPC table to INTERNAL. gRPC answers a method
    a service lacks with UNIMPLEMENTED, so that is its code."""
    servicer, port = front
    internal, unimplemented = _errors(servicer, "INTERNAL"), _errors(servicer, "UNIMPLEMENTED")
    assert Client(port).get(CHAT)[0] == 405
    assert (_errors(servicer, "INTERNAL"), _errors(servicer, "UNIMPLEMENTED")) == (internal, unimplemented + 1)


LEGACY_CALL = {"name": "add", "arguments": "{}"}


@pytest.mark.parametrize("content", ["let me add", None])
def test_a_messages_legacy_function_call_is_refused_by_its_name(front, content):
    """A history written for OpenAI's deprecated function calling (an assistant's ``function_call``): with text
    beside it the call was silently dropped from the conversation the model saw; with ``content`` null the 400
    blamed ``messages[1].content``. The call is refused by its name, as the top-level ``functions`` is."""
    history = [
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": content, "function_call": LEGACY_CALL},
    ]
    status, answer = Client(front[1]).post(CHAT, BASE[CHAT] | {"messages": history})
    assert status == 400 and _refusal(answer) == "messages[1].function_call", answer
    assert "tool_calls" in answer["error"]["message"], answer  # what to send instead


def test_a_wrong_method_is_a_405_naming_the_allowed_one(front):
    """RFC 9110: a 405 carries ``Allow``; the body is OpenAI's error shape."""
    conn = http.client.HTTPConnection("127.0.0.1", front[1], timeout=60)
    try:
        conn.request("GET", CHAT, headers={"authorization": f"Bearer {TOKEN}"})
        r = conn.getresponse()
        body = json.loads(r.read())
    finally:
        conn.close()
    assert r.status == 405 and r.getheader("allow") == "POST" and _refusal(body) is None, (r.getheaders(), body)


def test_a_stop_token_ids_text_is_not_in_the_answer(front):
    """vLLM ends a generation at a ``stop_token_ids`` token without its text (unless include_stop_str_in_output,
    refused here), as a stop string's: the token is counted and listed, its text is not in the answer."""
    client = Client(front[1])
    greedy = BASE[COMPLETIONS] | {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    ids = client.post(COMPLETIONS, greedy)[1]["kakeya"]["token_ids"]
    i = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])  # its first time
    before, through = (
        client.post(COMPLETIONS, greedy | {"max_tokens": n})[1]["choices"][0]["text"] for n in (i, i + 1)
    )
    assert before != through  # the stop token has a text of its own
    for stream in (False, True):
        status, answer = client.post(COMPLETIONS, greedy | {"stop_token_ids": [ids[i]], "stream": stream})
        assert status == 200, answer
        if stream:
            events = [json.loads(e[6:]) for e in answer.split(b"\n\n") if e[6:] not in (b"", b"[DONE]")]
            text, last = "".join(e["choices"][0]["text"] for e in events), events[-1]["choices"][0]
        else:
            text, last = answer["choices"][0]["text"], answer["choices"][0]
        assert (text, last["finish_reason"]) == (before, "stop"), answer


@pytest.mark.parametrize("request_id", [0, False, [], {}])
def test_a_request_id_that_is_not_a_string_is_refused_whatever_its_value(front, request_id):
    status, answer = Client(front[1]).post(COMPLETIONS, BASE[COMPLETIONS] | {"request_id": request_id})
    assert status == 400 and _refusal(answer) == "request_id", answer


FALSY = [("stop", 0), ("stop", False), ("stop_token_ids", 0), ("stream_options", False), ("stream_options", [])]


@pytest.mark.parametrize("field, value", FALSY + [("messages[0].name", 0), ("messages[0].name", False)])
def test_a_falsy_value_of_the_wrong_type_is_refused_as_any_other(front, field, value):
    """``"stop": 0`` is no string nor list, as ``"stop": 1`` is not: a 400 naming it, never the field left out."""
    if field.startswith("messages"):
        body = BASE[CHAT] | {"messages": [{"role": "user", "content": "hi", "name": value}]}
    else:
        body = BASE[CHAT] | {field: value, "stream": field == "stream_options"}
    status, answer = Client(front[1]).post(CHAT, body)
    assert status == 400 and _refusal(answer) == field, answer


@pytest.mark.parametrize(
    ("path", "name", "neutral", "changing"),
    [(CHAT, "guided_whitespace_pattern", None, "[ ]?"), (CHAT, "logits_processors", None, ["pkg.Processor"]),
     (COMPLETIONS, "prompt_embeds", None, "AAAAAA=="), (CHAT, "return_token_ids", False, True),
     (COMPLETIONS, "spaces_between_special_tokens", True, False), (CHAT, "structural_tag", None, "{}")],
)  # fmt: skip
def test_more_vllm_parameters_that_change_the_answer_are_refused_by_name(front, path, name, neutral, changing):
    """vLLM's whitespace of guided JSON, custom logits processors, prompt embeddings, the token ids in the answer,
    the spacing of special tokens and its structural tags each change what comes back: taken at the value that asks
    for nothing, refused by name otherwise -- never ignored as an unknown name is."""
    client = Client(front[1])
    status, answer = client.post(path, BASE[path] | {name: neutral})
    assert status == 200, answer
    status, answer = client.post(path, BASE[path] | {name: changing})
    assert status == 400 and _refusal(answer) == name, answer


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p"])
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_a_float_that_is_not_finite_is_a_400_naming_its_field(front, field, value):
    """Python's JSON reads NaN and Infinity: the sampling checks every front shares refuse them by name."""
    body = json.dumps(BASE[COMPLETIONS])[:-1].encode() + f', "{field}": {value}}}'.encode()
    status, answer = Client(front[1]).post(COMPLETIONS, body)
    assert status == 400 and _refusal(answer) == field, answer


def test_vllms_completions_take_response_format_and_its_chat_echo_false(front):
    """vLLM's /v1/completions takes ``response_format`` (as its chat does); its chat takes ``echo`` (false: nothing
    asked, true: the last message repeated, refused here by name)."""
    client = Client(front[1])
    schema = {
        "type": "object",
        "properties": {"b": {"type": "boolean"}},
        "required": ["b"],
        "additionalProperties": False,
    }
    rf = {"type": "json_schema", "json_schema": {"name": "b", "schema": schema}}
    status, answer = client.post(COMPLETIONS, BASE[COMPLETIONS] | {"max_tokens": 20, "response_format": rf})
    assert status == 200 and answer["choices"][0]["finish_reason"] == "stop", answer
    assert isinstance(json.loads(answer["choices"][0]["text"])["b"], bool), answer
    assert client.post(CHAT, BASE[CHAT] | {"echo": False})[0] == 200
    status, answer = client.post(CHAT, BASE[CHAT] | {"echo": True})
    assert status == 400 and _refusal(answer) == "echo" and "/v1/completions" not in answer["error"]["message"], answer


# --------------------------------------------------------------------------- 10. a hostile or sloppy HTTP client


def _raw(port: int, data: bytes) -> bytes:
    """What the front answers to ``data`` sent as is on a connection of its own (read until it closes)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(data)
        got = b""
        while chunk := sock.recv(65536):
            got += chunk
    return got


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_the_http_servers_own_lines_go_to_the_processs_log(front):
    """Any client could make an orchestrator run with ``--log-format json`` write a plain-text line
    (``WARNING:  Invalid HTTP request received.``) into the JSON stream an operator's pipeline parses: uvicorn logged
    through handlers of its own, not the process's. Its lines reach the root handler ``logs.setup_logging`` sets."""
    root = logging.getLogger()
    handler = _Records()
    root.addHandler(handler)  # (the autouse _root_log_handlers puts the root's handlers back)
    answer = _raw(front[1], b"NOT HTTP\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 400"), answer
    assert any(r.name.startswith("uvicorn") and "Invalid HTTP" in r.getMessage() for r in handler.records), answer


@pytest.mark.parametrize("path", [CHAT + "/", COMPLETIONS + "/", "/health/"])
def test_a_trailing_slash_is_a_404_not_a_redirect_to_the_host_header(front, path):
    """``POST /v1/chat/completions/`` was a 307 with an empty body to ``http://<the Host header>/v1/chat/completions``:
    behind a proxy that sets Host to the upstream, the client was sent to the server's internal address."""
    head = f"POST {path} HTTP/1.1\r\nhost: orchestrator.internal:8000\r\nauthorization: Bearer {TOKEN}\r\n"
    answer = _raw(front[1], head.encode() + b"content-length: 2\r\nconnection: close\r\n\r\n{}")
    status, _, rest = answer.partition(b"\r\n")
    assert status == b"HTTP/1.1 404 Not Found" and b"internal" not in answer, answer
    assert _refusal(json.loads(rest.partition(b"\r\n\r\n")[2])) is None, answer


@pytest.mark.parametrize(
    "body, key",
    [(b'{"prompt": [2, 40], "max_tokens": 2, "max_tokens": 3}', "max_tokens"),
     (b'{"prompt": [2, 40], "temperature": 0, "max_tokens": 2, "temperature": 1}', "temperature")],
)  # fmt: skip
def test_a_key_sent_twice_is_refused_naming_it(front, body, key):
    """A body with one key twice ran with the last value, the other lost without a word (which did the client
    mean?): a 400 naming the key, as a value the server cannot take is."""
    status, answer = Client(front[1]).post(COMPLETIONS, body)
    assert status == 400 and _refusal(answer) == key and "twice" in answer["error"]["message"], answer
    nested = b'{"messages": [{"role": "user", "content": "a", "content": "b"}], "max_tokens": 2}'
    status, answer = Client(front[1]).post(CHAT, nested)
    assert status == 400 and answer["error"]["message"].startswith("content: sent twice"), answer


def test_a_compressed_body_is_a_415_naming_content_encoding(front):
    """A client that gzips its body (RFC 7694's ``Content-Encoding``) heard that its JSON had a bad UTF-8 byte:
    the server takes no content coding, and says so by the header's name (415, as RFC 7694 answers)."""
    import gzip

    raw, internal = json.dumps(BASE[COMPLETIONS]).encode(), _errors(front[0], "INTERNAL")
    for coding, body in (("gzip", gzip.compress(raw)), ("br", raw)):
        conn = http.client.HTTPConnection("127.0.0.1", front[1], timeout=60)
        headers = {"authorization": f"Bearer {TOKEN}", "content-type": "application/json", "content-encoding": coding}
        try:
            conn.request("POST", COMPLETIONS, body, headers)
            r = conn.getresponse()
            answer = json.loads(r.read())
        finally:
            conn.close()
        assert r.status == 415 and "Content-Encoding" in answer["error"]["message"], answer
    assert _errors(front[0], "INTERNAL") == internal  # counted as a client's mistake
    assert Client(front[1]).post(COMPLETIONS, BASE[COMPLETIONS])[0] == 200


@pytest.mark.parametrize("after_another", [False, True])
def test_a_request_framed_by_both_headers_ends_its_connection(front, after_another):
    """A request with both ``Transfer-Encoding: chunked`` and ``Content-Length`` (a request smuggling attempt: a proxy
    that frames by the length sees another request in the chunks) was answered, then the connection served the next
    request on it. RFC 9112 6.3: the server MUST close the connection after answering it -- pipelined too."""
    body = json.dumps(BASE[COMPLETIONS]).encode()
    head = (
        f"POST {COMPLETIONS} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {TOKEN}\r\ncontent-type: application/json\r\n"
    )
    plain = f"{head}content-length: {len(body)}\r\n\r\n".encode() + body
    both = f"{head}transfer-encoding: chunked\r\ncontent-length: 5\r\n\r\n{len(body):x}\r\n".encode() + body
    answer = _raw(
        front[1], (plain if after_another else b"") + both + b"\r\n0\r\n\r\nGET /health HTTP/1.1\r\nhost: x\r\n\r\n"
    )
    assert answer.count(b"HTTP/1.1 200 OK") == 1 + after_another and b'{"status":"ok"}' not in answer, answer


@pytest.mark.parametrize("target", ["http://x/v1/completions", "https://api.example:443/v1/completions"])
def test_an_absolute_form_target_is_served_as_its_path(front, target):
    """``POST http://host/v1/completions HTTP/1.1`` (the form a client sends a proxy: one whose proxy setting names
    this server) was a 404 Not Found. RFC 9112 3.2.2: a server MUST accept the absolute form."""
    body = json.dumps(BASE[COMPLETIONS]).encode()
    head = f"POST {target} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {TOKEN}\r\nconnection: close\r\n"
    answer = _raw(front[1], f"{head}content-length: {len(body)}\r\n\r\n".encode() + body)
    assert answer.startswith(b"HTTP/1.1 200 OK") and b'"text_completion"' in answer, answer
    assert Client(front[1]).get("/v1/models/http://x")[0] == 404  # a model id may hold a scheme-like part


@pytest.mark.parametrize("length", ["-5", "abc", "99999999999999999999999"])
def test_a_request_that_is_not_http_gets_openais_error_shape(front, length):
    """A Content-Length that is no length was answered ``400 Invalid HTTP request received.`` in text/plain: every
    answer of the front, this one too, is OpenAI's error shape (the ``openai`` SDK reads its message from it)."""
    head = (
        f"POST {COMPLETIONS} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {TOKEN}\r\ncontent-length: {length}\r\n\r\n"
    )
    status, _, rest = _raw(front[1], head.encode() + b"{}").partition(b"\r\n")
    assert status == b"HTTP/1.1 400 Bad Request", status
    assert _refusal(json.loads(rest.partition(b"\r\n\r\n")[2])) is None, rest
