"""A request's decode speed is reported even when all its tokens reach the server in one update (a
busy server loop coalesces the engine's steps): from the engine's first-token and finish times."""
from __future__ import annotations

import pytest

from specserve.engine.intake import Prompt
from specserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from specserve.sampling_params import SamplingParams
from specserve.server.metrics import ServerMetrics
from specserve.server.streaming import RequestStream

PROMPT = Prompt("p", [1, 2])


def test_decode_speed_from_the_engine_when_every_token_came_at_once():
    stream = RequestStream(engine=None, metrics=ServerMetrics("m", lambda: None), prompt=PROMPT,
                           params=SamplingParams(max_tokens=12), request_id="r")
    metrics = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.0, first_token_time=10.5,
                             finished_time=11.6, time_to_first_token=0.5)
    out = RequestOutput("r", "p", [1, 2], [CompletionOutput(0, "x" * 12, list(range(12)), "length")], True, 0, metrics)
    stream.final = out
    stream._observe_step(12, out)  # one update carried all 12 tokens
    assert stream.decode_seconds_per_token() == pytest.approx(1.1 / 11)
    stream.final = None  # nothing to go by: unknown, not zero
    assert stream.decode_seconds_per_token() is None
