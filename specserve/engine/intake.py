"""Request intake: a prompt — text, token ids, a prompt dict, or chat messages — becomes validated
prompt token ids once, with machine-readable error codes. `LLM`, the engine and both server
protocols go through it; a `Prompt` it returned passes through again without being re-checked.

Codes (PromptError.code): `invalid_prompt` (empty, no tokenizer for text, token id outside the
vocabulary, wrong type), `invalid_messages` (no chat template, or the template refused them),
`context_length_exceeded` (no room left for one output token), `invalid_parameter` (sampling
parameters naming token ids outside the vocabulary, or a structured-outputs schema / regex / grammar
that does not parse).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specserve.engine.tool_prompt import (renders_tool_calls, renders_tools, template_messages, with_hermes_calls,
                                          with_hermes_tools)
from specserve.sample.grammars import check_constraint


class PromptError(ValueError):
    """A prompt the engine cannot take; `code` is machine-readable."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param  # the request field at fault, when it is one


@dataclass(frozen=True, slots=True)
class Prompt:
    """A validated prompt: its token ids (and the text they came from, if any)."""

    text: str | None
    token_ids: list[int]


class Intake:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, max_logprobs: int = 20) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_logprobs = vocab_size if max_logprobs < 0 else max_logprobs  # -1: no cap (vLLM's)

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
        """What SamplingParams cannot check alone: token ids it names are in the vocabulary, and no more
        logprobs than the engine's max_logprobs."""
        bad = next((t for t in (params.logit_bias or ()) if t >= self.vocab_size), None)
        if bad is not None:
            raise PromptError("invalid_parameter", f"logit_bias token id {bad} is outside the vocabulary "
                              f"(0..{self.vocab_size - 1})", param="logit_bias")
        if params.logprobs is not None and params.logprobs > self.max_logprobs:
            raise PromptError("invalid_parameter", f"{params.logprobs} logprobs were asked for; this server "
                              f"returns at most {self.max_logprobs} (max_logprobs, --max-logprobs)",
                              param="logprobs")
        if params.structured_outputs is not None:  # it must parse (cheap, cached: sample/structured.py)
            if self.tokenizer is None:
                raise PromptError("invalid_parameter", "structured outputs need the model's tokenizer; "
                                  "this model has none", param="structured_outputs")
            try:
                check_constraint(params.structured_outputs)
            except ValueError as e:
                raise PromptError("invalid_parameter", f"structured_outputs: {e}", param="structured_outputs") from None

    def chat(self, messages: Sequence[dict], tools: list[dict] | None = None) -> Prompt:
        """Chat messages ({role, content: str}, assistant `tool_calls`, `tool` results) and the
        tools on offer (OpenAI's `{"type": "function", "function": {...}}`) through the model's chat
        template, tokenized without special tokens (the template holds them)."""
        text = self.apply_chat_template(messages, tools)
        return self._checked(text, self.tokenizer.encode(text, add_special_tokens=False))

    def apply_chat_template(self, messages: Sequence[dict], tools: list[dict] | None = None,
                            add_generation_prompt: bool = True) -> str:
        """A template that does not render tools or tool calls gets them in the Hermes format
        (engine/tool_prompt.py)."""
        template = getattr(self.tokenizer, "chat_template", None) if self.tokenizer is not None else None
        if not isinstance(template, str) or not template:
            raise PromptError("invalid_messages", "this model has no chat template")
        try:
            messages = template_messages(messages)
        except ValueError as e:
            raise PromptError("invalid_messages", str(e)) from None
        if tools and not renders_tools(template):
            messages = with_hermes_tools(messages, tools)
        if not renders_tool_calls(template):
            messages = with_hermes_calls(messages)
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
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
