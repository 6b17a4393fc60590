"""Structured outputs in the engine, on the default model: constrained and plain requests in one
batch (async scheduling on), grammar compilation off the step loop (a request waits outside the
scheduler; one that fails to compile is refused alone), and greedy constrained output unchanged by
n-gram speculation (fp32)."""
from __future__ import annotations

import json

import jsonschema
import pytest

from specserve import LLM, SamplingParams
from specserve.sampling_params import StructuredOutputsParams as Constraint

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "rank"],
          "properties": {"city": {"type": "string", "maxLength": 12}, "rank": {"type": "integer", "minimum": 1,
                                                                             "maximum": 99}}}
QUESTIONS = ["Describe Paris as JSON.", "Describe Tokyo as JSON."]


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(str(default_model_dir), dtype="float32", device="cpu", num_kv_blocks=256, max_model_len=1024,
               async_scheduling=True)


def chat(llm, question: str, params: SamplingParams):
    return llm.chat([{"role": "user", "content": question}], params)[0].outputs[0]


def test_mixed_batch_with_async_scheduling(llm):
    engine = llm.engine
    deferred = engine.num_deferred_steps
    params = [SamplingParams(temperature=0, max_tokens=32, structured_outputs=Constraint(json=SCHEMA)),
              SamplingParams(temperature=0.8, seed=1, max_tokens=32, structured_outputs=Constraint(json=SCHEMA)),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=2, max_tokens=40, ignore_eos=True)]
    outs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS * 2], params)
    for out in outs[:2]:
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
        assert out.outputs[0].finish_reason == "stop"
    assert all(len(o.outputs[0].token_ids) == 40 for o in outs[2:])
    # the plain requests outlive the constrained ones: their last steps are deferred again
    assert engine.num_deferred_steps > deferred
    plain = chat(llm, QUESTIONS[0], params[2])
    assert plain.token_ids == outs[2].outputs[0].token_ids  # a constrained neighbour changes nothing


def test_a_grammar_that_fails_to_compile_refuses_only_its_request(llm):
    engine = llm.engine
    # the core's path: a front end checked the params, so the engine compiles without checking first
    bad = engine.make_requests("bad", "Hello", SamplingParams(max_tokens=4, structured_outputs=Constraint(
        regex="(unclosed")), checked=True)
    engine.add_group(bad)
    good = engine.add_request("good", "Hello", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    # it waits for its grammar outside the scheduler (it joins at a step once compiled), counted as waiting
    assert "bad" not in engine.scheduler.requests and engine.stats()["num_requests_waiting"] == 2
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    rejected = engine.take_rejections()
    assert list(rejected) == ["bad"] and "invalid regex" in rejected["bad"]
    assert len(finished[good].outputs[0].token_ids) == 4
    assert engine.kv_manager.pool.num_used_blocks == 0


def test_invalid_constraint_is_a_value_error_before_anything_runs(llm):
    with pytest.raises(ValueError, match="structured_outputs: invalid JSON schema"):
        llm.generate("Hi", SamplingParams(structured_outputs=Constraint(json={"type": "nope"})))
    assert not llm.engine.has_unfinished()


def test_greedy_constrained_output_is_unchanged_by_ngram_speculation(default_model_dir, llm):
    spec = LLM(str(default_model_dir), dtype="float32", device="cpu", num_kv_blocks=256, max_model_len=1024,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False})
    params = SamplingParams(temperature=0, max_tokens=32, structured_outputs=Constraint(json=SCHEMA))
    for question in QUESTIONS:
        with_spec = spec.chat([{"role": "user", "content": question}], params)[0]
        assert with_spec.outputs[0].token_ids == chat(llm, question, params).token_ids
        jsonschema.validate(json.loads(with_spec.outputs[0].text), SCHEMA)
    assert spec.engine.stats()["spec_decode_num_draft_tokens"] > 0
