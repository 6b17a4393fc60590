"""Python client for specserve's WebSocket protocol (`WS /v1/ws`): `AsyncClient`, `Client`; and
`wait_until_ready` (poll /health)."""
from specserve.client.async_client import AsyncClient, AsyncResponseStream
from specserve.client.errors import SpecserveError
from specserve.client.ready import wait_until_ready
from specserve.client.sync_client import Client, ResponseStream
from specserve.server.protocol import (
    DoneResponse,
    ErrorEvent,
    OutputTextDelta,
    ResponseCreated,
    ResponseDone,
    SessionCreated,
)

__all__ = [
    "AsyncClient",
    "AsyncResponseStream",
    "Client",
    "DoneResponse",
    "ErrorEvent",
    "OutputTextDelta",
    "ResponseCreated",
    "ResponseDone",
    "ResponseStream",
    "SessionCreated",
    "SpecserveError",
    "wait_until_ready",
]
