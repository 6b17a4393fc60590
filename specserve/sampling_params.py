"""Per-request sampling parameters (vLLM's names and defaults)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

GREEDY_EPS = 1e-5
# seeds are 64-bit signed integers (vLLM's range); child i of an n > 1 request draws with seed + i
MIN_SEED, MAX_SEED = -(1 << 63), (1 << 63) - 1
MAX_LOGIT_BIAS = 1024  # token ids one request may bias


@dataclass
class StructuredOutputsParams:
    """A constraint on the output (vLLM's names): exactly one of a JSON schema (`json`, a dict or its
    text), any JSON object (`json_object`), a regular expression, a choice of strings, or an EBNF
    grammar. The grammar engine and the token masks: specserve/sample/structured.py."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of json, regex, choice, grammar, json_object"
                             + (f"; got {', '.join(given)}" if given else ""))
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs choice must be a non-empty list of strings")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None = up to max_model_len
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per output token (plus the sampled one)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling, in [-100, 100]
    structured_outputs: StructuredOutputsParams | None = None  # a grammar the output must follow
    _stop: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._stop = [s for s in (self.stop or []) if s]
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.top_k == -1:
            self.top_k = 0
        floats = {"temperature": self.temperature, "top_p": self.top_p, "min_p": self.min_p,
                  "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                  "repetition_penalty": self.repetition_penalty}
        for name, value in floats.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        checks = [
            (self.n >= 1, f"n must be >= 1, got {self.n}"),
            (self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.max_tokens is None or self.max_tokens >= 1,
             f"max_tokens must be >= 1, got {self.max_tokens}"),
            (self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens,
             "min_tokens must not exceed max_tokens"),
            # the engine caps it (max_logprobs, engine/intake.py)
            (self.logprobs is None or self.logprobs >= 0, f"logprobs must be >= 0, got {self.logprobs}"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]"),
            (0.0 < self.repetition_penalty <= 2.0, "repetition_penalty must be in (0, 2]"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             "stop_token_ids must be non-negative integers"),
            (self.seed is None or (isinstance(self.seed, int) and MIN_SEED <= self.seed <= MAX_SEED),
             f"seed must be an integer in [-2**63, 2**63 - 1], got {self.seed!r}"),
            (self.cache_salt is None or (isinstance(self.cache_salt, str) and self.cache_salt != ""),
             "cache_salt must be a non-empty string (leave it out for the shared cache)"),
            (self.logit_bias is None or (len(self.logit_bias) <= MAX_LOGIT_BIAS and all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 and isinstance(b, (int, float))
                and not isinstance(b, bool) and math.isfinite(b) and -100.0 <= b <= 100.0
                for t, b in self.logit_bias.items())),
             f"logit_bias maps at most {MAX_LOGIT_BIAS} token ids (non-negative integers) to biases in [-100, 100]"),
            (self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
             "structured_outputs must be a StructuredOutputsParams"),
            (self.structured_outputs is None or self.min_tokens == 0,
             "min_tokens cannot be combined with structured_outputs: the grammar decides where the output ends"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def stop_tokens_banned(self, num_output_tokens: int) -> bool:
        """Before min_tokens, eos and stop_token_ids may not be sampled (nor end the request)."""
        return num_output_tokens < self.min_tokens

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def stop_strings(self) -> list[str]:
        return self._stop

    @property
    def adjusts_logits(self) -> bool:
        """Penalties, the eos ban before min_tokens, or a logit bias change the logits before sampling."""
        return self.has_penalties or self.min_tokens > 0 or bool(self.logit_bias)

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)
