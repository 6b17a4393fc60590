"""The official `openai` client, with strict response validation, against the server on the real
default model (SmolLM2-135M-Instruct)."""
from __future__ import annotations

import openai
import pytest
from openai._models import validate_type
from openai.types import Completion

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def client(smol_server):
    return openai.OpenAI(base_url=smol_server.http + "/v1", api_key="unused", max_retries=0, timeout=120,
                         _strict_response_validation=True)


def test_completion(client):
    out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                    temperature=0)
    assert "Paris" in out.choices[0].text
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.prompt_tokens == 5 and 1 <= out.usage.completion_tokens <= 8
    assert out.usage.prompt_tokens_details.cached_tokens == 0
    assert out.model == MODEL and out.object == "text_completion"


def test_completion_many_prompts_n_and_logprobs(client):
    out = client.completions.create(model=MODEL, prompt=["One, two,", "Red, green,"], max_tokens=4, n=2,
                                    temperature=0.8, seed=1, logprobs=2, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert out.usage.completion_tokens == 16
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == 4 and len(lp.token_logprobs) == 4 and all(v <= 0 for v in lp.token_logprobs)
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)


def test_chat_completion(client):
    out = client.chat.completions.create(
        model=MODEL, max_tokens=20, temperature=0,
        messages=[{"role": "system", "content": "You answer in one short sentence."},
                  {"role": "user", "content": "What is the capital of France?"}])
    choice = out.choices[0]
    assert choice.message.role == "assistant" and "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert out.object == "chat.completion" and out.usage.total_tokens == out.usage.prompt_tokens + \
        out.usage.completion_tokens


def test_chat_completion_stream_with_usage(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "Name a color."}], logprobs=True, top_logprobs=2))
    text_chunks = [c for c in chunks if c.choices]
    assert text_chunks[0].choices[0].delta.role == "assistant"
    assert text_chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert all(c.usage is None for c in text_chunks)
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens >= 1
    text = "".join(c.choices[0].delta.content or "" for c in text_chunks)
    assert text.strip()
    assert sum(len(c.choices[0].logprobs.content) for c in text_chunks if c.choices[0].logprobs) == \
        usage.completion_tokens


def test_prefix_cache_hits_show_in_usage(client):
    system = "You are a patient assistant. " * 12  # several full KV blocks shared by both requests
    cached = [client.chat.completions.create(model=MODEL, max_tokens=2, temperature=0, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": q}],
    ).usage.prompt_tokens_details.cached_tokens for q in ("Hi", "Hello")]
    assert cached[1] >= 16 and cached[1] >= cached[0]


def test_completion_stream(client, smol_server):
    """Every chunk is the openai package's `Completion`; the final one is validated strictly.

    openai's `CompletionChoice.finish_reason` is not Optional, yet OpenAI itself (and vLLM) send
    `finish_reason: null` until a choice ends (openai/openai-openapi#100), so the streamed chunks are
    read without strict validation and the null-finish-reason chunks are checked separately."""
    lax = openai.OpenAI(base_url=smol_server.http + "/v1", api_key="unused", max_retries=0, timeout=120)
    chunks = list(lax.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=6, temperature=0,
                                         stream=True, stream_options={"include_usage": True},
                                         extra_body={"ignore_eos": True}))
    *text_chunks, usage_chunk = chunks
    assert all(isinstance(c, Completion) for c in chunks)
    assert [c.choices[0].finish_reason for c in text_chunks] == [None] * (len(text_chunks) - 1) + ["length"]
    validate_type(type_=Completion, value=text_chunks[-1].model_dump())
    validate_type(type_=Completion, value=usage_chunk.model_dump())
    assert usage_chunk.usage.completion_tokens == 6
    assert "".join(c.choices[0].text for c in text_chunks).startswith(" 4")


@pytest.mark.parametrize("kwargs, param", [
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(n=100), "n"),
    (dict(prompt="x " * 3000), "prompt"),
])
def test_bad_input_is_a_400(client, kwargs, param):
    args = dict(model=MODEL, prompt="hello", max_tokens=4) | kwargs
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(**args)
    assert err.value.status_code == 400
    assert err.value.body["param"] == param and err.value.body["message"]


def test_bad_chat_input_and_unknown_model(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as tools:  # this server runs without a tool-call parser
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       tools=[{"type": "function",
                                               "function": {"name": "f", "parameters": {}}}])
    assert "--enable-auto-tool-choice" in tools.value.message and "--tool-call-parser" in tools.value.message
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert missing.value.code == "model_not_found"
    assert [m.id for m in client.models.list()] == [MODEL]


def test_return_token_ids_streams_every_token_once(client, smol_server):
    """vLLM's `return_token_ids`: the choices carry their token ids; streamed, every chunk's ids
    together are the whole output (also for tokens whose text is still held back). Streamed chunks
    are read without strict validation (see test_completion_stream)."""
    full = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0,
                                     extra_body={"return_token_ids": True, "ignore_eos": True})
    ids = full.choices[0].model_extra["token_ids"]
    assert len(ids) == full.usage.completion_tokens == 12
    lax = openai.OpenAI(base_url=smol_server.http + "/v1", api_key="unused", max_retries=0, timeout=120)
    stream = lax.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0,
                                    stream=True, stream_options={"include_usage": True},
                                    extra_body={"return_token_ids": True, "ignore_eos": True})
    chunks = list(stream)
    streamed = [t for c in chunks for ch in c.choices for t in ch.model_extra["token_ids"]]
    assert streamed == ids and chunks[-1].usage.completion_tokens == 12
    assert "".join(ch.text for c in chunks for ch in c.choices) == full.choices[0].text
