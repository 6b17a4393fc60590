"""Tool calling over /v1/chat/completions with the official `openai` client (strict response
validation) on the real default model, whose chat template renders neither tools nor tool calls (they
reach it in the Hermes format: engine/tool_prompt.py). `required` and a named function are held to
the tools' schemas by a grammar, so even a 135M model calls them well-formed; the answer after the
tool result is free text."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.server.conftest import SMOL_ENGINE
from tests.server.harness import ServerThread, engine_factory

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                   "required": ["zone"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
RESULT = '{"temperature_c": 18, "sky": "sunny"}'
GREEDY = dict(model=MODEL, temperature=0, max_tokens=40)


@pytest.fixture(scope="module")
def client(smol_server):
    return openai.OpenAI(base_url=smol_server.http + "/v1", api_key="unused", max_retries=0, timeout=300,
                         _strict_response_validation=True)


@pytest.fixture(scope="module")
def auto_server(default_model_dir):
    factory = engine_factory(default_model_dir, **SMOL_ENGINE)
    server = ServerThread(factory, MODEL, enable_auto_tool_choice=True, tool_call_parser="hermes")
    yield server
    server.stop()


def answer_messages(call_message, result: str = RESULT) -> list[dict]:
    """The conversation after a call: the assistant's message as returned, then the tool's result."""
    call = call_message.tool_calls[0]
    return ASK + [call_message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": result}]


def final_choice(stream):
    """The stream helper's final choice; its get_final_completion() refuses a choice cut off by
    max_tokens (LengthFinishReasonError), which then carries what was accumulated."""
    try:
        return stream.get_final_completion().choices[0]
    except openai.LengthFinishReasonError as e:
        return e.completion.choices[0]


def rendered_prompt(server, messages: list[dict], tools: list[dict] | None = None) -> str:
    body = {"model": MODEL, "messages": messages} | ({"tools": tools} if tools else {})
    ids = httpx.post(server.http + "/tokenize", json=body, timeout=60).json()["tokens"]
    return httpx.post(server.http + "/detokenize", json={"tokens": ids}, timeout=60).json()["prompt"]


def test_named_function_round_trip(client, smol_server):
    out = client.chat.completions.create(messages=ASK, tools=[WEATHER, TIME],
                                         tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                         **GREEDY)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)  # the schema's required string

    messages = answer_messages(choice.message)
    prompt = rendered_prompt(smol_server, messages, [WEATHER, TIME])
    assert "<tool_call>" in prompt and call.function.arguments in prompt.replace("\n", "")  # the call...
    assert RESULT in prompt and '"name": "get_time"' in prompt  # ... its result, and the tools offered
    final = client.chat.completions.create(messages=messages, tools=[WEATHER, TIME], tool_choice="none",
                                           **GREEDY)
    reply = final.choices[0]
    assert reply.message.tool_calls is None and reply.message.content.strip()
    assert reply.finish_reason in ("stop", "length")


def test_required_round_trip_streamed(client):
    """The stream helper of the openai client adds up the tool-call deltas into the same call the
    whole answer has; then the answer to the tool result streams as text."""
    args = dict(messages=ASK, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False, **GREEDY)
    whole = client.chat.completions.create(**args).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    [call] = whole.message.tool_calls
    assert call.function.name in ("get_weather", "get_time")
    json.loads(call.function.arguments)

    with client.chat.completions.stream(**args) as stream:
        events = list(stream)
        final = final_choice(stream)
    assert final.finish_reason == "tool_calls" and not final.message.content
    [streamed] = final.message.tool_calls
    assert (streamed.function.name, streamed.function.arguments) == (call.function.name, call.function.arguments)
    assert streamed.id.startswith("call_")
    deltas = [e for e in events if e.type == "tool_calls.function.arguments.delta"]
    assert len(deltas) >= 2 and "".join(e.arguments_delta for e in deltas) == call.function.arguments
    assert [e.type for e in events].count("tool_calls.function.arguments.done") == 1

    with client.chat.completions.stream(messages=answer_messages(final.message), tools=[WEATHER, TIME],
                                        tool_choice="none", **GREEDY) as stream:
        text = "".join(e.delta for e in stream if e.type == "content.delta")
        reply = final_choice(stream)
    assert text.strip() and reply.message.content == text and reply.message.tool_calls is None


def test_required_with_parallel_calls_gives_calls_of_the_tools(client):
    """The grammar allows more than one call here; the model makes one and closes the array."""
    out = client.chat.completions.create(messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                         **GREEDY | {"max_tokens": 80}).choices[0]
    assert out.finish_reason == "tool_calls" and out.message.tool_calls
    for c in out.message.tool_calls:
        args = json.loads(c.function.arguments)
        assert (c.function.name, set(args)) in (("get_weather", {"city"}), ("get_time", {"zone"}))


def test_tool_choice_none_puts_tools_in_the_prompt_and_answers_text(client, smol_server):
    out = client.chat.completions.create(messages=ASK, tools=[WEATHER], tool_choice="none",
                                         **GREEDY | {"max_tokens": 16})
    assert out.choices[0].message.tool_calls is None and out.choices[0].message.content
    assert '"name": "get_weather"' in rendered_prompt(smol_server, ASK, [WEATHER])


def test_auto_needs_the_servers_parser(client):
    for choice in ({}, {"tool_choice": "auto"}):  # auto is the default when tools are given
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(messages=ASK, tools=[WEATHER], **GREEDY, **choice)
        assert err.value.body["param"] == "tool_choice"
        assert "--enable-auto-tool-choice" in err.value.message and "--tool-call-parser" in err.value.message


@pytest.mark.parametrize("kwargs, param, words", [
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_time"}}), "tool_choice",
     "not among the tools"),
    (dict(tool_choice="required"), "tool_choice", "needs tools"),
    (dict(tools=[WEATHER], tool_choice="sometimes"), "tool_choice", ""),
    (dict(tools=[{"type": "retrieval"}]), "tools", ""),
    (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "tool_choice",
     "cannot be combined"),
])
def test_bad_tool_requests_are_400s(client, kwargs, param, words):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(messages=ASK, **GREEDY, **kwargs)
    assert err.value.body["param"] == param and words in err.value.message


def test_history_arguments_must_be_json(client):
    bad = ASK + [{"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                                        "function": {"name": "get_weather", "arguments": "{city"}}]}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(messages=bad, **GREEDY)
    assert "messages[1].tool_calls[0].function.arguments is not JSON" in err.value.message


def earlier_round(city: str, i: int) -> list[dict]:
    """One finished round of a conversation: a question, the call, its result, the answer."""
    return [{"role": "user", "content": f"Weather in {city}?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": f"call_{i}", "type": "function", "function": {
                "name": "get_weather", "arguments": json.dumps({"city": city})}}]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": RESULT},
            {"role": "assistant", "content": f"It is sunny in {city}."}]


def test_auto_round_trip_with_the_hermes_parser(auto_server):
    """`auto`: after two rounds in the history the small model calls the tool itself, in the Hermes
    format its prompt shows; the parser turns that into the same call whole and streamed. A question
    without such a history gets text."""
    client = openai.OpenAI(base_url=auto_server.http + "/v1", api_key="unused", max_retries=0, timeout=300,
                           _strict_response_validation=True)
    chat = earlier_round("Paris", 1) + earlier_round("Rome", 2) + [{"role": "user", "content": "Weather in Berlin?"}]
    whole = client.chat.completions.create(messages=chat, tools=[WEATHER], **GREEDY).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    [call] = whole.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Berlin"}
    with client.chat.completions.stream(messages=chat, tools=[WEATHER], **GREEDY) as stream:
        streamed = final_choice(stream)
    assert streamed.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == \
        [(call.function.name, call.function.arguments)]

    answer = chat + [whole.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    reply = client.chat.completions.create(messages=answer, tools=[WEATHER], **GREEDY).choices[0]
    assert reply.message.tool_calls is None and "Berlin" in reply.message.content

    short = GREEDY | {"max_tokens": 16}
    text = client.chat.completions.create(messages=ASK, tools=[WEATHER], **short).choices[0]
    with client.chat.completions.stream(messages=ASK, tools=[WEATHER], **short) as stream:
        streamed = final_choice(stream)
    assert text.message.tool_calls is None and text.message.content
    assert streamed.message.content == text.message.content and not streamed.message.tool_calls
