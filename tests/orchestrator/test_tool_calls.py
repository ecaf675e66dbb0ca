"""Gemma-4 tool calls read out of text (``orchestrator/tools/calls.py``), whole and streamed in any pieces,
and the tool-call markers kept in the decoded text where a tokenizer holds them as special tokens."""

from __future__ import annotations

import json
import shutil

import pytest
from tokenizers import AddedToken, Tokenizer

from kakeya.orchestrator.text import TextCodec
from kakeya.orchestrator.tools.calls import (
    MARKERS,
    ArgumentsPiece,
    ArgumentsStream,
    CallOpened,
    CallStream,
    parse_arguments,
    parse_call,
    split,
)

Q = '<|"|>'
TEXT = (
    f"I'll check <both>.\n<|tool_call>call:get_weather{{city:{Q}Paris, {{FR}}: <b>{Q},days:[1,2.5e1,-3],"
    f"hourly:true,opts:{{unit:{Q}c{Q},extra:null,n:{{}}}}}}<tool_call|>"
    f"<|tool_call>call:mod.get-time{{}}<tool_call|> then é <|tool_"
)


ARGUMENTS = [
        ("{}", {}),
        (f"{{a:{Q}x{Q}}}", {"a": "x"}),
        (
            f"{{a:{Q}{Q},b:0,c:-1.5E-3,d:false,e:None,f:null}}",
            {"a": "", "b": 0, "c": -1.5e-3, "d": False, "e": None, "f": None},
        ),
        (f"{{{Q}key with: colon{Q}:[{Q}a{Q},[],{{}}]}}", {"key with: colon": ["a", [], {}]}),
        (f"{{ a : {Q} spaced {Q} , b : [ 1 , 2 ] }}", {"a": " spaced ", "b": [1, 2]}),
        (f'{{s:{Q}json "quotes" \\ and {{braces}}{Q}}}', {"s": 'json "quotes" \\ and {braces}'}),
        (f"{{a:{Q}<x|y> \n\t\u0001 \u00e9 {Q},b:-0,c:1E2,d:[[None],{{e:[]}}]}}",
         {"a": "<x|y> \n\t\u0001 \u00e9 ", "b": 0, "c": 100.0, "d": [[None], {"e": []}]}),
]  # fmt: skip


@pytest.mark.parametrize(("args", "want"), ARGUMENTS)
def test_arguments_parse_to_json(args, want):
    assert parse_arguments(args) == want


@pytest.mark.parametrize(
    "args",
    ["", "{", "{a}", "{a:}", "{a:Paris}", f"{{a:{Q}x}}", "{a:1,}", "{a:1 b:2}", "{a:[1,}", "{a:1}}", "{a:01}", "[1]",
     "{a:tru}", "{a:1} x"],
)  # fmt: skip
def test_malformed_arguments_are_none(args):
    assert parse_arguments(args) is None


def test_a_call_parses_with_a_fresh_id():
    a, b = parse_call(f"call:f{{x:{Q}y{Q}}}"), parse_call(f"call:f{{x:{Q}y{Q}}}")
    assert (a.name, json.loads(a.arguments)) == ("f", {"x": "y"}) and a.id != b.id and a.id.startswith("call_")
    for body in ["f{}", "call:{}", "call:bad name{}", "call:f", "call:f{a:b}", "call:" + "x" * 65 + "{}"]:
        assert parse_call(body) is None


def _want():
    content, calls = split(TEXT)
    assert content == "I'll check <both>.\n then é <|tool_"
    assert [c.name for c in calls] == ["get_weather", "mod.get-time"]
    assert json.loads(calls[0].arguments) == {
        "city": "Paris, {FR}: <b>",
        "days": [1, 25.0, -3],
        "hourly": True,
        "opts": {"unit": "c", "extra": None, "n": {}},
    }
    return content, [(c.name, c.arguments) for c in calls]


