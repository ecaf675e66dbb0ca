"""Tools in the project's chat template (``checkpoints/chat_template.py``) and ``orchestrator/text.py``.

The expected strings are Gemma-4's tool syntax as its own ``chat_template.jinja`` writes it (the declaration,
call and result blocks that vLLM's and mlx-lm's ``gemma4`` tool parsers read and that llama.cpp's and other
projects' golden tests of the real template hold); the rendering is also checked against transformers'
``apply_chat_template`` of the same template, and the calls it writes against ``tool_calls.py``'s parser.
"""

from __future__ import annotations

import json

import pytest

from kakeya.core.request import Chat, Message, Tool, ToolCall
from kakeya.orchestrator.text import TextCodec, template_inputs
from kakeya.orchestrator.tools.calls import parse_call

Q = '<|"|>'
WEATHER = {"type": "function", "function": {"name": "weather", "description": "Weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "description": "City"}}, "required": ["city"]}}}  # fmt: skip
DECLARATION = (
    f"<|tool>declaration:weather{{description:{Q}Weather{Q},parameters:{{properties:{{city:{{description:{Q}City{Q},"
    f"type:{Q}STRING{Q}}}}},required:[{Q}city{Q}],type:{Q}OBJECT{Q}}}}}<tool|>"
)
CALLED = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Plan"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]  # fmt: skip


@pytest.fixture(scope="module")
def codec(demo_pair):
    return TextCodec(demo_pair.target)


def test_tools_calls_and_results_render_in_gemma4_syntax(codec):
    head = f"<bos><start_of_turn>system\nBe brief.{DECLARATION}<end_of_turn>\n<start_of_turn>user\nPlan<end_of_turn>\n"
    call = f"<|tool_call>call:weather{{city:{Q}Paris{Q}}}<tool_call|>"
    # the declarations in the system turn; nothing else changes without tools
    assert codec.chat.render(CALLED[:2], tools=[WEATHER]) == head + "<start_of_turn>model\n"
    plain = "<bos><start_of_turn>system\nBe brief.<end_of_turn>\n<start_of_turn>user\nPlan<end_of_turn>\n"
    assert codec.chat.render(CALLED[:2]) == plain + "<start_of_turn>model\n"
    # a call waiting for its result ends where the model stops; a result goes on in the same turn, no new one
    assert codec.chat.render(CALLED[:3], tools=[WEATHER]) == head + "<start_of_turn>model\n" + call + "<|tool_response>"
    result = f"<|tool_response>response:weather{{value:{Q}sunny{Q}}}<tool_response|>"
    assert codec.chat.render(CALLED, tools=[WEATHER]) == head + "<start_of_turn>model\n" + call + result
    answered = CALLED + [{"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "ok"}]
    assert codec.chat.render(answered, tools=[WEATHER]).endswith(
        call + result + "Sunny.<end_of_turn>\n<start_of_turn>user\nok<end_of_turn>\n<start_of_turn>model\n"
    )
    # without a system message the declarations open a system turn of their own
    assert codec.chat.render(CALLED[1:2], tools=[WEATHER]).startswith(
        f"<bos><start_of_turn>system\n{DECLARATION}<end_of_turn>\n<start_of_turn>user\nPlan"
    )


def test_schemas_and_arguments_are_written_as_gemma4_writes_them(codec):
    tool = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string"}}, "n": {"type": "integer", "description": "N"},
        "u": {"type": "string", "enum": ["c", "f"]},
        "o": {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}}}}}  # fmt: skip
    text = codec.chat.render([{"role": "user", "content": "x"}], tools=[tool])
    assert (
        f"<|tool>declaration:f{{description:{Q}d{Q},parameters:{{properties:{{n:{{description:{Q}N{Q},type:{Q}INTEGER{Q}}},"
        f"o:{{properties:{{a:{{type:{Q}BOOLEAN{Q}}}}},required:[{Q}a{Q}],type:{Q}OBJECT{Q}}},"
        f"tags:{{items:{{type:{Q}STRING{Q}}},type:{Q}ARRAY{Q}}},u:{{enum:[{Q}c{Q},{Q}f{Q}],type:{Q}STRING{Q}}}}},"
        f"type:{Q}OBJECT{Q}}}}}<tool|>"
    ) in text
    args = {"s": "a, b:{c}", "n": -2.5e3, "b": True, "z": None, "l": [1, "x", {"k": False}], "o": {"p": []}}
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": args}}]}]  # fmt: skip
    text = codec.chat.render(messages, tools=[tool])
    body = text[text.index("<|tool_call>") + len("<|tool_call>") : text.index("<tool_call|>")]
    assert body == f"call:f{{b:true,l:[1,{Q}x{Q},{{k:false}}],n:-2500.0,o:{{p:[]}},s:{Q}a, b:{{c}}{Q},z:None}}"
    call = parse_call(body)  # what the template writes, the parser reads back
    assert call.name == "f" and json.loads(call.arguments) == args


def test_the_template_renders_tools_as_transformers_does(codec, demo_pair):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(demo_pair.target))
    for n in range(1, len(CALLED) + 1):
        for prompt in (True, False):
            want = hf.apply_chat_template(CALLED[:n], tools=[WEATHER], tokenize=False, add_generation_prompt=prompt)
            assert codec.chat.render(CALLED[:n], tools=[WEATHER], add_generation_prompt=prompt) == want


def test_a_chat_request_becomes_the_templates_inputs():
    chat = Chat(
        (Message("user", "Plan"), Message("assistant", "", (ToolCall("c1", "weather", '{"city": "Paris"}'),)),
         Message("tool", "sunny", tool_call_id="c1")),
        tools=(Tool("weather", "Weather", WEATHER["function"]["parameters"]), Tool("bare")),
    )  # fmt: skip
    messages, tools = template_inputs(chat)
    assert messages[1]["tool_calls"] == [
        {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}
    ]
    assert messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}
    assert tools == [WEATHER, {"type": "function", "function": {"name": "bare", "description": ""}}]
    assert template_inputs(Chat((Message("user", "x"),)))[1] is None  # no tools: the template sees none
