"""Tool-call parsers on the formats models write, whole and streamed: a streamed output split at every
point (inside tags, keys, strings and escapes) must add up to the whole output's answer."""
from __future__ import annotations

import json

import pytest

from specserve.server.tool_parsers import ToolCall, make_parser

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
HERMES = [
    # Qwen2.5 / Hermes 2 Pro as their templates ask for it
    (f"<tool_call>\n{WEATHER}\n</tool_call>", None,
     [ToolCall("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    (f"Let me look that up.\n<tool_call>\n{WEATHER}\n</tool_call>", "Let me look that up.\n",
     [ToolCall("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    ('<tool_call>\n{"name": "a", "arguments": {"x": [1, {"y": null}]}}\n</tool_call>\n'
     '<tool_call>\n{"name": "b\\u00e9", "arguments": {"s": "a \\"quoted\\" } ] brace </tool_call"}}\n</tool_call>\n',
     None, [ToolCall("a", '{"x": [1, {"y": null}]}'),
            ToolCall("bé", '{"s": "a \\"quoted\\" } ] brace </tool_call"}')]),
    ('<tool_call>{"name": "now"}</tool_call>', None, [ToolCall("now", "{}")]),  # no arguments
    ("No tools needed: 2 < 3 and <tool> is not a tag.", "No tools needed: 2 < 3 and <tool> is not a tag.", []),
    ("Ends with a tag prefix <tool_", "Ends with a tag prefix <tool_", []),
]
HERMES_BROKEN = [
    '<tool_call>\n{"name": "a", "arguments": {"x": </tool_call>',  # arguments cut off
    '<tool_call>\n{"name": "a", "arguments": {"x": 1',  # the output ended inside the call
    '<tool_call>\n{"arguments": {"x": 1}}\n</tool_call>',  # no name
]
LLAMA3 = [
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
     [ToolCall("get_weather", '{"city": "Paris"}')]),
    ('{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}', None,
     [ToolCall("a", '{"x": 1}'), ToolCall("b", "{}")]),
    ('  {"type": "function", "parameters": {"q": "x, y"}, "name": "search"}', None,  # arguments before the name
     [ToolCall("search", '{"q": "x, y"}')]),
    ('{"name": "n", "arguments": 3}', None, [ToolCall("n", "3")]),
    ("Paris is the capital of France.", "Paris is the capital of France.", []),
    ("<|python_tag", "<|python_tag", []),
]
REQUIRED = [
    ('[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "t", "parameters": {}}]', None,
     [ToolCall("get_weather", '{"city": "Paris"}'), ToolCall("t", "{}")]),
    ('[\n  {\n    "name": "f",\n    "parameters": {"a": "[]{}"}\n  }\n]', None, [ToolCall("f", '{"a": "[]{}"}')]),
]


def streamed(kind: str, pieces: list[str], name: str | None = None) -> tuple[str, list[ToolCall]]:
    """Content and calls as a client adds up the deltas; checks each call's first delta."""
    parser = make_parser(kind, name)
    content, calls = "", {}
    for out in [parser.feed(p) for p in pieces] + [parser.finish()]:
        content += out.content
        for d in out.calls:
            if d.index not in calls:
                assert d.name and d.arguments == "", "a call's first delta names it, with empty arguments"
                calls[d.index] = [d.name, ""]
            else:
                assert d.name is None
                calls[d.index][1] += d.arguments
    assert sorted(calls) == list(range(len(calls)))
    return content, [ToolCall(n, a) for _, (n, a) in sorted(calls.items())]


def splits(text: str):
    """Every split into two pieces, and one character at a time."""
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text)


@pytest.mark.parametrize("kind, text, content, calls",
                         [("hermes", *case) for case in HERMES] + [("llama3_json", *case) for case in LLAMA3]
                         + [("required", *case) for case in REQUIRED])
def test_whole_and_streamed_agree(kind, text, content, calls):
    assert make_parser(kind).parse(text) == (content, calls)
    for c in calls:
        json.loads(c.arguments)
    for pieces in splits(text):
        assert streamed(kind, pieces) == (content or "", calls), pieces


@pytest.mark.parametrize("text", HERMES_BROKEN)
def test_broken_hermes_calls_are_content(text):
    assert make_parser("hermes").parse(text) == (text, [])


@pytest.mark.parametrize("text", ['<tool_call>\n{"temperature": 28, "sky": "clear"}',  # seen from SmolLM2
                                  'Sure. <tool_call>{"city": "Rome"}</tool_call> Done.'])
def test_a_call_that_names_no_function_streams_as_content(text):
    assert make_parser("hermes").parse(text) == (text, [])
    for pieces in splits(text):
        assert streamed("hermes", pieces) == (text, [])


def test_llama3_text_after_the_calls_is_content():
    text = '{"name": "a", "parameters": {}} and then some words'
    content, calls = make_parser("llama3_json").parse(text)
    assert calls == [ToolCall("a", "{}")] and content == "and then some words"


def test_required_output_that_is_not_an_array_is_content():
    assert make_parser("required").parse('[{"name": "f", "parameters": {"a": 1}}') == \
        ('[{"name": "f", "parameters": {"a": 1}}', [])  # cut off before the closing bracket


def test_named_choice_output_is_the_arguments():
    text = '{"city": "Paris", "days": [1, 2]}'
    assert make_parser("named", "get_weather").parse(text) == (None, [ToolCall("get_weather", text)])
    for pieces in splits(text):
        assert streamed("named", pieces, "get_weather") == ("", [ToolCall("get_weather", text)])


def test_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="hermes, llama3_json"):
        make_parser("mistral")
