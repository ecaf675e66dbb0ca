"""Logprobs through the OpenAI-compatible HTTP front, with the official ``openai`` client, on the demo pair
(torch, colocated, float32): chat ``logprobs`` + ``top_logprobs`` and completions ``logprobs``, greedy and
seeded sampling, streamed and not. The values equal a plain full forward of the target over prompt + output
within 1e-4; the streamed chunks' logprobs joined are the whole answer's; the shapes are OpenAI's; bad values
get a 400 naming the parameter."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import pytest

from kakeya.orchestrator.assembly import build_local_engine
from kakeya.orchestrator.fronts.grpc_server import GenerationServicer
from kakeya.orchestrator.fronts.http_server import HttpFront

from ..verifier.test_logprobs import TOL, reference

MESSAGES = [{"role": "user", "content": "Write a function that adds two numbers."}]
PROMPT = "def add(a, b):\n    return"


@pytest.fixture(scope="module")
def front(demo_pair):
    import torch

    torch.set_num_threads(1)
    servicer = GenerationServicer(
        lambda: build_local_engine(str(demo_pair.target), str(demo_pair.draft), "torch", "cpu", "float32"),
        colocated=True,
    )
    servicer.load()
    servicer.ready = True
    http = HttpFront(servicer, 0, "demo")
    port = http.start("127.0.0.1")
    yield servicer.engine, f"http://127.0.0.1:{port}"
    http.drain()
    http.join(5)


def _client(base):
    from openai import OpenAI

    return OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)


def _post(base, path, body) -> tuple[int, dict]:
    req = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _same(a, b) -> None:
    """Equal JSON but for numbers, which agree within TOL."""
    if isinstance(a, float) or isinstance(b, float):
        assert abs(a - b) < TOL, (a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b


def _expected(engine, prompt_ids, token_ids):
    """The plain forward's log_softmax row that predicted each output token."""
    return reference(engine.verifier, list(prompt_ids) + list(token_ids[:-1]))[len(prompt_ids) - 1 :]


SAMPLING = {"greedy": {"temperature": 0}, "sampled": {"temperature": 0.8, "seed": 11, "top_p": 0.95}}


@pytest.mark.parametrize("how", list(SAMPLING))
def test_chat_logprobs_equal_the_target_streamed_and_not(front, how):
    engine, base = front
    client = _client(base)
    ask = dict(model="demo", messages=MESSAGES, max_tokens=24, logprobs=True, top_logprobs=4, **SAMPLING[how])
    whole = client.chat.completions.create(**ask)
    ids = whole.model_extra["kakeya"]["token_ids"]
    content = whole.choices[0].logprobs.content
    assert len(content) == len(ids) == whole.usage.completion_tokens
    prompt = engine.codec.encode_chat(MESSAGES)
    for row, t, entry in zip(_expected(engine, prompt, ids), ids, content):
        text, raw = engine.codec.token(t)
        assert entry.token == text and entry.bytes == list(raw)
        assert abs(entry.logprob - row[t]) < TOL
        assert len(entry.top_logprobs) == 4
        np.testing.assert_allclose([e.logprob for e in entry.top_logprobs], np.sort(row)[::-1][:4], atol=TOL)
        assert (
            entry.top_logprobs[0].bytes == list(entry.top_logprobs[0].token.encode())
            or "\ufffd" in entry.top_logprobs[0].token
        )
    joined = []
    for chunk in client.chat.completions.create(**ask, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            joined += chunk.choices[0].logprobs.content
    # the same tokens; the values within float32 rounding (another block schedule sums in another order)
    _same([e.model_dump() for e in joined], [e.model_dump() for e in content])
    if how == "greedy":  # greedy: the chosen token is the most probable one
        assert all(e.token == e.top_logprobs[0].token for e in content)


@pytest.mark.parametrize("how", list(SAMPLING))
def test_completion_logprobs_equal_the_target_streamed_and_not(front, how):
    engine, base = front
    client = _client(base)
    prompt = engine.codec.encode(PROMPT)
    ask = dict(model="demo", prompt=prompt, max_tokens=24, logprobs=3, **SAMPLING[how])
    whole = client.completions.create(**ask)
    ids = whole.model_extra["kakeya"]["token_ids"]
    lp = whole.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids)
    rows = _expected(engine, prompt, ids)
    for i, (row, t) in enumerate(zip(rows, ids)):
        assert lp.tokens[i] == engine.codec.token(t)[0]
        assert abs(lp.token_logprobs[i] - row[t]) < TOL
        assert 3 <= len(lp.top_logprobs[i]) <= 4 and lp.top_logprobs[i][lp.tokens[i]] == lp.token_logprobs[i]
        assert lp.text_offset[i] == sum(len(s) for s in lp.tokens[:i])
    streamed = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in client.completions.create(**ask, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            for k, v in chunk.choices[0].logprobs.model_dump().items():
                streamed[k] += v
    _same(streamed, lp.model_dump())


def test_zero_asks_for_the_chosen_token_only_and_none_asks_for_nothing(front):
    base = front[1]
    status, body = _post(base, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "logprobs": 0})
    assert status == 200
    assert all(
        list(d) == [t]
        for d, t in zip(body["choices"][0]["logprobs"]["top_logprobs"], body["choices"][0]["logprobs"]["tokens"])
    )
    status, body = _post(base, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 6, "logprobs": True})
    assert status == 200 and all(e["top_logprobs"] == [] for e in body["choices"][0]["logprobs"]["content"])
    assert len(body["choices"][0]["logprobs"]["content"]) == body["usage"]["completion_tokens"]
    for path, ask in [("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": MESSAGES})]:
        status, body = _post(base, path, ask | {"max_tokens": 4, "logprobs": None})
        assert status == 200 and body["choices"][0]["logprobs"] is None
    status, body = _post(base, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, "logprobs": False})
    assert status == 200 and body["choices"][0]["logprobs"] is None


