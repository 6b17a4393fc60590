"""`WS /v1/ws`: the specserve event protocol, many responses multiplexed on one socket.

One asyncio task per response; all sends go through one lock so frames never interleave.
A bad frame is answered with an `error` event and the socket stays open. A client that stops reading
holds no engine work and no growing buffer: each response keeps only its newest output, and a send
that cannot go out for `ws_send_timeout` seconds ends the session (close code 1008, its responses
cancelled and their KV freed). Cancelling a response
(`response.cancel`) or closing the socket cancels its tasks, which closes their engine streams:
the engine aborts those requests and frees their KV blocks before its next step.
"""
from __future__ import annotations

import asyncio
import logging
import sys
from contextlib import aclosing

from starlette.responses import JSONResponse
from starlette.websockets import WebSocket, WebSocketDisconnect

from specserve import __version__
from specserve.server.protocol import (
    DoneResponse,
    ErrorInfo,
    OutputItem,
    OutputTextDelta,
    ProtocolError,
    ResponseCancel,
    ResponseCreate,
    ResponseCreated,
    ResponseDone,
    ResponseInfo,
    ResponseMetrics,
    SessionAuth,
    SessionCreated,
    SpecMetrics,
    Usage,
    error_event,
    parse_client_event,
)
from specserve.server.security import api_key_matches, bearer_token, error_body, origin_allowed
from specserve.server.state import NotReadyError, ServerState
from specserve.engine.async_engine import EngineDeadError
from specserve.engine.intake import PromptError
from specserve.server.streaming import RequestStream
from specserve.server.validation import InputError, check_request_size, template_role

logger = logging.getLogger(__name__)

AUTH_TIMEOUT_S = 10.0
MAX_RESPONSES_PER_SOCKET = 256
CLOSE_POLICY_VIOLATION = 1008
CLOSE_TRY_AGAIN_LATER = 1013


def _uncancel() -> None:
    """A CancelledError we handled: clear the task's pending-cancel count (Python >= 3.11) so later
    awaits and timeouts in the task behave normally."""
    task = asyncio.current_task()
    if task is not None and sys.version_info >= (3, 11):
        task.uncancel()


class _Closed(Exception):
    """The socket is gone; stop sending."""


async def websocket_endpoint(websocket: WebSocket) -> None:
    state: ServerState = websocket.app.state.server
    settings = state.settings
    server_port = (websocket.scope.get("server") or (None, None))[1]
    if not origin_allowed(websocket.headers.get("origin"), settings.host_names, settings.allowed_origins,
                          server_port):
        logger.warning("refused a WebSocket from origin %r", websocket.headers.get("origin"))
        await _deny(websocket, 403, "this Origin is not allowed (see --allowed-origins)",
                    "origin_not_allowed")
        return
    authed = settings.api_key is None
    header = websocket.headers.get("authorization")
    if not authed and header is not None:
        if not api_key_matches(bearer_token(header), settings.api_key):
            await _deny(websocket, 401, "incorrect API key", "invalid_api_key")
            return
        authed = True
    await websocket.accept()
    session = Session(websocket, state)
    try:
        if not authed and not await session.authenticate():
            return
        await session.run()
    finally:
        await session.close()


async def _deny(websocket: WebSocket, status: int, message: str, code: str) -> None:
    """Refuse the handshake with an HTTP response (or a plain close where that is unsupported)."""
    kind = "authentication_error" if status == 401 else "permission_error"
    try:
        body = error_body(message, kind, code)
        await websocket.send_denial_response(JSONResponse(body, status_code=status))
    except RuntimeError:  # the ASGI server lacks the websocket.http.response extension
        await websocket.close(CLOSE_POLICY_VIOLATION)


