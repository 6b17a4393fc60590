"""vLLM parity of the OpenAI HTTP API: model retrieval, /tokenize and /detokenize, X-Request-Id,
context-length errors, completions `echo`, and `stop_reason`. OpenAI's endpoints are checked with the
official `openai` client (strict response validation) on the real default model; vLLM's own routes and
headers with httpx."""
from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.conftest import TINY_ENGINE
from tests.server.harness import ServerThread, engine_factory

MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 2048  # the smol_server fixture's
PROMPT = "The capital of France is"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
KEY = "sk-parity"


@pytest.fixture(scope="module")
def client(smol_server):
    return openai.OpenAI(base_url=smol_server.http + "/v1", api_key="unused", max_retries=0, timeout=120,
                         _strict_response_validation=True)


@pytest.fixture(scope="module")
def lax(smol_server):
    """For streamed legacy completions (finish_reason null until the end: see test_openai.py)."""
    return openai.OpenAI(base_url=smol_server.http + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def bare_server(tiny_llama_dir):
    """A tiny model without a tokenizer, behind an API key, with an alias that has a slash."""
    server = ServerThread(engine_factory(tiny_llama_dir, **TINY_ENGINE), "bare", api_key=KEY,
                          extra_model_names=["org/bare"])
    yield server
    server.stop()


def post(server, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(server.http + path, json=body, timeout=120, **kwargs)


def tokens_of(server, **body) -> list[int]:
    r = post(server, "/tokenize", body)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


# -- GET /v1/models/{model} -----------------------------------------------------------------------

def test_retrieve_model_is_the_listed_card(client):
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    assert card.model_dump() == client.models.list().data[0].model_dump()
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4o")
    assert missing.value.code == "model_not_found" and "gpt-4o" in missing.value.message
    assert set(missing.value.response.json()["error"]) == {"message", "type", "param", "code"}


def test_retrieve_model_by_alias(bare_server):
    bare = openai.OpenAI(base_url=bare_server.http + "/v1", api_key=KEY, max_retries=0,
                         _strict_response_validation=True)
    assert bare.models.retrieve("org/bare").id == "bare"  # the alias has a slash: escaped in the path


# -- /tokenize and /detokenize --------------------------------------------------------------------

def test_tokenize_prompt_matches_completions_and_round_trips(client, smol_server):
    r = post(smol_server, "/tokenize", {"model": MODEL, "prompt": PROMPT, "return_token_strs": True})
    body = r.json()
    used = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1).usage.prompt_tokens
    assert body["count"] == len(body["tokens"]) == used
    assert body["max_model_len"] == MAX_MODEL_LEN
    assert "".join(body["token_strs"]).replace("Ġ", " ") == PROMPT  # byte-level BPE: Ġ is a space
    assert "token_strs" not in post(smol_server, "/tokenize", {"prompt": PROMPT}).json()
    back = post(smol_server, "/detokenize", {"model": MODEL, "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": PROMPT}


def test_tokenize_messages_matches_chat(client, smol_server):
    with_prompt = tokens_of(smol_server, messages=QUESTION)
    used = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1).usage.prompt_tokens
    assert len(with_prompt) == used
    without = tokens_of(smol_server, messages=QUESTION, add_generation_prompt=False)
    assert len(without) < len(with_prompt) and with_prompt[:len(without)] == without
    text = post(smol_server, "/detokenize", {"tokens": with_prompt}).json()["prompt"]
    assert text.endswith("assistant\n") and QUESTION[0]["content"] in text


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "messages": QUESTION}, 400, "prompt"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("/tokenize", {"prompt": "x", "model": "gpt-4o"}, 404, "model"),
    ("/detokenize", {"tokens": [1, 49152]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": [True]}, 400, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
])
def test_tokenize_bad_input(smol_server, path, body, status, param):
    r = post(smol_server, path, body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"]


def test_tokenize_reads_the_body_as_the_other_routes_do(smol_server):
    not_json = httpx.post(smol_server.http + "/tokenize", content=b'{"prompt": "x"}',
                          headers={"Content-Type": "text/plain"})
    assert not_json.status_code == 415 and not_json.json()["error"]["code"] == "unsupported_media_type"
    nan = httpx.post(smol_server.http + "/detokenize", content=b'{"tokens": [NaN]}',
                     headers={"Content-Type": "application/json"})
    assert nan.status_code == 400 and nan.json()["error"]["code"] == "invalid_json"
    assert httpx.get(smol_server.http + "/tokenize").status_code == 405


def test_tokenize_needs_the_api_key_and_a_tokenizer(bare_server):
    auth = {"Authorization": f"Bearer {KEY}"}
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [5]})):
        missing = post(bare_server, path, body)
        wrong = post(bare_server, path, body, headers={"Authorization": "Bearer nope"})
        assert missing.status_code == wrong.status_code == 401, path
        assert missing.headers["www-authenticate"] == "Bearer"
        assert wrong.json()["error"] == {"message": "incorrect API key", "type": "authentication_error",
                                         "param": None, "code": "invalid_api_key"}
        no_tokenizer = post(bare_server, path, body, headers=auth)  # the key is right: the model cannot
        assert no_tokenizer.status_code == 400 and no_tokenizer.json()["error"]["code"] == "no_tokenizer"


