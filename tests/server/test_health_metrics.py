"""/health while loading and when ready, /version, /metrics after real traffic, HTTP error bodies."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import websockets
from prometheus_client.parser import text_string_to_metric_families

from specserve import __version__
from specserve.client import Client
from specserve.server.protocol import OutputTextDelta
from tests.server.conftest import TINY_ENGINE
from tests.server.harness import ServerThread, engine_factory


def test_health_is_503_while_loading_then_200(tiny_chat_dir):
    gate = threading.Event()
    build = engine_factory(tiny_chat_dir, **TINY_ENGINE)

    def slow_factory():
        gate.wait(60)  # the model "loads" until the test lets it finish
        return build()

    server = ServerThread(slow_factory, "tiny", wait_ready=False)
    try:
        loading = server.get("/health")
        models = server.get("/v1/models")
        completion = httpx.post(server.http + "/v1/completions", json={"prompt": [5], "max_tokens": 1})

        async def ws_while_loading():
            async with websockets.connect(server.ws) as ws:
                msg = json.loads(await ws.recv())
                await ws.wait_closed()
                return msg, ws.close_code

        ws_msg, ws_close = asyncio.run(ws_while_loading())
        gate.set()
        deadline = time.monotonic() + 60
        while (ready := server.get("/health")).status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        gate.set()
        server.stop()
    assert loading.status_code == 503 and loading.json()["status"] == "loading"
    assert models.status_code == completion.status_code == 503
    assert completion.json()["error"]["code"] == "model_not_ready"
    assert ws_msg["type"] == "error" and ws_msg["error"]["code"] == "model_not_ready" and ws_close == 1013
    assert ready.status_code == 200 and ready.json()["status"] == "ok"


def test_failed_load_is_reported(tmp_path):
    server = ServerThread(engine_factory(tmp_path / "missing"), "broken", wait_ready=False)
    try:
        server.state.wait_loaded(30)
        health = server.get("/health")
    finally:
        server.stop()
    assert health.status_code == 503 and health.json()["status"] == "failed"
    assert "model not found" in health.json()["error"]


def _metrics(server) -> dict[str, float]:
    text = server.get("/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + ("{" + s.labels["finished_reason"] + "}" if "finished_reason" in s.labels else "")
            out[key] = s.value
    return out


def test_metrics_follow_traffic(tiny_server):
    before = _metrics(tiny_server)
    with Client(tiny_server.ws) as client:
        events = [list(client.create([5, 6, 7], max_output_tokens=n, ignore_eos=True)) for n in (32, 3)]
        stream = client.create([9, 9], max_output_tokens=240, ignore_eos=True)
        events.append([next(stream)])
        stream.cancel()
        events[-1] += list(stream)
        # a response that finished in the engine before the cancel arrived is a success, and counted so
        cancelled = stream.final().status == "cancelled"
    tiny_server.wait_blocks(0)
    after = _metrics(tiny_server)
    resp = tiny_server.get("/metrics")
    assert resp.headers["content-type"].startswith("text/plain")
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prefix_cache_queries_total", "prefix_cache_hits_total", "spec_decode_num_drafts_total",
                 "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total",
                 "time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                 "e2e_request_latency_seconds_count", "prompt_tokens_total", "generation_tokens_total"):
        assert "specserve:" + name in after, name

    def delta(name):
        return after[name] - before.get(name, 0.0)

    assert delta("specserve:request_success_total{length}") == 3 - cancelled
    assert delta("specserve:request_cancelled_total") == cancelled
    assert delta("specserve:prompt_tokens_total") == 8
    assert delta("specserve:generation_tokens_total") >= 8
    assert delta("specserve:time_to_first_token_seconds_count") == 3
    assert delta("specserve:request_queue_time_seconds_count") == 3  # every request that was scheduled
    # one observation per engine step that streamed tokens, after a response's first (steps the reader
    # fell behind on arrive coalesced, as one); a step observed as the cancel arrived may not be sent
    steps = [sum(1 for e in evs if isinstance(e, OutputTextDelta) and e.token_ids) for evs in events]
    expected = sum(max(n - 1, 0) for n in steps)
    assert expected <= delta("specserve:inter_token_latency_seconds_count") <= expected + cancelled, steps
    assert delta("specserve:prefix_cache_queries_total") >= 8  # the engine's own counter, read at scrape time
    assert after["specserve:spec_decode_num_drafts_total"] == 0  # no speculation on this server
    assert after["specserve:num_requests_running"] == 0 and after["specserve:kv_cache_usage_perc"] == 0


def test_version_models_and_http_errors(tiny_server):
    assert tiny_server.get("/version").json() == {"version": __version__}
    models = tiny_server.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny"
    assert models["data"][0]["max_model_len"] == 256
    missing = tiny_server.get("/v1/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    url = tiny_server.http + "/v1/completions"
    bad_json = httpx.post(url, content=b"{nope", headers={"content-type": "application/json"})
    wrong_model = httpx.post(url, json={"model": "gpt-4", "prompt": [5], "max_tokens": 1})
    too_big = httpx.post(url, json={"prompt": "x" * 10000})
    too_long = httpx.post(url, json={"prompt": [5] * 300, "max_tokens": 1})
    bad_type = httpx.post(url, json={"prompt": [5], "max_tokens": "many"})
    assert bad_json.status_code == 400 and "JSON" in bad_json.json()["error"]["message"]
    assert wrong_model.status_code == 404 and wrong_model.json()["error"]["code"] == "model_not_found"
    assert too_big.status_code == 413
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
    assert bad_type.status_code == 400 and bad_type.json()["error"]["param"] == "max_tokens"
    ok = httpx.post(url, json={"model": "tiny", "prompt": [5, 6], "max_tokens": 3, "ignore_eos": True},
                    timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
