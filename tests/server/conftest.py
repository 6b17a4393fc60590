"""Servers shared by the server tests: a tiny random model with a character tokenizer (fast), and
the real default model (where the text matters: the OpenAI client tests)."""
from __future__ import annotations

import pytest

from tests.server.harness import ServerThread, add_char_tokenizer, engine_factory

TINY_ENGINE = dict(dtype="float32", device="cpu", num_kv_blocks=64, max_model_len=256)
# the default model's servers; fp32: bf16 matmuls are slow on AVX2-only CPUs
SMOL_ENGINE = dict(dtype="float32", device="cpu", num_kv_blocks=256, max_model_len=2048)
SMALL_FRAME = 4096


@pytest.fixture(scope="session")
def tiny_chat_dir(tiny_llama_dir, tmp_path_factory):
    return add_char_tokenizer(tiny_llama_dir, tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="session")
def tiny_server(tiny_chat_dir):
    server = ServerThread(engine_factory(tiny_chat_dir, **TINY_ENGINE), "tiny", max_frame_size=SMALL_FRAME)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def smol_server(default_model_dir):
    factory = engine_factory(default_model_dir, **SMOL_ENGINE)
    server = ServerThread(factory, "SmolLM2-135M-Instruct")
    yield server
    server.stop()
