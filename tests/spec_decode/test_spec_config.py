"""`--speculative-config` as vLLM reads it: a `model` without `method` is a draft model, a model that
does not exist is refused at once, and ngram refuses a model it would ignore."""
from __future__ import annotations

import pytest

from specserve.config import SpecConfig, engine_config_from_args


def test_a_model_without_method_is_a_draft_model(tiny_llama_dir):
    config = engine_config_from_args(speculative_config=f'{{"model": "{tiny_llama_dir}", "num_speculative_tokens": 4}}')
    assert config.spec.method == "draft_model" and config.spec.model == str(tiny_llama_dir)
    assert config.spec.num_speculative_tokens == 4
    assert engine_config_from_args(speculative_config='{"num_speculative_tokens": 2}').spec.method == "ngram"
    shorthand = engine_config_from_args(speculative_config='{"num_speculative_tokens": 2}', draft_model="self-nf4")
    assert shorthand.spec.method == "draft_model" and shorthand.spec.quantization == "bitsandbytes-nf4"


@pytest.mark.parametrize("spec, message", [
    ('{"model": "/no/such/draft", "num_speculative_tokens": 4}', "draft model not found: /no/such/draft"),
    ('{"method": "ngram", "model": "self"}', "takes no model"),
    ('{"method": "eagle9"}', "is not one of"),
    ('[1, 2]', "must be a JSON object"),
    ('{"model": ', "not valid JSON"),
])
def test_what_cannot_be_honoured_is_refused(spec, message):
    with pytest.raises(ValueError, match=message):
        engine_config_from_args(speculative_config=spec)


def test_dummy_draft_shapes_need_no_path():
    config = engine_config_from_args(speculative_config='{"model": "llama-3.2-1b", "load_format": "dummy"}')
    assert config.spec.method == "draft_model"


def test_the_cap_on_drafts_defaults_by_method(tiny_llama_dir):
    """Left out, k is 4 for an EAGLE head (the chain depth the shipped head was trained to) and 3 for
    the others; given, it is the given value for every method."""
    cases = [('{"method": "eagle"}', 4), ('{"method": "eagle3"}', 4), ('{"method": "ngram"}', 3),
             (f'{{"model": "{tiny_llama_dir}"}}', 3), ('{"method": "eagle", "num_speculative_tokens": 2}', 2)]
    for spec, k in cases:
        assert engine_config_from_args(speculative_config=spec).spec.num_speculative_tokens == k, spec
    assert engine_config_from_args(speculative_config='{"method": "eagle"}', num_speculative_tokens=5) \
        .spec.num_speculative_tokens == 5


def test_an_eagle_heads_quantization_is_int8_or_none():
    assert SpecConfig(method="eagle", quantization="int8").quantization == "int8"
    assert SpecConfig(method="eagle").quantization is None  # left out: by size and device
    with pytest.raises(ValueError, match="an EAGLE head's quantization is int8"):
        SpecConfig(method="eagle3", quantization="bitsandbytes-int8")
    with pytest.raises(ValueError, match="draft quantization none is for EAGLE heads"):
        SpecConfig(method="ngram", quantization="none")
