"""Request intake: a prompt — text, token ids, a prompt dict, or chat messages — becomes validated
prompt token ids once, with machine-readable error codes. `LLM`, the engine and both server
protocols go through it; a `Prompt` it returned passes through again without being re-checked.

Codes (PromptError.code): `invalid_prompt` (empty, no tokenizer for text, token id outside the
vocabulary, wrong type), `invalid_messages` (no chat template, or the template refused them),
`context_length_exceeded` (no room left for one output token), `invalid_parameter` (sampling
parameters naming token ids outside the vocabulary).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass



class PromptError(ValueError):
    """A prompt the engine cannot take; `code` is machine-readable."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class Prompt:
    """A validated prompt: its token ids (and the text they came from, if any)."""

    text: str | None
    token_ids: list[int]


class Intake:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    def prompt(self, prompt) -> Prompt:
        """Text (tokenized with special tokens), token ids, or {"prompt": ...} / {"prompt_token_ids": ...}."""
        if isinstance(prompt, Prompt):
            return prompt
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise PromptError("invalid_prompt", "a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise PromptError("invalid_prompt", "this model has no tokenizer: send prompt token ids")
            return self._checked(prompt, self.tokenizer.encode(prompt))
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool)
                                                     for t in prompt):
            bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise PromptError("invalid_prompt", f"prompt token id {bad} is outside the vocabulary "
                                  f"(0..{self.vocab_size - 1})")
            return self._checked(None, list(prompt))
        raise PromptError("invalid_prompt", "a prompt is a string, a list of token ids, or a dict")

    def check_params(self, params) -> None:
        """What SamplingParams cannot check alone: token ids it names are in the vocabulary."""
        bad = next((t for t in (params.logit_bias or ()) if t >= self.vocab_size), None)
        if bad is not None:
            raise PromptError("invalid_parameter", f"logit_bias token id {bad} is outside the vocabulary "
                              f"(0..{self.vocab_size - 1})")

    def chat(self, messages: Sequence[dict]) -> Prompt:
        """Chat messages ({role, content: str}) through the model's chat template, tokenized without
        special tokens (the template holds them)."""
        text = self.apply_chat_template(messages)
        return self._checked(text, self.tokenizer.encode(text, add_special_tokens=False))

    def apply_chat_template(self, messages: Sequence[dict]) -> str:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise PromptError("invalid_messages", "this model has no chat template")
        try:
            return self.tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=False,
                                                      add_generation_prompt=True)
        except Exception as e:  # jinja errors: bad roles / content
            raise PromptError("invalid_messages", f"cannot apply the chat template: {e}") from None

    def _checked(self, text: str | None, ids: list[int]) -> Prompt:
        if not ids:
            raise PromptError("invalid_prompt", "the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise PromptError("context_length_exceeded",
                              f"the prompt is {len(ids)} tokens, which does not fit max_model_len "
                              f"{self.max_model_len} with room for at least one output token")
        return Prompt(text, ids)
