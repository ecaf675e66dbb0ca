"""An offline batch through the HTTP front: many requests at once, each mixing features (greedy and seeded sampling,
stop strings, logprobs, JSON schemas, tool calls, block sizes, max_tokens 1 to 64, short and long prompts), and every
answer equals the same request's answer alone: text, calls, token ids, finish reason, usage, and logprobs within the
1e-4 the README allows (batched forwards add rows in another order). The demo pair on torch, colocated, on the
compute thread a server runs its rounds on; no prefix cache, so that the runs alone leave nothing for the batch."""

from __future__ import annotations

import asyncio

import pytest

from kakeya.orchestrator.assembly import build_local_engine
from kakeya.orchestrator.fronts.grpc_server import GenerationServicer
from kakeya.orchestrator.fronts.http_server import HttpFront

PROMPTS = ["def quicksort(xs):", "import os\n", "class Foo:\n    def __init__(self", "# " + "x = 1\n" * 120]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}}, "required": ["n"]}
TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {}}}}}


@pytest.fixture(scope="module")
def base(demo_pair):
    servicer = GenerationServicer(
        lambda: build_local_engine(str(demo_pair.target), str(demo_pair.draft), "torch", "cpu"), colocated=True
    )
    servicer.load()
    servicer.ready = True
    http = HttpFront(servicer, 0, "demo")
    yield f"http://127.0.0.1:{http.start('127.0.0.1')}/v1"
    http.drain()
    http.join(5)


def _request(i: int) -> tuple[str, dict]:
    """Request ``i`` of the batch: (chat or completions, its parameters)."""
    p, kind = PROMPTS[i % len(PROMPTS)], i % 6
    kw = {"max_tokens": (1, 7, 30, 64, 3, 48)[i % 6], "temperature": 0.0}
    if i % 3 == 1:
        kw |= {"temperature": 0.9, "seed": 1000 + i, "top_p": 0.9}
    if i % 4 == 2:
        kw["extra_body"] = {"block_size": (2, 16)[i % 2]}
    user = [{"role": "user", "content": p}]
    if kind == 0:
        return "completions", kw | {"prompt": p, "logprobs": 3, "stop": [":", "\n\n"]}
    if kind == 1:
        return "chat", kw | {"messages": user, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}  # fmt: skip
    if kind == 2:
        return "chat", kw | {"messages": user, "tools": [TOOL], "tool_choice": "required"}
    if kind == 3:
        return "chat", kw | {"messages": user, "logprobs": True, "top_logprobs": 2, "stop": ["\n"]}
    return "completions", kw | {"prompt": p, "stop": ["\n", "return"]}


def _answer(response) -> dict:
    """What must not depend on the batch: the answer without its ids, times and speculative statistics."""
    d = response.model_dump()
    for choice in d["choices"]:
        for call in (choice.get("message") or {}).get("tool_calls") or ():
            call.pop("id")
    return {"choices": d["choices"], "usage": d["usage"], "token_ids": d["kakeya"]["token_ids"]}


def _logprobs(answer: dict) -> list[float]:
    """Every logprob value of ``answer``, taken out of it (compared within a tolerance instead)."""
    out = []
    for choice in answer["choices"]:
        lp = choice.pop("logprobs") or {}
        for entry in lp.get("content") or ():  # chat
            out += [entry["logprob"], *(t["logprob"] for t in entry["top_logprobs"])]
        out += [*lp.get("token_logprobs", ()), *(v for top in lp.get("top_logprobs", ()) for v in top.values())]
    return out


def test_each_request_of_a_mixed_batch_answers_as_it_does_alone(base):
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base, api_key="-", max_retries=0, timeout=120)

    async def one(i: int) -> dict:
        api, kw = _request(i)
        create = client.chat.completions.create if api == "chat" else client.completions.create
        return _answer(await create(model="demo", **kw))

    async def batch() -> tuple[list, list]:
        alone = [await one(i) for i in range(24)]
        return alone, await asyncio.gather(*(one(i) for i in range(24)))

    alone, together = asyncio.run(batch())
    assert any(a["choices"][0]["finish_reason"] == "stop" for a in alone)  # the stop strings are met
    for i, (a, b) in enumerate(zip(alone, together, strict=True)):
        la, lb = _logprobs(a), _logprobs(b)
        assert a == b, i
        assert len(la) == len(lb) and all(abs(x - y) <= 1e-4 for x, y in zip(la, lb)), i
