"""vLLM's `--generation-config`, `--max-logprobs`, `--enable-log-requests` and the tool-calling flags:
offline (`LLM(...)`), over HTTP with the official `openai` client (strict), over the WebSocket, and
on the command line."""
from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys

import openai
import pytest

from specserve import LLM, SamplingParams
from specserve.cli import build_parser
from specserve.client import Client
from specserve.server.cli import resolve_serve_args
from specserve.server.settings import ServerSettings
from tests.server.conftest import TINY_ENGINE
from tests.server.harness import ServerThread, engine_factory

DEFAULTS = {"temperature": 0.0, "top_k": 5, "max_new_tokens": 6, "do_sample": True, "eos_token_id": 2}
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def gen_dir(tiny_chat_dir, tmp_path_factory):
    """The tiny chat model with a generation_config.json that recommends greedy sampling and 6 tokens."""
    path = shutil.copytree(tiny_chat_dir, tmp_path_factory.mktemp("gen") / "model")
    (path / "generation_config.json").write_text(json.dumps(DEFAULTS))
    return path


@pytest.fixture(scope="module")
def gen_server(gen_dir):
    server = ServerThread(engine_factory(gen_dir, **TINY_ENGINE), "tiny", enable_log_requests=True)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(gen_server):
    return openai.OpenAI(base_url=gen_server.http + "/v1", api_key="unused", max_retries=0, timeout=120,
                         _strict_response_validation=True)


def test_generation_config_gives_the_offline_defaults(gen_dir, tmp_path):
    llm = LLM(str(gen_dir), **TINY_ENGINE)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.0, 5, 6)
    out = llm.generate("abc")[0].outputs[0]  # no sampling params: the model's defaults
    assert len(out.token_ids) <= 6 and out.token_ids == llm.generate("abc")[0].outputs[0].token_ids  # greedy
    # explicit sampling params are taken as they are (vLLM's offline rule)
    assert llm.generate("abc", SamplingParams(temperature=0, max_tokens=2))[0].outputs[0].token_ids == \
        out.token_ids[:2]

    assert LLM(str(gen_dir), generation_config="vllm", **TINY_ENGINE).get_default_sampling_params() == \
        SamplingParams()
    other = tmp_path / "gen"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_p": 0.5, "min_p": 0.1}))
    chosen = LLM(str(gen_dir), generation_config=str(other), **TINY_ENGINE).get_default_sampling_params()
    assert (chosen.top_p, chosen.min_p, chosen.temperature, chosen.max_tokens) == (0.5, 0.1, 1.0, 16)
    with pytest.raises(ValueError, match="neither auto, vllm, nor a folder holding generation_config.json"):
        LLM(str(gen_dir), generation_config=str(tmp_path / "nowhere"), **TINY_ENGINE)


def test_generation_config_defaults_fill_what_requests_leave_out(client, gen_server):
    chat = [client.chat.completions.create(model="tiny", messages=HI, extra_body={"ignore_eos": True})
            for _ in range(2)]
    assert [c.usage.completion_tokens for c in chat] == [6, 6]  # max_new_tokens as max_tokens
    assert chat[0].choices[0].message.content == chat[1].choices[0].message.content  # temperature 0
    assert client.completions.create(model="tiny", prompt="abc", extra_body={"ignore_eos": True}
                                     ).usage.completion_tokens == 6  # instead of OpenAI's 16
    given = client.chat.completions.create(model="tiny", messages=HI, max_tokens=3, temperature=1.0, seed=1,
                                           extra_body={"ignore_eos": True})
    assert given.usage.completion_tokens == 3  # what a request sets wins
    with Client(gen_server.ws) as ws:
        with ws.create(prompt="abc", ignore_eos=True) as stream:
            list(stream)
        assert stream.done.usage.output_tokens == 6


def test_max_logprobs_caps_requests(client, gen_dir):
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(model="tiny", messages=HI, max_tokens=1, logprobs=True, top_logprobs=21)
    assert chat.value.body["param"] == "top_logprobs" and "at most 20" in chat.value.message
    with pytest.raises(openai.BadRequestError) as legacy:
        client.completions.create(model="tiny", prompt="abc", max_tokens=1, logprobs=21)
    assert legacy.value.body["param"] == "logprobs" and "--max-logprobs" in legacy.value.message
    top = client.chat.completions.create(model="tiny", messages=HI, max_tokens=1, logprobs=True, top_logprobs=20)
    assert len(top.choices[0].logprobs.content[0].top_logprobs) == 20

    llm = LLM(str(gen_dir), max_logprobs=30, **TINY_ENGINE)  # offline too
    out = llm.generate("abc", SamplingParams(max_tokens=1, logprobs=25))[0].outputs[0]
    assert len(out.logprobs[0]) >= 25
    with pytest.raises(ValueError, match="at most 30"):
        llm.generate("abc", SamplingParams(max_tokens=1, logprobs=31))
    assert LLM(str(gen_dir), max_logprobs=-1, **TINY_ENGINE).engine.intake.max_logprobs == 320  # the vocabulary


def test_enable_log_requests_logs_one_line_per_request(client, gen_server, tiny_server, caplog):
    caplog.set_level(logging.INFO, logger="specserve.server.streaming")
    out = client.chat.completions.create(model="tiny", messages=HI, max_tokens=4, extra_body={"ignore_eos": True})
    with Client(gen_server.ws) as ws:
        with ws.create(prompt="abc", max_output_tokens=3, ignore_eos=True) as logged:
            list(logged)
    with Client(tiny_server.ws) as ws:  # a server without --enable-log-requests
        with ws.create(prompt="abc", max_output_tokens=3, ignore_eos=True) as quiet:
            list(quiet)
    lines = [r.getMessage() for r in caplog.records if r.name == "specserve.server.streaming"]
    assert len(lines) == 2, lines
    http, socket = lines
    assert http.startswith(f"request {out.id}-0 ({out.id}): incomplete, prompt {out.usage.prompt_tokens} tokens")
    assert "output 4 tokens, finish length, ttft " in http
    assert socket.startswith(f"request {logged.done.id} (sess-") and "output 3 tokens, finish length" in socket


def test_serve_flags_reach_settings_and_engine_args():
    argv = ["serve", "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json", "--enable-log-requests",
            "--generation-config", "vllm", "--max-logprobs", "5"]
    args = resolve_serve_args(build_parser().parse_args(argv), {})
    assert (args.enable_auto_tool_choice, args.tool_call_parser, args.enable_log_requests) == \
        (True, "llama3_json", True)
    assert (args.generation_config, args.max_logprobs) == ("vllm", 5)
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        ServerSettings(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="hermes, llama3_json"):
        ServerSettings(tool_call_parser="pythonic")


def test_serve_refuses_auto_tool_choice_without_a_parser():
    proc = subprocess.run([sys.executable, "-m", "specserve.cli", "serve", "--enable-auto-tool-choice"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--enable-auto-tool-choice needs --tool-call-parser" in proc.stderr
