"""The one exception the client raises."""
from __future__ import annotations


class SpecserveError(Exception):
    """A server `error` event, a failed response, or a transport problem.

    `code` is machine-readable: the server's error codes (invalid_event, context_length_exceeded,
    invalid_api_key, model_not_ready, ...) or the client's own: connection_failed, connection_closed,
    timeout.
    """

    def __init__(self, code: str, message: str, *, type: str | None = None, event_id: str | None = None,
                 response_id: str | None = None) -> None:
        super().__init__(f"[{code}] {message}")
        self.code = code
        self.message = message
        self.type = type
        self.event_id = event_id
        self.response_id = response_id

    @classmethod
    def from_info(cls, info) -> SpecserveError:
        """From a protocol ErrorInfo."""
        return cls(info.code, info.message, type=info.type, event_id=info.event_id,
                   response_id=info.response_id)
