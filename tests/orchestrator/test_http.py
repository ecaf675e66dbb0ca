"""The OpenAI-compatible HTTP front (``orchestrator/fronts/http_server.py`` + ``http_api.py``), colocated on the tiny pair.

The official ``openai`` client, streaming and not, completions and chat, gets
the tokens a gRPC ``Generate`` of the same request gets; a second chat turn
reports its cached prompt tokens; the bearer token is enforced; malformed
bodies get a 4xx in OpenAI's error shape, never a 500 (``test_http_front.py`` fuzzes every parameter).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import urllib.error
import urllib.request

import pytest

from kakeya.core.prefix import PrefixCache
from kakeya.orchestrator.assembly import build_local_engine
from kakeya.orchestrator.fronts.grpc_server import GenerationServicer
from kakeya.orchestrator.fronts.http_server import HttpCall, HttpFront
from kakeya.runtime.metrics import ServerMetrics
from kakeya.wire.kakeya.v1 import generate_pb2 as pb
from kakeya.wire.limits import PUBLIC_MAX_RECEIVE_BYTES

from ..waiting import wait_until

TOKEN = "s3cret"
PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def front(tiny_pair):
    prefixes = PrefixCache(1 << 28)
    servicer = GenerationServicer(
        lambda: build_local_engine(str(tiny_pair.target), str(tiny_pair.draft), "mlx", prefixes=prefixes),
        colocated=True, auth_token=TOKEN, prefixes=prefixes,
    )  # fmt: skip
    servicer.load()
    servicer.ready = True
    http = HttpFront(servicer, 0, "tiny")
    port = http.start("127.0.0.1")
    yield servicer, f"http://127.0.0.1:{port}"
    http.drain()
    http.join(5)


def _grpc_ids(servicer, req: pb.GenerateRequest) -> list[int]:
    ids = []
    for resp in servicer.Generate(req, _Context()):
        if resp.HasField("chunk"):
            ids.extend(resp.chunk.token_ids)
    return ids


def _client(base):
    from openai import OpenAI

    return OpenAI(base_url=base + "/v1", api_key=TOKEN, max_retries=0)


def _greedy(**kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(sampling_params=pb.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), **kw)


def _settle(servicer) -> None:
    """Wait for the front's runs to end (a stream its client left ends a moment later on the server)."""
    wait_until(lambda: servicer.active == 0, what="the front's runs to end")


@contextlib.contextmanager
def _stream_in_flight(servicer, base):
    """One long streamed completion from 127.0.0.1, open (its first event read) while the block runs."""
    _settle(servicer)  # an earlier test's run may still be ending on this shared front
    conn = _open_stream(base)
    try:
        yield
    finally:
        conn.close()
        _settle(servicer)


def _open_stream(base) -> http.client.HTTPConnection:
    """A long streamed completion's connection, its first event read (its generation runs); close it to end it."""
    conn = http.client.HTTPConnection(base.removeprefix("http://"), timeout=60)
    body = json.dumps({"prompt": [2] + list(range(100, 140)), "max_tokens": 4000, "ignore_eos": True, "stream": True})
    conn.request(
        "POST", "/v1/completions", body, {"authorization": f"Bearer {TOKEN}", "content-type": "application/json"}
    )
    r = conn.getresponse()
    assert r.status == 200 and r.readline().startswith(b"data: ")
    return conn


def test_openai_completions_equal_grpc(front):
    servicer, base = front
    client = _client(base)
    want = _grpc_ids(servicer, _greedy(text=PROMPT))
    extra = {"ignore_eos": True}
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, extra_body=extra)
    assert whole.model_extra["kakeya"]["token_ids"] == want
    assert whole.usage.completion_tokens == len(want) and whole.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
                                            extra_body=extra))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].model_extra["kakeya"]["token_ids"] == want