def _run(pieces) -> tuple[str, list]:
    stream, events = CallStream(), []
    for piece in pieces:
        events += stream.feed(piece)
    events += stream.end()
    content = [e for e in events if isinstance(e, str)]
    assert all(content) and "<|tool_call>" not in "".join(content)  # no empty event, no marker as content
    return "".join(content), [(e.name, e.arguments) for e in events if not isinstance(e, str)]


def test_a_stream_cut_anywhere_gives_the_same_content_and_calls():
    want = _want()
    for i in range(len(TEXT) + 1):  # every cut in two, and every pair of cuts
        assert _run([TEXT[:i], TEXT[i:]]) == want
        for j in range(i, len(TEXT) + 1):
            assert _run([TEXT[:i], TEXT[i:j], TEXT[j:]]) == want
    for size in range(1, 12):  # every fixed block size
        assert _run([TEXT[k : k + size] for k in range(0, len(TEXT), size)]) == want


def test_content_streams_at_once_and_only_a_possible_marker_waits():
    stream = CallStream()
    assert stream.feed("hello <") == ["hello "]  # "<" may open a call: held
    assert stream.feed("b>") == ["<b>"]  # it did not
    assert stream.feed("x <|tool_c") == ["x "]
    assert stream.feed("all>call:f{") == [] and stream.feed("}<tool_call|>")[0].name == "f"
    assert stream.feed("<|tool_call>call:f{a:") == []
    [cut] = stream.end()  # a call cut short: the call so far, never its template text as content
    assert (cut.name, cut.arguments) == ("f", '{"a": ')


@pytest.mark.parametrize(("args", "want"), ARGUMENTS)
def test_arguments_stream_in_pieces_that_join_to_the_whole_answers_json(args, want):
    """Cut anywhere (every pair of cuts), the streamed pieces join to exactly the JSON a whole answer carries."""
    whole = json.dumps(want, ensure_ascii=False)
    for i in range(len(args) + 1):
        for j in range(i, len(args) + 1):
            stream = ArgumentsStream()
            assert stream.feed(args[:i]) + stream.feed(args[i:j]) + stream.feed(args[j:]) == whole
            assert not stream.broken


def test_arguments_go_out_as_soon_as_the_text_decides_them():
    stream = ArgumentsStream()
    assert stream.feed(f"{{city:{Q}Par") == '{"city": "Par'  # a string's characters at once
    assert stream.feed("is<|") == "is"  # a possible closing mark waits
    assert stream.feed('"|>,n') == '", '  # a bare key waits for what ends it
    assert stream.feed(":12") == '"n": '  # so does a number
    assert stream.feed("}") == "12}"
    assert stream.feed("") == "" and not stream.broken


def test_unreadable_arguments_stop_the_stream():
    stream = ArgumentsStream()
    assert stream.feed("{a:Paris,") == '{"a": ' and stream.broken
    assert stream.feed("b:1}") == ""


def _run_streamed(pieces) -> tuple[str, list]:
    """As :func:`_run`, with grammar-held calls: each call opened, then its arguments in pieces."""
    stream, events = CallStream(arguments=True), []
    for piece in pieces:
        events += stream.feed(piece)
    events += stream.end()
    content, calls = [], []
    for e in events:
        if isinstance(e, str):
            content.append(e)
        elif isinstance(e, CallOpened):
            assert e.call.arguments == "" and e.call.id.startswith("call_")
            calls.append([e.call.name, ""])
        else:
            assert isinstance(e, ArgumentsPiece) and e.text and calls
            calls[-1][1] += e.text
    assert all(content) and "<|tool_call>" not in "".join(content)
    return "".join(content), [tuple(c) for c in calls]


def test_streamed_arguments_cut_anywhere_join_to_the_whole_answers_calls():
    want = _want()
    for i in range(len(TEXT) + 1):
        assert _run_streamed([TEXT[:i], TEXT[i:]]) == want
        for j in range(i, len(TEXT) + 1, 3):
            assert _run_streamed([TEXT[:i], TEXT[i:j], TEXT[j:]]) == want
    for size in range(1, 12):
        assert _run_streamed([TEXT[k : k + size] for k in range(0, len(TEXT), size)]) == want