@pytest.mark.parametrize(
    "path, ask, param",
    [
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": False, "top_logprobs": 3}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": 3}, "logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 2.5}, "top_logprobs"),
        ("/v1/completions", {"logprobs": 21}, "logprobs"),
        ("/v1/completions", {"logprobs": True}, "logprobs"),
        ("/v1/completions", {"logprobs": "5"}, "logprobs"),
        ("/v1/completions", {"logprobs": 10**400}, "logprobs"),
    ],
)
def test_bad_logprobs_values_get_a_400_naming_the_field(front, path, ask, param):
    prompt = {"messages": MESSAGES} if "chat" in path else {"prompt": PROMPT}
    status, body = _post(front[1], path, prompt | {"max_tokens": 4} | ask)
    assert status == 400 and body["error"]["param"] == param, body
    assert body["error"]["message"].startswith(param)


def test_streamed_chunks_with_tools_carry_their_tokens_logprobs(front):
    """The README (Logprobs): "Streamed, each chunk carries the logprobs of the tokens committed since the previous
    chunk", as OpenAI streams them beside each chunk's content. With ``tools`` (``auto``: the demo model writes no
    call, so its text comes back as content) each content chunk must carry its tokens' logprobs too."""
    tools = [{"type": "function", "function": {"name": "f"}}]
    chunks = list(_client(front[1]).chat.completions.create(
        model="demo", messages=MESSAGES, tools=tools, max_tokens=12, temperature=0, stream=True, logprobs=True,
        top_logprobs=1))  # fmt: skip
    texted = [c.choices[0] for c in chunks if c.choices and c.choices[0].delta.content]
    assert texted  # the demo model answers in text under "auto"
    for choice in texted:
        assert choice.logprobs is not None and choice.logprobs.content, choice
    whole = _client(front[1]).chat.completions.create(
        model="demo", messages=MESSAGES, tools=tools, max_tokens=12, temperature=0, logprobs=True, top_logprobs=1
    )
    joined = [t.token for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert joined == [t.token for t in whole.choices[0].logprobs.content]  # each token once, in order


def test_completions_top_logprobs_keep_the_most_probable_of_tokens_sharing_a_text():
    """Completions' ``top_logprobs`` are keyed by text, and byte tokens (each part of a character) share U+FFFD:
    the sampled token 257 (-2.76) stays listed at its value, not at a less probable byte token's (as seen on the
    tiny pair, seed 4, 5th token: token_logprobs -2.76 beside top_logprobs {"\\ufffd": -4.90})."""
    from kakeya.core.contract import TokenLogprobs
    from kakeya.orchestrator.fronts.http_params import completion_logprobs

    def token(t: int) -> tuple[str, bytes]:
        return ("\ufffd", bytes([t - 100])) if t >= 200 else (f"t{t}", b"t")

    lp = TokenLogprobs(257, -2.76, ((5, -0.97), (257, -2.76), (6, -3.1), (300, -4.9)))
    got = completion_logprobs([lp], token)
    assert got["token_logprobs"] == [-2.76]
    assert got["top_logprobs"] == [{"t5": -0.97, "\ufffd": -2.76, "t6": -3.1}]
    assert list(got["top_logprobs"][0]) == ["t5", "\ufffd", "t6"]  # most probable first, as OpenAI's