class Session:
    """One socket: reads client events, runs a task per response, writes server events."""

    def __init__(self, websocket: WebSocket, state: ServerState) -> None:
        self.ws = websocket
        self.state = state
        self.session_id = state.new_id("sess")
        self.tasks: dict[str, asyncio.Task] = {}
        self._send_lock = asyncio.Lock()
        self._started: set[str] = set()
        self._cancel_early: set[str] = set()
        self._reader: asyncio.Task | None = None  # the task running run(): cancelled for a slow reader
        self.closed = False

    async def send(self, event) -> None:
        if self.closed:
            raise _Closed
        data = event.model_dump_json()
        async with self._send_lock:
            if self.closed:
                raise _Closed
            try:
                await self._send_within_timeout(data)
            except asyncio.TimeoutError:
                await self._drop_slow_reader()
                raise _Closed from None
            except Exception as e:  # disconnects surface as several exception types
                self.closed = True
                raise _Closed from e

    async def _send_within_timeout(self, data: str) -> None:
        timeout = self.state.settings.ws_send_timeout
        if sys.version_info >= (3, 11):
            # not wait_for: before 3.12 it can swallow a cancel (response.cancel) that lands as the send
            # completes, and the response then runs to its end
            async with asyncio.timeout(timeout):
                await self.ws.send_text(data)
        else:
            await asyncio.wait_for(self.ws.send_text(data), timeout)

    async def _drop_slow_reader(self) -> None:
        """The client has not read for ws_send_timeout: end the session (its responses are cancelled
        by close()) and try to say why; a full send buffer may keep the close frame from going out."""
        timeout = self.state.settings.ws_send_timeout
        logger.warning("closing session %s: the client read nothing for %.0fs", self.session_id, timeout)
        self.closed = True
        if self._reader is not None:
            self._reader.cancel()
        try:
            await asyncio.wait_for(self.ws.close(CLOSE_POLICY_VIOLATION, "slow_reader: the client did not read "
                                                 f"its messages for {timeout:g}s"), 1.0)
        except Exception:  # noqa: BLE001 - the socket is stuck or gone; the session ends regardless
            pass

    async def send_error(self, code: str, message: str, *, event_id: str | None = None,
                         response_id: str | None = None, type: str = "invalid_request_error") -> None:
        await self.send(error_event(code, message, event_id=event_id, response_id=response_id, type=type))

    async def _receive_text(self) -> str | None:
        """The next text frame; None when the client left. Oversized and binary frames raise
        ProtocolError (the socket stays open)."""
        msg = await self.ws.receive()
        if msg["type"] == "websocket.disconnect":
            self.closed = True
            return None
        text = msg.get("text")
        if text is None:
            raise ProtocolError("invalid_frame", "binary frames are not supported: send JSON text frames")
        limit = self.state.settings.max_frame_size
        if len(text) > limit or (len(text) * 4 > limit and len(text.encode("utf-8")) > limit):
            raise ProtocolError("frame_too_large", f"the frame is larger than the server's limit of "
                                f"{limit} bytes (--max-frame-size)")
        return text

    async def authenticate(self) -> bool:
        """Wait for `session.auth` as the first message; on failure say why and close."""
        try:
            text = await asyncio.wait_for(self._receive_text(), AUTH_TIMEOUT_S)
            event = parse_client_event(text) if text is not None else None
        except (asyncio.TimeoutError, ProtocolError):
            event = None
        if event is None and self.closed:
            return False
        if isinstance(event, SessionAuth) and api_key_matches(event.api_key, self.state.settings.api_key):
            return True
        message = ("incorrect API key" if isinstance(event, SessionAuth) else
                   "this server needs an API key: send 'Authorization: Bearer <key>' or a first message "
                   '{"type": "session.auth", "api_key": "..."}')
        try:
            await self.send_error("invalid_api_key", message, type="authentication_error",
                                  event_id=getattr(event, "event_id", None))
            await self.ws.close(CLOSE_POLICY_VIOLATION)
        except (_Closed, RuntimeError):
            pass
        self.closed = True
        return False

    async def run(self) -> None:
        self._reader = asyncio.current_task()
        try:
            await self._serve()
        except asyncio.CancelledError:
            if not self.closed:  # not ours: the server is stopping
                raise
            _uncancel()

    async def _serve(self) -> None:
        try:
            engine = self.state.require_engine()
        except NotReadyError as e:
            try:
                await self.send_error(e.code, str(e), type="server_error")
                await self.ws.close(CLOSE_TRY_AGAIN_LATER)
            except (_Closed, RuntimeError):
                pass
            self.closed = True
            return
        try:
            await self.send(SessionCreated(session_id=self.session_id, model=self.state.model_name,
                                           max_model_len=engine.model_info.max_model_len,
                                           speculative=self.state.speculative_info(),
                                           max_frame_size=self.state.settings.max_frame_size,
                                           version=__version__))
            while True:
                try:
                    text = await self._receive_text()
                    if text is None:
                        return
                    event = parse_client_event(text)
                    if isinstance(event, ResponseCreate):
                        await self._create(engine, event)
                    elif isinstance(event, ResponseCancel):
                        await self._cancel(event)
                    # session.auth on an authenticated socket: nothing to do
                except ProtocolError as e:
                    await self.send_error(e.code, e.message, event_id=e.event_id, type=e.type)
        except (_Closed, WebSocketDisconnect):
            self.closed = True

    async def _create(self, engine, event: ResponseCreate) -> None:
        r = event.response
        if len(self.tasks) >= MAX_RESPONSES_PER_SOCKET:
            raise ProtocolError("too_many_responses", f"at most {MAX_RESPONSES_PER_SOCKET} responses may "
                                "run at once on one socket", event.event_id)
        s = self.state.settings
        try:
            check_request_size(1, r.n, s.max_prompts_per_request, s.max_sequences_per_request)
            params = r.sampling_params(engine.model_info.sampling_defaults)
            engine.intake.check_params(params)
            if r.messages:
                prompt = engine.intake.chat([{"role": template_role(m.role), "content": m.text()}
                                             for m in r.messages])
            else:
                prompt = engine.intake.prompt(r.prompt)
        except (PromptError, InputError) as e:
            raise ProtocolError(e.code, str(e), event.event_id) from None
        except ValueError as e:
            raise ProtocolError("invalid_parameter", str(e), event.event_id) from None
        response_id = self.state.new_id("resp")
        stream = RequestStream(engine, self.state.metrics, prompt, params, response_id,
                               owner=self.session_id, log=self.state.settings.enable_log_requests)
        await self.send(ResponseCreated(event_id=event.event_id,
                                        response=ResponseInfo(id=response_id, metadata=r.metadata)))
        task = asyncio.create_task(self._respond(stream, r.metadata), name=response_id)
        self.tasks[response_id] = task
        task.add_done_callback(lambda t: self.tasks.pop(response_id, None))

    async def _cancel(self, event: ResponseCancel) -> None:
        task = self.tasks.get(event.response_id)
        if task is None:
            raise ProtocolError("unknown_response_id", f"no response {event.response_id!r} is in progress "
                                "on this socket", event.event_id)
        if event.response_id in self._started:
            task.cancel()
        else:  # a task cancelled before its first step would never run its handlers: flag it instead
            self._cancel_early.add(event.response_id)

    async def _respond(self, stream: RequestStream, metadata: dict[str, str] | None) -> None:
        rid = stream.request_id
        self._started.add(rid)
        try:
            error = await self._stream_deltas(stream)
            done = ResponseDone(response=done_response(stream, metadata, error))
            while True:  # a cancel landing while the done waits for the socket must not lose it
                try:
                    await self.send(done)
                    break
                except asyncio.CancelledError:
                    if self.closed:
                        raise _Closed from None
                    _uncancel()
        except _Closed:
            pass
        finally:
            self._started.discard(rid)
            self._cancel_early.discard(rid)

    async def _stream_deltas(self, stream: RequestStream) -> ErrorInfo | None:
        """Send the response's deltas; returns the error if the engine failed it."""
        rid = stream.request_id
        try:
            if rid in self._cancel_early:
                stream.outcome = "cancelled"
                return None
            async with aclosing(stream.deltas()) as deltas:  # a cancel mid-send still aborts the request
                async for step in deltas:
                    for d in step:
                        await self.send(OutputTextDelta(response_id=rid, output_index=d.index, delta=d.text,
                                                        token_ids=d.token_ids,
                                                        accepted_draft_tokens=d.accepted_draft_tokens))
        except asyncio.CancelledError:
            if self.closed:
                raise _Closed from None
            _uncancel()
        except _Closed:
            raise
        except Exception as e:  # noqa: BLE001 - the engine failed this request; socket and server go on
            logger.warning("response %s failed: %s", rid, e)
            code = "engine_dead" if isinstance(e, EngineDeadError) else "engine_error"
            return ErrorInfo(type="server_error", code=code, message=str(e) or type(e).__name__,
                             response_id=rid)
        return None

    async def close(self) -> None:
        """Cancel whatever still runs (their engine requests are aborted) and wait for them."""
        self.closed = True
        tasks = list(self.tasks.values())
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


