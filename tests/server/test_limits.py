"""One request cannot hold the server: caps on prompts and sequences per request (a clear 400), and
a newcomer's 1-token request finishes within 2 s while the largest request the caps allow runs."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.server.harness import ServerThread, engine_factory
from tests.server.test_health_metrics import _metrics

RUNNING = "specserve:num_requests_running"


@pytest.fixture(scope="module")
def roomy_server(tiny_chat_dir):
    server = ServerThread(engine_factory(tiny_chat_dir, dtype="float32", device="cpu", num_kv_blocks=2400,
                                         max_model_len=256, max_num_seqs=256), "tiny")
    yield server
    server.stop()


def test_caps_on_prompts_and_sequences(roomy_server):
    url = roomy_server.http + "/v1/completions"
    huge = httpx.post(url, json={"prompt": [[5, 6]] * 1000, "n": 16, "max_tokens": 1}, timeout=30)
    assert huge.status_code == 400 and huge.json()["error"]["code"] == "too_many_prompts"
    many = httpx.post(url, json={"prompt": [[5, 6]] * 100, "n": 3, "max_tokens": 1}, timeout=30)
    assert many.status_code == 400 and many.json()["error"]["code"] == "too_many_sequences"
    assert "300 sequences" in many.json()["error"]["message"]
    ok = httpx.post(url, json={"prompt": [[5, 6]] * 128, "n": 2, "max_tokens": 1}, timeout=60)
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 256


def test_small_request_is_served_while_the_largest_allowed_runs(roomy_server):
    url = roomy_server.http + "/v1/completions"
    big_body = {"prompt": [[5 + i % 50, 6, 7] for i in range(256)], "max_tokens": 100, "ignore_eos": True}
    big: dict = {}
    worker = threading.Thread(target=lambda: big.update(r=httpx.post(url, json=big_body, timeout=600)))
    worker.start()
    try:
        deadline = time.monotonic() + 120
        while _metrics(roomy_server).get(RUNNING, 0) < 256:  # every sequence slot is taken
            assert time.monotonic() < deadline and worker.is_alive(), "the big request never filled the slots"
            time.sleep(0.05)
        t0 = time.monotonic()
        small = httpx.post(url, json={"prompt": [9, 10, 11], "max_tokens": 1}, timeout=60)
        latency = time.monotonic() - t0
        still_running = worker.is_alive()
    finally:
        worker.join(600)
    assert small.status_code == 200 and small.json()["usage"]["completion_tokens"] == 1
    assert still_running, "the big request ended first: the test proves nothing"
    assert latency < 2.0, f"a 1-token request took {latency:.2f}s behind a 256-sequence request"
    r = big["r"]
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 256 * 100
    assert roomy_server.wait_blocks(0)["num_used_blocks"] == 0