# -- X-Request-Id -----------------------------------------------------------------------------------

def test_request_id_is_the_answer_id_or_the_clients(smol_server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    plain = post(smol_server, "/v1/completions", body)
    assert plain.headers["x-request-id"] == plain.json()["id"] and plain.json()["id"].startswith("cmpl-")
    mine = post(smol_server, "/v1/completions", body, headers={"X-Request-Id": "my trace/42"})
    assert mine.headers["x-request-id"] == "my trace/42" and mine.json()["id"].startswith("cmpl-")
    chat = {"model": MODEL, "messages": QUESTION, "max_tokens": 2, "stream": True}
    with httpx.stream("POST", smol_server.http + "/v1/chat/completions", json=chat, timeout=120) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data: {"))
        assert r.headers["x-request-id"].startswith("chatcmpl-") and r.headers["x-request-id"] in first
    with httpx.stream("POST", smol_server.http + "/v1/chat/completions", json=chat, timeout=120,
                      headers={"X-Request-Id": "stream-1"}) as r:
        assert r.headers["x-request-id"] == "stream-1" and list(r.iter_lines())[-2] == "data: [DONE]"


def test_every_route_answers_with_a_request_id(smol_server):
    answers = [smol_server.get("/v1/models"), smol_server.get(f"/v1/models/{MODEL}"),
               smol_server.get("/v1/models/nope"), post(smol_server, "/tokenize", {"prompt": "x"}),
               post(smol_server, "/detokenize", {"tokens": [10**6]}),
               post(smol_server, "/v1/completions", {"prompt": ""})]
    assert [r.status_code for r in answers] == [200, 200, 404, 200, 400, 400]
    ids = [r.headers["x-request-id"] for r in answers]
    assert all(ids) and len(set(ids)) == len(ids)
    echoed = smol_server.get("/v1/models/nope", headers={"X-Request-Id": "abc"})
    assert echoed.status_code == 404 and echoed.headers["x-request-id"] == "abc"


@pytest.mark.parametrize("value", ["x" * 129, b"caf\xc3\xa9", ""])
def test_malformed_request_id_is_a_400(smol_server, value):
    r = post(smol_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1},
             headers={"X-Request-Id": value})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request_id"
    assert r.headers["x-request-id"] not in (value, "")  # a fresh one, not the refused value
    assert post(smol_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1},
                headers={"X-Request-Id": "x" * 128}).status_code == 200


# -- max_tokens beyond the context ----------------------------------------------------------------

def test_max_tokens_beyond_the_context_is_a_400(client, smol_server):
    num_prompt = len(tokens_of(smol_server, prompt=PROMPT))
    too_many = MAX_MODEL_LEN - num_prompt + 1
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=too_many)
    assert err.value.code == "context_length_exceeded" and err.value.param == "max_tokens"
    assert (f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you requested "
            f"{MAX_MODEL_LEN + 1} tokens ({num_prompt} in the prompt, {too_many} in the completion).") \
        in err.value.message
    # exactly the context fits (the stop string ends it at once)
    fits = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=too_many - 1, stop=[" "])
    assert fits.choices[0].finish_reason == "stop"
    for field in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(openai.BadRequestError) as chat_err:
            client.chat.completions.create(model=MODEL, messages=QUESTION, **{field: MAX_MODEL_LEN})
        assert chat_err.value.code == "context_length_exceeded" and chat_err.value.param == field


