"""A real server on the default model for the browser tests."""
from __future__ import annotations

import pytest

from tests.server.harness import ServerThread, engine_factory


@pytest.fixture(scope="module")
def web_server(default_model_dir):
    factory = engine_factory(default_model_dir, num_kv_blocks=128, max_model_len=2048, device="cpu",
                             dtype="float32")
    server = ServerThread(factory, "SmolLM2-135M-Instruct")
    yield server
    server.stop()
