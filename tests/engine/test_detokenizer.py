"""Incremental detokenization on the real default tokenizer: UTF-8 safety and stop strings."""
from __future__ import annotations

import pytest

from specserve.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from specserve.models.loader import load_tokenizer
    return load_tokenizer(default_model_dir)


def stream(tok, text: str, stop=(), include=False, prompt="Q:"):
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, tok.encode(prompt), stop, include)
    pieces, hit = [], None
    for t in ids:
        hit = d.add_tokens([t])
        pieces.append(d.take_delta())
        if hit:
            break
    d.flush()
    pieces.append(d.take_delta())
    return pieces, hit, d.text


def test_multibyte_characters_never_emitted_broken(tokenizer):
    text = "Café — naïve 日本語 🙂🚀 done"
    pieces, _, full = stream(tokenizer, text)
    assert "".join(pieces) == full == tokenizer.decode(tokenizer.encode(text, add_special_tokens=False))
    assert all("\ufffd" not in p for p in pieces)
    assert len([p for p in pieces if p]) > 3  # it really streamed


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens_is_trimmed_and_never_streamed(tokenizer, include):
    text = "The answer is 42. END OF ANSWER and more text after"
    pieces, hit, full = stream(tokenizer, text, stop=["END OF ANSWER"], include=include)
    assert hit == "END OF ANSWER"
    expected = "The answer is 42. " + ("END OF ANSWER" if include else "")
    assert full == expected
    assert "".join(pieces) == expected  # nothing emitted that the stop later cut


def test_earliest_of_several_stop_strings_wins(tokenizer):
    _, hit, full = stream(tokenizer, "alpha beta gamma delta", stop=["delta", "beta"])
    assert hit == "beta" and full == "alpha "
