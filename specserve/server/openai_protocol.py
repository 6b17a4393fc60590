"""Request bodies of the OpenAI-compatible HTTP API (and of vLLM's /tokenize, /detokenize), and their
mapping to SamplingParams.

Fields OpenAI defines and we do not support are refused with a 400 naming the field (never silently
ignored when that would change the answer); unknown fields are ignored, as OpenAI does. vLLM's
extra sampling fields (top_k, min_p, repetition_penalty, ignore_eos, ...) are accepted too.
"""
from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from specserve.engine.intake import Intake, PromptError
from specserve.engine.messages import ModelInfo
from specserve.sampling_params import SamplingParams
from specserve.server.constraints import GUIDED_FIELDS, structured_outputs_from
from specserve.server.tool_calls import (
    ToolCallIn,
    ToolChoice,
    ToolChoiceError,
    ToolDefinition,
    ToolPlan,
    plan_tools,
)
from specserve.server.validation import (
    MAX_STOP_STRINGS,
    ROLES,
    CacheSalt,
    MaxTokens,
    MinP,
    NumSamples,
    Penalty,
    RepetitionPenalty,
    Seed,
    Temperature,
    TopK,
    TopP,
    InputError,
    template_role,
    to_sampling_params,
)


MAX_REQUEST_ID_LENGTH = 128
NO_TOKENIZER = "this model has no tokenizer: it takes and returns token ids only"


