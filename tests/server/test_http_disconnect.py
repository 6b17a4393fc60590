"""HTTP clients that go away abort their requests (KV blocks back to the baseline)."""
from __future__ import annotations

import httpx
import pytest

from tests.server.test_health_metrics import _metrics

CANCELLED = "specserve:request_cancelled_total"


def test_sse_client_disconnect_aborts(tiny_server):
    baseline = tiny_server.wait_blocks(0)["num_used_blocks"]
    cancelled = _metrics(tiny_server)[CANCELLED]
    body = {"prompt": list(range(3, 40)), "max_tokens": 200, "ignore_eos": True, "stream": True}
    lines = []
    with httpx.stream("POST", tiny_server.http + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line)
            if len(lines) == 3:
                break
    assert tiny_server.wait_blocks(baseline)["num_used_blocks"] == baseline
    assert _metrics(tiny_server)[CANCELLED] == cancelled + 1  # aborted, not run to the end


def test_non_streaming_client_disconnect_aborts(smol_server):
    # the real default model: 1000 tokens take many seconds, so the request is surely still running when
    # the client gives up (the tiny model could finish within the read timeout on a fast machine)
    server = smol_server
    baseline = server.wait_blocks(0)["num_used_blocks"]
    cancelled = _metrics(server)[CANCELLED]
    body = {"prompt": list(range(3, 40)), "max_tokens": 1000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.http + "/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.5))
    stats = server.wait_blocks(baseline, timeout=15)
    assert stats["num_used_blocks"] == baseline and stats["num_requests_running"] == 0
    assert _metrics(server)[CANCELLED] == cancelled + 1
