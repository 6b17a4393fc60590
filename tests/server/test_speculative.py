"""Speculative decoding seen through the server: session info, per-step accepted drafts, per-response
and engine-wide counters; greedy output identical to the server without speculation."""
from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from specserve.client import Client
from tests.server.conftest import TINY_ENGINE
from tests.server.harness import ServerThread, engine_factory
from tests.server.test_health_metrics import _metrics

# always draft (no adaptive k): this test is about the server's plumbing, not about when speculation pays
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}


@pytest.fixture(scope="module")
def spec_server(tiny_chat_dir):
    server = ServerThread(engine_factory(tiny_chat_dir, speculative_config=SPEC, **TINY_ENGINE), "tiny")
    yield server
    server.stop()


def _run(server, prompt):
    with Client(server.ws) as client, client.create(prompt, max_output_tokens=40, temperature=0,
                                                     ignore_eos=True) as stream:
        events = list(stream)
        return client.session, events[:-1], stream.done


def test_speculation_is_reported_and_exact(spec_server, tiny_server):
    prompt = [7, 8, 9, 7, 8, 9, 7, 8]
    session, deltas, done = _run(spec_server, prompt)
    _, plain_deltas, plain = _run(tiny_server, prompt)
    assert session.speculative.method == "ngram" and session.speculative.num_speculative_tokens == 3
    # the random tiny model repeats itself, so n-gram drafts get accepted
    assert any(d.accepted_draft_tokens > 0 for d in deltas)
    assert all(0 <= d.accepted_draft_tokens <= len(d.token_ids) - 1 for d in deltas)
    spec = done.metrics.spec
    assert spec.accepted == sum(d.accepted_draft_tokens for d in deltas) > 0
    assert spec.drafts > 0 and spec.draft_tokens >= spec.accepted
    assert len(deltas) < len(plain_deltas)  # fewer engine steps for the same 40 tokens
    tokens = [t for d in deltas for t in d.token_ids]
    assert tokens == [t for d in plain_deltas for t in d.token_ids]  # greedy output is unchanged
    assert done.output[0].text == plain.output[0].text

    m = _metrics(spec_server)
    assert m["specserve:spec_decode_num_drafts_total"] >= spec.drafts
    assert m["specserve:spec_decode_num_accepted_tokens_total"] >= spec.accepted
    per_pos = {(s.name, s.labels["position"]): s.value
               for f in text_string_to_metric_families(spec_server.get("/metrics").text)
               for s in f.samples if "position" in s.labels}
    judged = "specserve:spec_decode_num_judged_tokens_per_pos_total"
    assert per_pos[(judged, "0")] == m["specserve:spec_decode_num_drafts_total"]  # every first draft is judged
    accepted = "specserve:spec_decode_num_accepted_tokens_per_pos_total"
    # a second draft is judged only where the first was accepted, and no draft is accepted unjudged
    assert 0 < per_pos[(judged, "1")] <= per_pos[(accepted, "0")] <= per_pos[(judged, "0")]
