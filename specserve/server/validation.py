"""Input rules shared by the WebSocket and the HTTP front ends, applied before a request reaches the
engine: one JSON decoder, one set of chat roles, one set of sampling-field ranges, one size cap.

- JSON: only what RFC 8259 allows (no NaN / Infinity literals, no number that overflows to inf),
  integers up to Python's 4,300-digit limit, and text that is valid Unicode (a lone UTF-16
  surrogate such as "\\ud800" cannot be tokenized, stored or echoed back): refused with the path of
  the offending value.
- Sampling fields: the same pydantic field types in both protocols (`Temperature`, `Seed`, ...);
  `SamplingParams` checks the same ranges again for offline callers.
- Size: at most `max_prompts_per_request` prompts and `max_sequences_per_request` sequences
  (prompts x n) in one request, so one request cannot occupy the engine for everyone.
"""
from __future__ import annotations

import json
import math
from typing import Annotated, Any

from pydantic import Field

from specserve.sampling_params import MAX_SEED, MIN_SEED, SamplingParams

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_N = 16
MAX_STOP_STRINGS = 16
MAX_SALT_LENGTH = 256

# pydantic field types used by both protocols (NaN / inf refused everywhere)
Temperature = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
TopK = Annotated[int, Field(ge=-1)]
MinP = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]
RepetitionPenalty = Annotated[float, Field(gt=0.0, le=2.0, allow_inf_nan=False)]
Seed = Annotated[int, Field(ge=MIN_SEED, le=MAX_SEED)]
NumSamples = Annotated[int, Field(ge=1, le=MAX_N)]
MaxTokens = Annotated[int, Field(ge=1)]
CacheSalt = Annotated[str, Field(min_length=1, max_length=MAX_SALT_LENGTH)]


def template_role(role: str) -> str:
    """The role a chat template gets: OpenAI's newer "developer" means what templates call "system"."""
    return "system" if role == "developer" else role


def is_json_content_type(content_type: str | None) -> bool:
    """application/json or application/*+json (parameters such as charset allowed). Anything else is
    refused: a browser page may POST text/plain or form bodies to any address without asking first."""
    if not content_type:
        return False
    mime = content_type.split(";", 1)[0].strip().lower()
    return mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json"))


class InputError(ValueError):
    """Input the server refuses before it reaches the engine: 400 / an `error` event."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:32]} is too large")
    return value


def parse_json_object(data: str | bytes) -> dict[str, Any]:
    """Decode one JSON object under the rules above, or raise InputError saying what is wrong."""
    try:
        obj = json.loads(data, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError:
        raise InputError("invalid_json", "the JSON is nested too deeply") from None
    except UnicodeDecodeError as e:
        raise InputError("invalid_json", f"the body is not UTF-8: {e}") from None
    except ValueError as e:  # JSONDecodeError, the int-digits limit, NaN / Infinity / overflow
        raise InputError("invalid_json", f"not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise InputError("invalid_json", "expected a JSON object")
    path = find_invalid_text(obj)
    if path is not None:
        raise InputError("invalid_text", f"{path or 'a key'}: the text holds a lone UTF-16 surrogate, "
                         "which is not valid Unicode", param=path.split(".", 1)[0] or None)
    return obj


def find_invalid_text(obj: Any, path: str = "") -> str | None:
    """The dotted path of the first string (or key) that is not valid Unicode, else None."""
    stack = [(obj, path)]
    while stack:
        value, where = stack.pop()
        if isinstance(value, str):
            if not _encodable(value):
                return where
        elif isinstance(value, dict):
            for k, v in value.items():
                key_path = f"{where}.{k}" if where else str(k)
                if not _encodable(k):
                    return where
                stack.append((v, key_path))
        elif isinstance(value, list):
            stack.extend((v, f"{where}.{i}") for i, v in enumerate(value))
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def to_sampling_params(defaults: dict | None = None, **fields: Any) -> SamplingParams:
    """The one mapping from a request's sampling fields (either protocol, in SamplingParams' names) to
    SamplingParams. A field given as None takes the model's default (`defaults`: ModelInfo's
    sampling_defaults, from its generation config) if it has one, else SamplingParams' own, except
    max_tokens (None = up to the context length). Values SamplingParams refuses raise InputError
    `invalid_parameter`."""
    given = dict(defaults or {})
    given.update({k: v for k, v in fields.items() if v is not None})
    given.setdefault("max_tokens", None)
    try:
        return SamplingParams(**given)
    except (TypeError, ValueError) as e:
        raise InputError("invalid_parameter", str(e)) from None


def check_request_size(num_prompts: int, n: int, max_prompts: int, max_sequences: int) -> None:
    """Refuse a request with more prompts, or more sequences (prompts x n), than the server allows."""
    if num_prompts > max_prompts:
        raise InputError("too_many_prompts", f"the request has {num_prompts} prompts; this server takes at "
                         f"most {max_prompts} per request (--max-prompts-per-request): send several "
                         "requests", param="prompt")
    if num_prompts * n > max_sequences:
        raise InputError("too_many_sequences", f"the request asks for {num_prompts} prompt(s) x n={n} = "
                         f"{num_prompts * n} sequences; this server takes at most {max_sequences} per "
                         "request (--max-sequences-per-request)", param="n")