def test_left_out_max_tokens_is_still_capped_by_the_context(bare_server):
    """max_tokens left out (completions: the default 16) or null still runs up to the context."""
    auth = {"Authorization": f"Bearer {KEY}"}
    prompt = [5 + i % 200 for i in range(TINY_ENGINE["max_model_len"] - 6)]  # room for 6 tokens
    for extra in ({}, {"max_tokens": None}, {"max_tokens": 6}):
        r = post(bare_server, "/v1/completions", {"prompt": prompt, "ignore_eos": True} | extra, headers=auth)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6, (extra, r.text)
    refused = post(bare_server, "/v1/completions", {"prompt": prompt, "max_tokens": 7}, headers=auth)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"


# -- echo -------------------------------------------------------------------------------------------

def test_echo_prepends_the_prompt(client, smol_server):
    args = dict(model=MODEL, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(prompt=PROMPT, **args).choices[0].text
    echoed = client.completions.create(prompt=[PROMPT, "One, two,"], echo=True, n=2, **args)
    assert [c.text for c in echoed.choices[:2]] == [PROMPT + plain] * 2
    assert all(c.text.startswith("One, two,") for c in echoed.choices[2:])
    ids = tokens_of(smol_server, prompt=PROMPT)
    assert client.completions.create(prompt=ids, echo=True, **args).choices[0].text == PROMPT + plain
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(prompt=PROMPT, echo=True, logprobs=1, **args)
    assert err.value.param == "echo"


def test_echo_streamed_starts_each_choice_with_the_prompt(lax):
    chunks = list(lax.completions.create(model=MODEL, prompt=PROMPT, echo=True, max_tokens=4, n=2, temperature=0,
                                         stream=True, extra_body={"ignore_eos": True}))
    for index in (0, 1):
        texts = [ch.text for c in chunks for ch in c.choices if ch.index == index]
        assert texts[0].startswith(PROMPT) and not any(t.startswith(PROMPT) for t in texts[1:])
        assert len("".join(texts)) > len(PROMPT)


def test_echo_of_token_ids_needs_a_tokenizer(bare_server):
    r = post(bare_server, "/v1/completions", {"prompt": [5, 6], "echo": True, "max_tokens": 1},
             headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"


# -- stop_reason ------------------------------------------------------------------------------------

def test_stop_reason_names_what_stopped_the_choice(client, smol_server):
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    paris = client.completions.create(stop=[" Paris"], **args).choices[0]
    assert paris.finish_reason == "stop" and paris.model_extra["stop_reason"] == " Paris"
    [paris_id] = tokens_of(smol_server, prompt=" Paris")
    by_id = client.completions.create(extra_body={"stop_token_ids": [paris_id]}, **args).choices[0]
    assert by_id.finish_reason == "stop" and by_id.model_extra["stop_reason"] == paris_id
    length = client.completions.create(**args | {"max_tokens": 1}).choices[0]
    assert length.finish_reason == "length" and length.model_extra["stop_reason"] is None
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=30, temperature=0,
                                          stop=["Paris"]).choices[0]
    assert chat.finish_reason == "stop" and chat.model_extra["stop_reason"] == "Paris"


def test_stop_reason_streamed_on_the_last_chunk(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=30, temperature=0,
                                                 stop=["Paris"], stream=True))
    reasons = [c.choices[0].model_extra["stop_reason"] for c in chunks]
    assert reasons[-1] == "Paris" and reasons[:-1] == [None] * (len(chunks) - 1)
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("path, extra, follows", [
    ("/v1/completions", {"response_format": {"type": "json_object"}}, lambda text: text.startswith("{")),
    ("/v1/chat/completions", {"structured_outputs": {"choice": ["a", "b"]}}, lambda text: text in ("a", "b")),
    ("/v1/completions", {"guided_choice": ["a", "b"]}, lambda text: text in ("a", "b")),
    ("/v1/completions", {"guided_regex": "[a-z]+"}, lambda text: text.isalpha() and text.islower()),
])
def test_structured_outputs_are_honoured_not_ignored(smol_server, path, extra, follows):
    """Each field constrains the output (the details: test_structured_outputs.py)."""
    body = {"max_tokens": 4, "temperature": 0, **extra}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})
    r = post(smol_server, path, body)
    choice = r.json()["choices"][0]
    assert r.status_code == 200 and follows(choice["message"]["content"] if "chat" in path else choice["text"]), r.text


def test_logit_bias_over_the_openai_client(client, smol_server):
    """OpenAI's `logit_bias` (token ids as string keys): +100 on one token makes greedy pick it."""
    token = tokens_of(smol_server, prompt=" Paris")[-1]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                    logit_bias={str(token): 100}, extra_body={"return_token_ids": True})
    assert out.choices[0].model_extra["token_ids"] == [token] * 4
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, logit_bias={"999999": 1})