class OpenAIError(Exception):
    """Becomes `{"error": {message, type, param, code}}` with this HTTP status (and `headers`)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: NumSamples = 1
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stop: str | list[str] | None = None
    seed: Seed | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extras
    top_k: TopK | None = None  # None (left out): the model's default (--generation-config), else off
    min_p: MinP | None = None
    repetition_penalty: RepetitionPenalty | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: CacheSalt | None = None
    return_token_ids: bool = False  # each choice (and stream chunk) carries its output `token_ids`
    # structured outputs (OpenAI's and vLLM's names), checked and converted by server/constraints.py
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    response_format: Any = None

    def _check_common(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise OpenAIError(400, "stream_options is only allowed when stream is true",
                              param="stream_options")
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP_STRINGS:
            raise OpenAIError(400, f"at most {MAX_STOP_STRINGS} stop sequences", param="stop")

    def _params(self, max_tokens: int | None, logprobs: int | None,
                defaults: dict | None = None) -> SamplingParams:
        """`defaults`: the model's sampling defaults (ModelInfo.sampling_defaults) for fields left out."""
        try:
            return to_sampling_params(
                defaults, n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop,
                stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, logprobs=logprobs,
                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty, skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output, cache_salt=self.cache_salt,
                logit_bias=self._logit_bias(), structured_outputs=structured_outputs_from(
                    self.response_format, self.structured_outputs,
                    {name: getattr(self, name) for name in GUIDED_FIELDS}))
        except InputError as e:
            raise OpenAIError(400, e.message, code=e.code, param=e.param) from None

    def _logit_bias(self) -> dict[int, float] | None:
        """OpenAI's `logit_bias` has token ids as JSON object keys (strings)."""
        if not self.logit_bias:
            return None
        try:
            return {int(t): b for t, b in self.logit_bias.items()}
        except ValueError:
            raise OpenAIError(400, "logit_bias keys must be token ids (integers)", param="logit_bias") from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: MaxTokens | None = 16
    logprobs: int | None = Field(default=None, ge=0)  # at most the engine's max_logprobs
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise OpenAIError(400, "prompt is empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """(the output cap the client asked for, the field it came in); None: up to the context. Left
        out, the default 16 stays capped by the context: only a cap the client chose is checked."""
        return (self.max_tokens if "max_tokens" in self.model_fields_set else None), "max_tokens"

    def sampling_params(self, defaults: dict | None = None) -> SamplingParams:
        self._check_common()
        if self.echo and self.logprobs is not None:
            raise OpenAIError(400, "echo with logprobs is not supported (prompt logprobs are not computed)",
                              param="echo")
        if self.suffix:
            raise OpenAIError(400, "suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise OpenAIError(400, "best_of other than n is not supported", param="best_of")
        max_tokens = self.max_tokens if "max_tokens" in self.model_fields_set else \
            (defaults or {}).get("max_tokens", self.max_tokens)  # the model's default, else OpenAI's 16
        return self._params(max_tokens, self.logprobs, defaults)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "input_text"]
    text: str


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal[ROLES]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool result: the call it answers

    def as_template_message(self) -> dict[str, Any]:
        """The message as chat templates take it (the intake parses tool calls' arguments to dicts)."""
        content = self.content if isinstance(self.content, str) else \
            "".join(p.text for p in self.content or [])
        out = {"role": template_role(self.role), "content": content}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump(exclude_none=True) for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)  # at most the engine's max_logprobs
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def sampling_params(self, defaults: dict | None = None) -> SamplingParams:
        self._check_common()
        if self.top_logprobs and not self.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        params = self._params(self.requested_max_tokens()[0], (self.top_logprobs or 0) if self.logprobs else None,
                              defaults)
        plan = self.tool_plan()
        constraint = plan.constraint() if plan is not None else None
        if constraint is None:
            return params
        if params.structured_outputs is not None:
            raise OpenAIError(400, "tool_choice \"required\" or a named function is enforced with a grammar, "
                              "so it cannot be combined with response_format or structured outputs",
                              param="tool_choice")
        try:
            return dataclasses.replace(params, structured_outputs=constraint)
        except ValueError as e:
            raise OpenAIError(400, f"tool_choice: {e}", param="tool_choice") from None

    def tool_plan(self) -> ToolPlan | None:
        """How the request's tools are used (server/tool_calls.py); None without tools."""
        try:
            return plan_tools(self.tools, self.tool_choice, self.parallel_tool_calls)
        except ToolChoiceError as e:
            raise OpenAIError(400, e.message, param=e.param) from None

    def requested_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:  # OpenAI's newer name wins
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a `prompt` (tokenized as /v1/completions does) or chat `messages` (through the
    chat template, as /v1/chat/completions does, unless `add_generation_prompt` is false)."""
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # None: true for a prompt, false for messages (the template has them)
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    tools: list[ToolDefinition] | None = None  # rendered with the messages, as chat completions does


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[StrictInt]


def tokenize(tokenizer, req: TokenizeRequest, info: ModelInfo) -> dict:
    """The /tokenize answer: `{count, max_model_len, tokens}` (+ `token_strs` when asked for)."""
    if (req.prompt is None) == (req.messages is None):
        raise OpenAIError(400, "send either 'prompt' (text) or 'messages' (chat)", param="prompt")
    if tokenizer is None:
        raise OpenAIError(400, NO_TOKENIZER, code="no_tokenizer")
    if req.prompt is not None:
        ids = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
    else:
        # the chat template as chat completions applies it (tools, tool calls), but the client may
        # leave the generation prompt out
        intake = Intake(tokenizer, info.vocab_size, info.max_model_len)
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        try:
            text = intake.apply_chat_template([m.as_template_message() for m in req.messages], tools,
                                              add_generation_prompt=req.add_generation_prompt)
        except PromptError as e:
            raise OpenAIError(400, str(e), code=e.code, param="messages") from None
        ids = tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens))
    out = {"count": len(ids), "max_model_len": info.max_model_len, "tokens": ids}
    if req.return_token_strs:
        out["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
    return out


def detokenize(tokenizer, req: DetokenizeRequest, info: ModelInfo) -> dict:
    """The /detokenize answer: `{prompt}`, the text of `tokens` (ids in the model's vocabulary)."""
    if tokenizer is None:
        raise OpenAIError(400, NO_TOKENIZER, code="no_tokenizer")
    bad = next((t for t in req.tokens if not 0 <= t < info.vocab_size), None)
    if bad is not None:
        raise OpenAIError(400, f"token id {bad} is outside the vocabulary (0..{info.vocab_size - 1})",
                          code="invalid_tokens", param="tokens")
    return {"prompt": tokenizer.decode(req.tokens)}


def check_request_id(value: str) -> None:
    """A client's X-Request-Id is echoed in a response header: 1..128 printable ASCII characters."""
    if not 1 <= len(value) <= MAX_REQUEST_ID_LENGTH:
        problem = f"got {len(value)} characters"
    elif not all(" " <= c <= "~" for c in value):
        problem = "it holds a character outside printable ASCII"
    else:
        return
    raise OpenAIError(400, f"the X-Request-Id header must be 1 to {MAX_REQUEST_ID_LENGTH} printable ASCII "
                      f"characters ({problem})", code="invalid_request_id")


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def finish_reason(reason: str | None) -> str | None:
    """Engine finish reasons to OpenAI's (an aborted request reports `stop`, as vLLM does)."""
    if reason is None:
        return None
    return "length" if reason == "length" else "stop"


_MIN_LOGPROB = -9999.0  # JSON has no -inf


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id]) if tokenizer is not None else f"token_id:{token_id}"


def _top(lp: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(lp.items(), key=lambda kv: -kv[1])[:k]


def completion_logprobs(tokenizer, token_ids: list[int], logprobs: list[dict[int, float]], k: int,
                        text_offset: int = 0) -> dict:
    """The legacy completions `logprobs` object for these tokens."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for t, lp in zip(token_ids, logprobs):
        s = _token_text(tokenizer, t)
        tokens.append(s)
        token_lps.append(max(lp.get(t, _MIN_LOGPROB), _MIN_LOGPROB))
        tops.append({_token_text(tokenizer, i): max(v, _MIN_LOGPROB) for i, v in _top(lp, k)})
        offsets.append(text_offset)
        text_offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tokenizer, token_ids: list[int], logprobs: list[dict[int, float]], k: int) -> dict:
    """The chat completions `logprobs` object for these tokens."""
    def entry(t: int, v: float) -> dict:
        s = _token_text(tokenizer, t)
        return {"token": s, "logprob": max(v, _MIN_LOGPROB), "bytes": list(s.encode("utf-8"))}

    content = []
    for t, lp in zip(token_ids, logprobs):
        item = entry(t, lp.get(t, _MIN_LOGPROB))
        item["top_logprobs"] = [entry(i, v) for i, v in _top(lp, k)]
        content.append(item)
    return {"content": content, "refusal": None}
