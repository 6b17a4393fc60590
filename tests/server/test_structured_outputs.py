"""Structured outputs through the server: the official `openai` client (strict) on the real default model
with every way to ask for a constraint (response_format, vLLM's structured_outputs and guided_*), the
WebSocket protocol, clear 400s for bad constraints, and 50 concurrent json_schema requests whose
outputs all parse and validate, with and without n-gram speculation."""
from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from specserve.client import Client, SpecserveError
from tests.server.harness import ServerThread, engine_factory

MODEL = "SmolLM2-135M-Instruct"
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
CITY = {"type": "object", "additionalProperties": False, "required": ["city", "size", "coastal"],
        "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 14},
                       "size": {"enum": ["small", "medium", "large"]}, "coastal": {"type": "boolean"}}}
SCORES = {"type": "object", "additionalProperties": False, "required": ["scores", "passed"],
          "properties": {"scores": {"type": "array", "minItems": 1, "maxItems": 3,
                                    "items": {"type": "integer", "minimum": 0, "maximum": 10}},
                         "passed": {"type": "boolean"}}}
YES_NO_GRAMMAR = 'root ::= answer "." \nanswer ::= "yes" | "no"'


def openai_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.http + "/v1", api_key="unused", max_retries=0, timeout=300,
                         _strict_response_validation=True)


@pytest.fixture(scope="module")
def client(smol_server):
    return openai_client(smol_server)


def chat(client, content: str, **kwargs):
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, max_tokens=kwargs.pop("max_tokens", 64),
                                          messages=[{"role": "user", "content": content}], **kwargs)


def schema_format(schema: dict, name: str = "answer") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


# -- each way to ask ------------------------------------------------------------------------------
def test_chat_response_format_json_schema(client):
    out = chat(client, "Invent a person. Answer in JSON.", response_format=schema_format(PERSON))
    choice = out.choices[0]
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    assert choice.finish_reason == "stop"


def test_chat_parse_with_a_pydantic_model(client):
    class Person(BaseModel):
        name: str = Field(max_length=12)
        age: int = Field(ge=0, le=120)

    out = client.chat.completions.parse(model=MODEL, max_tokens=64, temperature=0, response_format=Person,
                                        messages=[{"role": "user", "content": "Invent a person."}])
    person = out.choices[0].message.parsed
    assert isinstance(person, Person) and person.name


def test_chat_response_format_json_object_streamed(client):
    chunks = list(chat(client, 'Give a JSON object with the key "color" and a one-word color.',
                       response_format={"type": "json_object"}, stream=True, max_tokens=96))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(json.loads(text), dict)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_chat_response_format_text_is_unconstrained(client):
    plain = chat(client, "Say hi.", max_tokens=8)
    text = chat(client, "Say hi.", max_tokens=8, response_format={"type": "text"})
    assert text.choices[0].message.content == plain.choices[0].message.content


def test_completions_response_format_and_structured_outputs(client):
    out = client.completions.create(model=MODEL, prompt="A city, as JSON:", max_tokens=64, temperature=0,
                                    extra_body={"response_format": schema_format(CITY)})
    jsonschema.validate(json.loads(out.choices[0].text), CITY)
    email = r"[a-z]{2,8}@[a-z]{2,8}\.(com|org)"
    out = client.completions.create(model=MODEL, prompt="My email address is", max_tokens=32, temperature=0.7,
                                    seed=3, extra_body={"structured_outputs": {"regex": email}})
    assert re.fullmatch(email, out.choices[0].text)
    assert out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("field,value,check", [
    ("guided_json", SCORES, lambda text: jsonschema.validate(json.loads(text), SCORES)),
    ("guided_regex", r"\d{3}-\d{4}", lambda text: re.fullmatch(r"\d{3}-\d{4}", text) or pytest.fail(text)),
    ("guided_choice", ["red", "green", "blue"], lambda text: text in ("red", "green", "blue") or pytest.fail(text)),
    ("guided_grammar", YES_NO_GRAMMAR, lambda text: text in ("yes.", "no.") or pytest.fail(text)),
])
def test_guided_fields(client, field, value, check):
    out = chat(client, "Answer the question: is the sky blue?", extra_body={field: value})
    check(out.choices[0].message.content)
    assert out.choices[0].finish_reason == "stop"


