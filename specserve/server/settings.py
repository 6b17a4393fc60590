"""Server settings (the non-engine flags of `specserve serve`) and the default model's served name."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

from specserve.server.tool_parsers import PARSERS

DEFAULT_MAX_FRAME_SIZE = 1 << 20  # 1 MiB: far above any sane prompt frame, far below memory trouble
# The transport closes a socket (code 1009) on frames above this multiple of max_frame_size; frames
# between max_frame_size and that cap are answered with an `error` event and the socket stays open.
HARD_FRAME_FACTOR = 4
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# One request may not hold more than this many prompts / sequences (prompts x n): a bigger one would
# occupy the engine for everyone; clients that need more send several requests.
DEFAULT_MAX_PROMPTS_PER_REQUEST = 256
DEFAULT_MAX_SEQUENCES_PER_REQUEST = 256


@dataclass
class ServerSettings:
    """How the server listens and whom it lets in.

    `allowed_hosts`: Host names answered besides the loopback names and the bound address; ["*"] =
    any (security.py: DNS rebinding). `allowed_origins`: WebSocket Origins accepted besides those whose
    host is an allowed host; ["*"] = any. Requests without an Origin header (non-browser clients) are
    accepted. `max_prompts_per_request` / `max_sequences_per_request` cap one request's prompts and
    prompts x n (a clear 400 above them).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    allowed_origins: list[str] | None = None
    allowed_hosts: list[str] | None = None
    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST
    max_sequences_per_request: int = DEFAULT_MAX_SEQUENCES_PER_REQUEST
    ws_send_timeout: float = 30.0  # seconds a WebSocket send may wait on a client that does not read
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
    served_model_name: str | None = None
    extra_model_names: list[str] = field(default_factory=list)  # also accepted in the `model` field
    root_path: str = ""  # the path prefix a proxy serves this under (ASGI root_path)
    ssl_keyfile: str | None = None  # HTTPS / WSS with both
    ssl_certfile: str | None = None
    uvicorn_log_level: str | None = None  # uvicorn's own logs (default: the CLI's --log-level)
    # tool_choice "auto": parse tool calls out of the model's text with this parser (vLLM's flags)
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None  # server/tool_parsers.py: PARSERS
    enable_log_requests: bool = False  # one log line per finished request (server/streaming.py)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.max_frame_size < 1024:
            raise ValueError(f"max_frame_size must be at least 1024 bytes, got {self.max_frame_size}")
        for name in ("max_prompts_per_request", "max_sequences_per_request"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("--ssl-keyfile and --ssl-certfile go together")
        for name in ("ssl_keyfile", "ssl_certfile"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{name.replace('_', '-')} {path}: no such file")
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ValueError(f"tool_call_parser {self.tool_call_parser!r} is not one of {', '.join(PARSERS)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (the format the model writes "
                             f"tool calls in: {', '.join(PARSERS)})")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty (leave it out to disable authentication)")

    @functools.cached_property
    def host_names(self) -> frozenset[str]:
        from specserve.server.security import allowed_host_names
        return allowed_host_names(self.host, self.allowed_hosts)

    @property
    def url(self) -> str:
        scheme = "https" if self.ssl_certfile else "http"
        return f"{scheme}://{self.host}:{self.port}{self.root_path}"

    @property
    def hard_frame_limit(self) -> int:
        return self.max_frame_size * HARD_FRAME_FACTOR


def served_name_for(model: str | None, served_model_name: str | None = None) -> str:
    """The name clients use in `model`: the explicit one, else the model argument as given."""
    if served_model_name:
        return served_model_name
    if model is None:
        return DEFAULT_MODEL_NAME
    return model.rstrip("/") or model


def model_aliases(model: str | None) -> list[str]:
    """Other names accepted for the served model: the path, and its last component."""
    if model is None:
        return [DEFAULT_MODEL_NAME]
    return sorted({model, Path(model).name})