def done_response(stream: RequestStream, metadata: dict[str, str] | None,
                  error: ErrorInfo | None = None) -> DoneResponse:
    """The `response.done` payload for a stream that has ended."""
    final = stream.final
    outputs = final.outputs if final is not None else []
    status = "failed" if error is not None else (stream.outcome or "cancelled")
    if status == "failed" and error is None:
        error = ErrorInfo(type="server_error", code="engine_error", message=stream.error or "failed",
                          response_id=stream.request_id)
    ttft = stream.ttft_seconds()
    tpot = stream.decode_seconds_per_token()
    drafts, draft_tokens, accepted = stream.spec_counts()
    return DoneResponse(
        id=stream.request_id, status=status,
        output=[OutputItem(index=o.index, text=o.text, finish_reason=o.finish_reason) for o in outputs],
        usage=Usage(input_tokens=len(stream.prompt_ids), output_tokens=sum(len(o.token_ids) for o in outputs),
                    cached_tokens=stream.num_cached_tokens),
        metrics=ResponseMetrics(ttft_ms=None if ttft is None else round(ttft * 1000, 3),
                                tokens_per_s=None if not tpot else round(1.0 / tpot, 3),
                                spec=SpecMetrics(drafts=drafts, draft_tokens=draft_tokens,
                                                 accepted=accepted)),
        metadata=metadata, error=error)