def test_a_streamed_call_opens_with_its_name_and_stays_a_call_when_cut_short():
    stream = CallStream(arguments=True)
    assert stream.feed("<|tool_call>call:get_wea") == []
    opened = stream.feed(f"ther{{city:{Q}Pa")
    assert isinstance(opened[0], CallOpened) and opened[0].call.name == "get_weather"
    assert opened[1:] == [ArgumentsPiece('{"city": "Pa')]
    assert stream.end() == []  # cut by max_tokens: its pieces are sent, nothing comes back as content


def test_a_malformed_header_waits_for_the_end_and_comes_back_as_content():
    stream = CallStream(arguments=True)
    assert stream.feed("<|tool_call>call:bad name{a:1}") == []
    assert stream.feed("<tool_call|>") == ["<|tool_call>call:bad name{a:1}<tool_call|>"]


def test_special_tool_markers_stay_in_the_decoded_text(demo_pair, tmp_path):
    """A tokenizer that holds the markers as special tokens (Gemma-4's does): they are decoded, other
    special tokens are still skipped."""
    shutil.copytree(demo_pair.target, tmp_path / "t", ignore=shutil.ignore_patterns("*.safetensors"))
    tok = Tokenizer.from_file(str(tmp_path / "t" / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in MARKERS])
    tok.save(str(tmp_path / "t" / "tokenizer.json"))
    codec = TextCodec(tmp_path / "t")
    text = f"<|tool_call>call:f{{a:{Q}x{Q}}}<tool_call|><|tool_response>"
    ids = codec.encode(text) + [1]  # <bos> first, <eos> last
    assert codec.tokenizer.token_to_id("<|tool_call>") in ids and ids[0] == 2
    assert codec.decode(ids) == text
    plain = TextCodec(demo_pair.target)  # no such special tokens: every special token is skipped, as before
    assert plain.hidden is None and plain.decode([2, *plain.encode("x")[1:], 1]) == "x"


def _answer(pieces: list[str], held: bool) -> tuple[str, list[tuple[str, str]]]:
    """The content and the calls (name, arguments) a stream of ``pieces`` comes to, as the HTTP front joins
    its chunks."""
    stream, content, calls = CallStream(arguments=held), "", []
    for e in [e for p in pieces for e in stream.feed(p)] + stream.end():
        if isinstance(e, str):
            content += e
        elif isinstance(e, ArgumentsPiece):
            calls[-1] = (calls[-1][0], calls[-1][1] + e.text)
        else:
            call = getattr(e, "call", e)
            calls.append((call.name, call.arguments))
    return content, calls


def test_a_call_cut_anywhere_is_the_same_answer_whole_and_streamed_and_never_content():
    """Issue 58: a call cut by max_tokens came back whole as its template text in ``content`` and streamed as
    a call. Cut at every character: the whole answer (``split``) and streams of any block size, held or not,
    agree on the content and on the calls (a cut call's arguments so far), and no content holds a marker."""
    for k in range(len(TEXT) + 1):
        content, calls = split(TEXT[:k])
        whole = (content, [(c.name, c.arguments) for c in calls])
        assert "<|tool_call>" not in content and Q not in content and "<tool_call|>" not in content, k
        for held in (False, True):
            for size in (1, 3, 7, 1000):
                pieces = [TEXT[:k][i : i + size] for i in range(0, k, size)]
                assert _answer(pieces, held) == whole, (k, held, size)
    content, calls = split(TEXT[: TEXT.index("days:")])
    assert content == "I'll check <both>.\n" and [c.name for c in calls] == ["get_weather"]
    assert calls[0].arguments == '{"city": "Paris, {FR}: <b>", '
    assert split(TEXT[: TEXT.index("weather")]) == ("I'll check <both>.\n", [])  # cut in its name: dropped