def test_openai_chat_equals_grpc_messages(front):
    servicer, base = front
    client = _client(base)
    messages = [{"role": "user", "content": "import os\n"}]
    req = _greedy()
    req.messages.messages.add(role="user", content="import os\n")
    want = _grpc_ids(servicer, req)
    extra = {"ignore_eos": True}
    whole = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=24, temperature=0,
                                           extra_body=extra)  # fmt: skip
    assert whole.model_extra["kakeya"]["token_ids"] == want
    answer = whole.choices[0].message.content
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body=extra)  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
    assert chunks[-1].usage.completion_tokens == len(want)


def test_a_second_turn_reports_its_cached_tokens(front):
    """Token-id prompts: the tiny random pair's answers need not survive a round trip through text."""
    _, base = front
    client = _client(base)
    first_prompt = [2] + list(range(100, 140))
    first = client.completions.create(model="tiny", prompt=first_prompt, max_tokens=20, temperature=0,
                                      extra_body={"ignore_eos": True})  # fmt: skip
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    answer = first.model_extra["kakeya"]["token_ids"]
    second = client.completions.create(model="tiny", prompt=first_prompt + answer + [50, 51, 52], max_tokens=8,
                                       temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    assert second.usage.prompt_tokens_details.cached_tokens == len(first_prompt) + len(answer) - 1


def _post(base, path, body: bytes, token=TOKEN) -> tuple[int, dict]:
    headers = {"content-type": "application/json"}
    if token is not None:
        headers["authorization"] = f"Bearer {token}"
    request = urllib.request.Request(base + path, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _get(base, path, token=TOKEN) -> int:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(base + path, headers=headers), timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_models_health_and_auth(front):
    _, base = front
    assert _get(base, "/health", token=None) == 200
    assert _get(base, "/v1/models") == 200 and _get(base, "/v1/models", token="wrong") == 401
    status, body = _post(base, "/v1/completions", b'{"prompt": "x"}', token=None)
    assert status == 401 and body["error"]["type"] == "authentication_error"
    assert _get(base, "/v1/nothing") == 404


@pytest.mark.parametrize(
    "path,body,status,param",
    [
        ("/v1/completions", b"not json", 400, None),
        ("/v1/completions", b"[1, 2]", 400, None),
        ("/v1/completions", b'{"prompt": 3}', 400, "prompt"),
        ("/v1/completions", b'{"prompt": "x", "model": "other"}', 404, "model"),
        ("/v1/completions", b'{"prompt": "x", "temperature": "hot"}', 400, "temperature"),
        ("/v1/completions", b'{"prompt": "x", "top_p": 0}', 400, "top_p"),
        ("/v1/completions", b'{"prompt": "x", "n": 2}', 400, "n"),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": 100000000}', 400, "max_tokens"),
        ("/v1/completions", b'{"prompt": [1, 99999999]}', 400, "prompt"),
        ("/v1/completions", b'{"prompt": "x", "stop": [1]}', 400, "stop"),
        ("/v1/chat/completions", b'{"messages": []}', 400, "messages"),
        ("/v1/chat/completions", b'{"messages": [{"content": "x"}]}', 400, "messages[0]"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
            400,
            "messages[0].content[0]",
        ),
    ],
)
def test_bad_requests_get_openai_errors(front, path, body, status, param):
    _, base = front
    got, answer = _post(base, path, body)
    assert got == status, answer
    assert set(answer["error"]) == {"message", "type", "param", "code"} and answer["error"]["param"] == param


@pytest.mark.parametrize("prompt", [[2, 5.0], [2, "a"], [[2, 5], 7]])
def test_a_token_prompt_with_a_bad_id_is_refused_for_it_not_as_a_batch(front, prompt):
    _, base = front
    got, answer = _post(base, "/v1/completions", json.dumps({"prompt": prompt}).encode())
    assert got == 400 and answer["error"]["param"] == "prompt"
    assert "token ids" in answer["error"]["message"] and "batch" not in answer["error"]["message"]


@pytest.mark.parametrize("prompt", ["\n", "    ", "\u3000"])
def test_a_prompt_of_whitespace_is_a_prompt(front, prompt):
    """Whitespace is text (a code model's newline or indentation, CJK's ideographic space): tokenized and answered,
    as vLLM and OpenAI answer it, not refused as an empty prompt."""
    _, base = front
    got, answer = _post(base, "/v1/completions", json.dumps({"prompt": prompt, "max_tokens": 2}).encode())
    assert got == 200 and answer["usage"]["prompt_tokens"] > 1, answer


@pytest.mark.parametrize(
    "stop,text", [("说", ""), ("。", "说中文"), (["😀 o", "😀"], "说中文。"), ("🏽", "说中文。😀 ok👍")]
)
def test_a_stop_string_of_characters_split_over_tokens_ends_the_answer_streamed_or_not(front, stop, text):
    """The tiny pair's BPE spells each of these characters in 2-4 tokens: the answer (forced by guided_choice) is cut
    before the first stop, also where it is its first character, streamed or not, over the official client."""
    _, base = front
    client = _client(base)
    kw = dict(model="tiny", prompt="x = ", max_tokens=40, temperature=0, stop=stop)
    kw["extra_body"] = {"guided_choice": ["说中文。😀 ok👍🏽 é̃!"]}
    whole = client.completions.create(**kw).choices[0]
    chunks = list(client.completions.create(stream=True, **kw))
    assert (whole.text, whole.finish_reason) == (text, "stop")
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_a_body_beyond_the_limit_is_413(front):
    """Refused on its declared length, before the server reads it."""
    _, base = front
    conn = http.client.HTTPConnection(base.removeprefix("http://"), timeout=30)
    conn.putrequest("POST", "/v1/completions")
    for name, value in [("authorization", f"Bearer {TOKEN}"), ("content-type", "application/json"),
                        ("content-length", str(PUBLIC_MAX_RECEIVE_BYTES + 1))]:  # fmt: skip
        conn.putheader(name, value)
    conn.endheaders()
    r = conn.getresponse()
    assert r.status == 413 and json.loads(r.read())["error"]["message"]
    conn.close()


def test_grpc_messages_are_checked_and_the_model_says_it_has_a_template(front):
    import grpc

    servicer, _ = front
    assert servicer.GetModelInfo(pb.GetModelInfoRequest(), None).has_chat_template
    req = _greedy()
    req.messages.messages.add(role="user", content="a")
    req.messages.messages.add(role="robot", content="b")
    context = _Context()
    with pytest.raises(_Aborted):
        list(servicer.Generate(req, context))
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT and "prompt.messages.messages[1].role" in context.details


def test_a_client_that_leaves_a_stream_cancels_its_run(front):
    servicer, base = front
    with _stream_in_flight(servicer, base):
        assert servicer.active == 1
    assert servicer.active == 0  # the client closed its connection: the run ended
    aborted = servicer.metrics.registry.get_sample_value("kakeya_request_success_total", {"finished_reason": "abort"})
    assert aborted == 1  # cancelled, not run to its 4000 tokens


def test_health_is_503_while_the_verifier_is_down(front):
    """A split orchestrator whose verifier fails its health checks (the health watch: its gRPC health NOT_SERVING)
    refused every completion with 503 "verifier unavailable", while GET /health answered 200 {"status": "ok"}: an
    HTTP probe or load balancer kept sending it traffic."""
    servicer, base = front
    servicer.verifier_down = True  # as the health watch sets it
    try:
        conn = http.client.HTTPConnection(base.split("//")[1], timeout=10)
        conn.request("GET", "/health")
        answer = conn.getresponse()
        assert answer.status == 503 and "verifier unavailable" in json.loads(answer.read())["error"]["message"]
        assert answer.getheader("Retry-After") is None  # a health probe's answer asks no client to retry
        conn.request(
            "POST", "/v1/completions", b'{"prompt": "x", "max_tokens": 2}', {"authorization": f"Bearer {TOKEN}"}
        )
        answer = conn.getresponse()  # a request's 503 says when to retry, as the openai SDK reads it
        assert answer.status == 503 and answer.getheader("Retry-After") == "1" and json.loads(answer.read())
    finally:
        servicer.verifier_down = False
    assert _get(base, "/health", token=None) == 200


def test_not_ready_is_503_and_a_full_server_429(front):
    servicer, base = front
    servicer.ready = False
    try:
        assert _get(base, "/health", token=None) == 503
        status, answer = _post(base, "/v1/completions", b'{"prompt": "x", "max_tokens": 2}')
        assert status == 503 and answer["error"]["type"] == "service_unavailable_error"
    finally:
        servicer.ready = True
    limit, servicer.max_sessions = servicer.max_sessions, 1  # --max-sessions 1, with one stream in flight
    try:
        with _stream_in_flight(servicer, base):
            status, answer = _post(base, "/v1/completions", b'{"prompt": "x", "max_tokens": 2}')
            assert status == 429 and answer["error"]["type"] == "rate_limit_error"
    finally:
        servicer.max_sessions = limit


def test_queue_holds_requests_over_max_sessions_until_room_and_refuses_past_it(front):
    """--max-sessions 2 --queue 8: with both slots taken, 5 more requests wait (kakeya_num_requests_waiting 5)
    and all finish once the slots free, none refused; a full queue, and a wait past --queue-timeout, are 429
    naming --queue."""
    from concurrent.futures import ThreadPoolExecutor

    servicer, base = front
    saved = servicer.max_sessions, servicer.queue, servicer.queue_timeout_s
    waiting = lambda: servicer.metrics.registry.get_sample_value("kakeya_num_requests_waiting")
    body = b'{"prompt": "def f(x):", "max_tokens": 6, "ignore_eos": true}'
    _settle(servicer)
    servicer.max_sessions, servicer.queue, servicer.queue_timeout_s = 2, 8, 120.0
    pool = ThreadPoolExecutor(5)
    held = [_open_stream(base), _open_stream(base)]
    try:
        queued = [pool.submit(_post, base, "/v1/completions", body) for _ in range(5)]
        wait_until(lambda: waiting() == 5, what="five requests queued")
        assert servicer.active == 2 and not any(f.done() for f in queued)
        for conn in held:
            conn.close()
        answers = [f.result(120) for f in queued]
        assert [status for status, _ in answers] == [200] * 5
        assert all(a["usage"]["completion_tokens"] == 6 for _, a in answers)
        assert waiting() == 0
        _settle(servicer)
        servicer.queue, servicer.queue_timeout_s = 1, 0.2
        held = [_open_stream(base), _open_stream(base)]
        status, answer = _post(base, "/v1/completions", body)  # waits 0.2 s in the queue, then refused
        assert status == 429 and "in its queue (--queue 1)" in answer["error"]["message"]
        servicer.queue_timeout_s = 120.0
        first = pool.submit(_post, base, "/v1/completions", body)
        wait_until(lambda: waiting() == 1, what="one request queued")
        status, answer = _post(base, "/v1/completions", body)  # the queue is full: refused at once
        assert (
            status == 429
            and "1 queued before it (--max-sessions), and its queue is full (--queue 1)" in answer["error"]["message"]
        )
        held.pop().close()
        assert first.result(120)[0] == 200
    finally:
        for conn in held:
            conn.close()
        pool.shutdown()
        servicer.max_sessions, servicer.queue, servicer.queue_timeout_s = saved
        _settle(servicer)


def test_a_tool_message_answering_no_earlier_call_is_refused_by_name_on_both_fronts(front):
    """A ``tool`` message's ``tool_call_id`` must name a call of an earlier assistant message: one that answers
    nothing (misspelt, or before its call) is a 400 / INVALID_ARGUMENT naming the message, and the answer to a
    real call goes through."""
    import grpc

    servicer, base = front
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    asked = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    body = {"messages": [], "max_tokens": 2}
    for messages, index in [
        (asked + [{"role": "tool", "tool_call_id": "call_2", "content": "sunny"}], 2),
        ([asked[0], {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}, asked[1]], 1),
    ]:
        status, answer = _post(base, "/v1/chat/completions", json.dumps(body | {"messages": messages}).encode())
        assert status == 400 and answer["error"]["param"] == f"messages[{index}].tool_call_id", answer
        assert answer["error"]["message"].startswith(f"messages[{index}].tool_call_id: 'call_"), answer
        req = _greedy()
        for m in messages:
            calls = [pb.ToolCall(id=c["id"], name=c["function"]["name"], arguments_json=c["function"]["arguments"])
                     for c in m.get("tool_calls", ())]  # fmt: skip
            req.messages.messages.add(role=m["role"], content=m["content"], tool_calls=calls,
                                      tool_call_id=m.get("tool_call_id", ""))  # fmt: skip
        context = _Context()
        with pytest.raises(_Aborted):
            list(servicer.Generate(req, context))
        assert context.code == grpc.StatusCode.INVALID_ARGUMENT
        assert context.details.startswith(f"prompt.messages.messages[{index}].tool_call_id: 'call_"), context.details
    answered = asked + [{"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    status, answer = _post(base, "/v1/chat/completions", json.dumps(body | {"messages": answered}).encode())
    assert status == 200, answer


def test_per_peer_cap_counts_http_and_grpc_calls_of_one_host_together(front):
    """--max-sessions-per-peer: an HTTP stream in flight from 127.0.0.1 takes that host's one slot, so a second
    HTTP request (429) and a gRPC call from the same address are refused; another host is admitted."""
    import grpc

    servicer, base = front
    limit, servicer.max_sessions_per_peer = servicer.max_sessions_per_peer, 1
    try:
        with _stream_in_flight(servicer, base):
            status, answer = _post(base, "/v1/completions", b'{"prompt": "x", "max_tokens": 2}')
            assert status == 429 and "--max-sessions-per-peer" in answer["error"]["message"]
            context = _Context("ipv4:127.0.0.1:50999")
            with pytest.raises(_Aborted):
                list(servicer.Generate(_greedy(text=PROMPT), context))
            assert context.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert len(_grpc_ids(servicer, _greedy(text=PROMPT))) == 24  # _Context(): another peer, admitted
    finally:
        servicer.max_sessions_per_peer = limit


def test_a_forwarded_for_header_is_no_other_peer(front):
    """With --max-sessions-per-peer 1 and a stream in flight from 127.0.0.1, a second request from there that said
    ``X-Forwarded-For: 10.9.8.7`` was admitted: uvicorn trusted the header from loopback (all of ``serve all``'s
    clients by default), so any client could name itself anyone and run past its cap. A peer is its address, as
    over gRPC (``auth.peer_of``: callers behind one proxy share one)."""
    servicer, base = front
    limit, servicer.max_sessions_per_peer = servicer.max_sessions_per_peer, 1
    conn = http.client.HTTPConnection(base.removeprefix("http://"), timeout=60)
    try:
        with _stream_in_flight(servicer, base):
            headers = {"authorization": f"Bearer {TOKEN}", "x-forwarded-for": "10.9.8.7"}
            conn.request("POST", "/v1/completions", b'{"prompt": "x", "max_tokens": 2}', headers)
            r = conn.getresponse()
            assert r.status == 429 and "--max-sessions-per-peer" in json.loads(r.read())["error"]["message"]
            assert r.getheader("Retry-After") == "1"  # the openai SDK's retries wait as long as it asks
    finally:
        conn.close()
        servicer.max_sessions_per_peer = limit


def test_a_full_server_refuses_a_bad_request_for_what_it_is(front):
    """A request no server can run hears INVALID_ARGUMENT naming its field (HTTP 400) while --max-sessions is
    full: not RESOURCE_EXHAUSTED (429), which clients retry as if it could succeed later."""
    import grpc

    servicer, base = front
    limit, servicer.max_sessions = servicer.max_sessions, 1
    try:
        with _stream_in_flight(servicer, base):
            status, answer = _post(base, "/v1/completions", b'{"prompt": "x", "max_tokens": 2}')
            assert status == 429, answer  # a good one waits its turn
            status, answer = _post(base, "/v1/completions", b'{"prompt": "x", "max_tokens": 2, "top_p": 1.5}')
            assert status == 400 and answer["error"]["message"].startswith("top_p"), answer
            context = _Context("ipv4:127.0.0.2:50999")
            req = _greedy(text=PROMPT)
            req.sampling_params.top_p = 1.5
            with pytest.raises(_Aborted):
                list(servicer.Generate(req, context))
            assert context.code == grpc.StatusCode.INVALID_ARGUMENT, context.details
            assert context.details.startswith("sampling_params.top_p: "), context.details
    finally:
        servicer.max_sessions = limit


class _Aborted(Exception):
    pass


class _Context(HttpCall):
    """A gRPC servicer context as ``Generate`` uses it: a caller, and ``abort`` raising as grpc's does."""

    def abort(self, code, details):
        self.code, self.details = code, details
        raise _Aborted(details)

    def invocation_metadata(self):
        return ()

    def send_initial_metadata(self, metadata):  # grpc's: Generate sends the request id in it
        self.sent_metadata = metadata

    set_trailing_metadata = send_initial_metadata  # and in its trailers


class _Cancelled:
    """A servicer whose every generation was cancelled before its first message (a server going down)."""

    ready, auth_token, engine, max_context = True, None, object(), 64
    metrics = ServerMetrics("orchestrator")  # the answer's 503 is counted in its kakeya_errors_total

    def stream(self, request, call):
        yield from ()


def test_a_generation_cancelled_before_it_began_is_503_not_500():
    http = HttpFront(_Cancelled(), 0, "tiny")
    base = f"http://127.0.0.1:{http.start('127.0.0.1')}"
    try:
        status, answer = _post(base, "/v1/completions", b'{"prompt": "x"}', token=None)
        assert status == 503 and answer["error"]["message"] == "the generation was cancelled"
    finally:
        http.drain()
        http.join(5)


# Sampling parameters as users of other servers send them: a sampling knob another OpenAI-style server honours
# (mlx-lm's XTC, llama.cpp's typical-p, mirostat, DRY, top-n-sigma, its repeat_penalty) is refused by name unless
# its value turns it off, never silently ignored; a temperature gRPC samples with is sampled with over HTTP too.
SAMPLED = {"model": "tiny", "prompt": "def add(a, b):", "max_tokens": 12, "seed": 5, "ignore_eos": True}

# (parameter, a value that turns the sampler on, the value that leaves it off)
SAMPLERS = [
    ("xtc_probability", 0.5, 0.0),  # mlx-lm, llama.cpp
    ("typical_p", 0.5, 1.0),  # llama.cpp, TGI
    ("repeat_penalty", 1.3, 1.0),  # llama.cpp's repetition_penalty
    ("mirostat", 2, 0),  # llama.cpp
    ("dry_multiplier", 0.8, 0.0),  # llama.cpp
    ("top_n_sigma", 1.0, -1.0),  # llama.cpp
]


def _sampled(base, body: dict) -> tuple[int, dict]:
    return _post(base, "/v1/completions", json.dumps(body).encode())


@pytest.mark.parametrize("name,on,off", SAMPLERS)
def test_another_servers_sampler_is_refused_by_name_unless_off(front, name, on, off):
    _, base = front
    status, answer = _sampled(base, SAMPLED | {"temperature": 1.0, name: on})
    assert status == 400 and answer["error"]["param"] == name, answer
    status, answer = _sampled(base, SAMPLED | {"temperature": 1.0, name: off})
    assert status == 200, answer


def test_a_huge_temperature_samples_alike_over_http_and_grpc(front):
    servicer, base = front
    sp = pb.SamplingParams(temperature=1e6, seed=5, max_tokens=12, ignore_eos=True)
    want = _grpc_ids(servicer, pb.GenerateRequest(text=SAMPLED["prompt"], sampling_params=sp))
    assert len(want) == 12
    status, answer = _sampled(base, SAMPLED | {"temperature": 1e6})
    assert status == 200, answer
    assert answer["kakeya"]["token_ids"] == want
