"""The WebSocket protocol of `/v1/ws`: one pydantic model per event (shared by server and client).

Event names follow the OpenAI Realtime API. Every frame is one JSON object with a `type`.
Client events are validated strictly (no type coercion, no unknown fields); server events are
what the server sends and what `specserve.client` parses. See docs/server.md for the flow.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from specserve.sampling_params import SamplingParams
from specserve.server.constraints import structured_outputs_from
from specserve.server.validation import (
    MAX_STOP_STRINGS,
    ROLES,
    CacheSalt,
    InputError,
    MaxTokens,
    MinP,
    NumSamples,
    Seed,
    Temperature,
    TopK,
    TopP,
    parse_json_object,
    to_sampling_params,
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Lenient(BaseModel):
    # server events: a newer server may add fields; an older client must not choke on them
    model_config = ConfigDict(extra="allow")


# -- client -> server ----------------------------------------------------------------------------

class ContentPart(_Strict):
    type: Literal["text", "input_text"] = "text"
    text: str


class ChatMessage(_Strict):
    role: Literal[ROLES]
    content: str | list[ContentPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StructuredOutputs(_Strict):
    """A constraint on the output: exactly one field (vLLM's `structured_outputs`; server/constraints.py)."""

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")  # a JSON schema, or its text
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (GBNF syntax: root ::= ...)
    json_object: bool | None = None  # any JSON object


class ResponseParams(_Strict):
    """What to generate: exactly one of `prompt` (text or token ids) and `messages` (chat)."""

    prompt: str | list[Annotated[int, Field(ge=0)]] | None = None
    messages: list[ChatMessage] | None = None
    max_output_tokens: MaxTokens | None = None  # None = up to the context limit
    temperature: Temperature | None = None  # None: the model's default (generation config), else 1.0
    top_p: TopP | None = None  # likewise (1.0)
    top_k: TopK | None = None  # likewise (0: off)
    min_p: MinP | None = None  # likewise (0.0)
    seed: Seed | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    n: NumSamples = 1
    cache_salt: CacheSalt | None = None
    structured_outputs: StructuredOutputs | None = None
    metadata: dict[str, str] | None = None

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of response.prompt and response.messages")
        if self.messages is not None and not self.messages:
            raise ValueError("response.messages is empty")
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")

    def sampling_params(self, defaults: dict | None = None) -> SamplingParams:
        """Raises InputError (`invalid_parameter`) on values SamplingParams refuses. `defaults`: the
        model's sampling defaults (ModelInfo.sampling_defaults) for the fields left out."""
        constraint = None if self.structured_outputs is None else structured_outputs_from(
            structured_outputs=self.structured_outputs.model_dump(by_alias=True, exclude_none=True))
        return to_sampling_params(defaults, n=self.n, temperature=self.temperature, top_p=self.top_p,
                                  top_k=self.top_k, min_p=self.min_p, seed=self.seed, max_tokens=self.max_output_tokens,
                                  stop=self.stop, ignore_eos=self.ignore_eos, cache_salt=self.cache_salt,
                                  structured_outputs=constraint)


class ResponseCreate(_Strict):
    type: Literal["response.create"] = "response.create"
    event_id: str | None = Field(default=None, max_length=128)
    response: ResponseParams


class ResponseCancel(_Strict):
    type: Literal["response.cancel"] = "response.cancel"
    event_id: str | None = Field(default=None, max_length=128)
    response_id: str


class SessionAuth(_Strict):
    """First message of a socket when the server has an API key and no Authorization header came."""

    type: Literal["session.auth"] = "session.auth"
    event_id: str | None = Field(default=None, max_length=128)
    api_key: str


CLIENT_EVENTS: dict[str, type[_Strict]] = {
    "response.create": ResponseCreate, "response.cancel": ResponseCancel, "session.auth": SessionAuth}
ClientEvent = ResponseCreate | ResponseCancel | SessionAuth


class ProtocolError(Exception):
    """A client frame the server refuses; becomes an `error` event (the socket stays open)."""

    def __init__(self, code: str, message: str, event_id: str | None = None,
                 type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.code, self.message, self.event_id, self.type = code, message, event_id, type


def parse_client_event(text: str) -> ClientEvent:
    """Decode and validate one client frame, or raise ProtocolError saying what is wrong."""
    try:
        data = parse_json_object(text)
    except InputError as e:
        code = "invalid_event" if e.message == "expected a JSON object" else e.code
        message = "a frame must be a JSON object with a `type`" if code == "invalid_event" else \
            f"the frame is not accepted: {e.message}"
        raise ProtocolError(code, message) from None
    event_id = data.get("event_id") if isinstance(data.get("event_id"), str) else None
    kind = data.get("type")
    cls = CLIENT_EVENTS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError("unknown_event_type", f"unknown event type {kind!r}; expected one of "
                            f"{', '.join(sorted(CLIENT_EVENTS))}", event_id)
    try:
        event = cls.model_validate(data)
        if isinstance(event, ResponseCreate):
            event.response.check()
    except ValidationError as e:
        raise ProtocolError("invalid_event", format_validation_error(e), event_id) from None
    except ValueError as e:
        raise ProtocolError("invalid_event", str(e), event_id) from None
    return event


def format_validation_error(e: ValidationError, limit: int = 3) -> str:
    """`response.temperature: Input should be a valid number` (first few problems)."""
    parts = []
    for err in e.errors()[:limit]:
        loc = ".".join(str(x) for x in err["loc"] if not str(x).startswith("function-"))
        parts.append(f"{loc}: {err['msg']}" if loc else err["msg"])
    more = len(e.errors()) - limit
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")


# -- server -> client ----------------------------------------------------------------------------

class SpeculativeInfo(_Lenient):
    method: str
    num_speculative_tokens: int
    draft_model: str | None = None


class SessionCreated(_Lenient):
    type: Literal["session.created"] = "session.created"
    session_id: str
    model: str
    max_model_len: int
    speculative: SpeculativeInfo | None = None
    max_frame_size: int
    version: str


class ResponseInfo(_Lenient):
    id: str
    status: Literal["in_progress"] = "in_progress"
    metadata: dict[str, str] | None = None


class ResponseCreated(_Lenient):
    type: Literal["response.created"] = "response.created"
    event_id: str | None = None  # the client's response.create event_id
    response: ResponseInfo


class OutputTextDelta(_Lenient):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    response_id: str
    output_index: int = 0  # which of the n parallel samples
    delta: str
    token_ids: list[int]
    accepted_draft_tokens: int = 0  # verified draft tokens among token_ids


class Usage(_Lenient):
    input_tokens: int
    output_tokens: int
    cached_tokens: int


class SpecMetrics(_Lenient):
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0


class ResponseMetrics(_Lenient):
    ttft_ms: float | None = None
    tokens_per_s: float | None = None  # output tokens / seconds after the first token
    spec: SpecMetrics = Field(default_factory=SpecMetrics)


class OutputItem(_Lenient):
    index: int
    text: str
    finish_reason: str | None = None  # stop | length | abort


Status = Literal["completed", "cancelled", "incomplete", "failed"]


class ErrorInfo(_Lenient):
    type: str
    code: str
    message: str
    event_id: str | None = None
    response_id: str | None = None


class DoneResponse(_Lenient):
    id: str
    status: Status
    output: list[OutputItem] = Field(default_factory=list)
    usage: Usage
    metrics: ResponseMetrics = Field(default_factory=ResponseMetrics)
    metadata: dict[str, str] | None = None
    error: ErrorInfo | None = None  # set when status is failed


class ResponseDone(_Lenient):
    type: Literal["response.done"] = "response.done"
    response: DoneResponse


class ErrorEvent(_Lenient):
    type: Literal["error"] = "error"
    error: ErrorInfo


ServerEvent = Annotated[SessionCreated | ResponseCreated | OutputTextDelta | ResponseDone | ErrorEvent,
                        Field(discriminator="type")]
_SERVER_EVENT = TypeAdapter(ServerEvent)


def parse_server_event(data: str | bytes | dict[str, Any]) -> SessionCreated | ResponseCreated | \
        OutputTextDelta | ResponseDone | ErrorEvent:
    """Parse one server frame (used by the client); raises pydantic.ValidationError if malformed."""
    if isinstance(data, dict):
        return _SERVER_EVENT.validate_python(data)
    return _SERVER_EVENT.validate_json(data)


def error_event(code: str, message: str, *, event_id: str | None = None, response_id: str | None = None,
                type: str = "invalid_request_error") -> ErrorEvent:
    return ErrorEvent(error=ErrorInfo(type=type, code=code, message=message, event_id=event_id,
                                      response_id=response_id))