def test_structured_outputs_choice_with_n(client):
    out = chat(client, "Pick a season.", n=3, temperature=1.0, seed=7,
               extra_body={"structured_outputs": {"choice": ["spring", "summer", "autumn", "winter"]}})
    assert len(out.choices) == 3
    assert all(c.message.content in ("spring", "summer", "autumn", "winter") for c in out.choices)
    assert all(c.finish_reason == "stop" for c in out.choices)


def test_websocket_structured_outputs(smol_server):
    with Client(smol_server.ws) as ws:
        done = ws.generate(messages=[{"role": "user", "content": "Is water wet?"}], max_output_tokens=16,
                           temperature=0, structured_outputs={"grammar": YES_NO_GRAMMAR})
        assert done.output[0].text in ("yes.", "no.") and done.status == "completed"
        with pytest.raises(SpecserveError) as e:
            ws.generate(prompt="x", structured_outputs={"regex": "(a"})
        assert e.value.code == "invalid_parameter" and "invalid regex" in str(e.value)


# -- refusals -----------------------------------------------------------------------------------
@pytest.mark.parametrize("body,param,problem", [
    ({"response_format": schema_format({"type": "nope"})}, "response_format", "invalid JSON schema: Unsupported type"),
    ({"response_format": {"type": "xml"}}, "response_format", "response_format.type must be one of"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs a json_schema object"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs", "invalid regex: Regex parsing error"),
    ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs", 'Rule "missing" is not defined'),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs", "whitespace_pattern not supported"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one of"),
    ({"guided_json": "{bad json"}, "guided_json", "invalid JSON schema"),
    ({"guided_choice": []}, "guided_choice", "non-empty list of strings"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice", "not several"),
    ({"guided_regex": 5}, "guided_regex", "regex must be a string"),
])
def test_bad_constraints_are_400s_naming_the_problem(client, body, param, problem):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, "Hi", extra_body=body)
    error = e.value.body
    assert error["param"] == param and problem in error["message"], error


# -- must show: 50 json_schema requests, with and without speculation ---------------------------
@pytest.fixture(scope="module")
def smol_ngram_server(default_model_dir):
    factory = engine_factory(default_model_dir, num_kv_blocks=512, max_model_len=2048, device="cpu",
                             dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    server = ServerThread(factory, MODEL)
    yield server
    server.stop()


TOPICS = ["a teacher", "a pilot", "a chef", "a doctor", "a farmer", "Paris", "Tokyo", "Lima", "Oslo", "Cairo"]


async def _fifty(server) -> list[tuple[dict, str, str]]:
    client = openai.AsyncOpenAI(base_url=server.http + "/v1", api_key="unused", max_retries=0, timeout=600,
                                _strict_response_validation=True)
    schemas = [PERSON, CITY, SCORES]

    async def one(i: int):
        schema = schemas[i % 3]
        out = await client.chat.completions.create(
            model=MODEL, max_tokens=64, temperature=0 if i % 2 == 0 else 0.8, seed=i,
            messages=[{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} as JSON."}],
            response_format=schema_format(schema, f"schema{i % 3}"))
        return schema, out.choices[0].message.content, out.choices[0].finish_reason

    try:
        return await asyncio.gather(*(one(i) for i in range(50)))
    finally:
        await client.close()


@pytest.mark.parametrize("which", ["plain", "ngram"])
def test_fifty_json_schema_requests_validate(which, request):
    server = request.getfixturevalue("smol_server" if which == "plain" else "smol_ngram_server")
    results = asyncio.run(_fifty(server))
    for schema, text, finish in results:
        jsonschema.validate(json.loads(text), schema)
        assert finish == "stop", text
    if which == "ngram":  # the drafts were really verified under the grammar
        stats = server.state.require_engine().stats()
        assert stats["spec_decode_num_draft_tokens"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
