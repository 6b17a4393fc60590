"""OpenAI-compatible HTTP routes: /v1/models[/{model}], /v1/completions, /v1/chat/completions, and
vLLM's /tokenize and /detokenize.

Non-streaming answers come when every sample has finished; streaming answers are SSE
(`data: {chunk}` lines, then `data: [DONE]`). A client that disconnects aborts its requests.
Errors use OpenAI's body `{"error": {message, type, param, code}}` with 400 (bad input),
401 (bad key, see security.py), 404 (unknown model or route), 413 (body too large) and
503 (model not loaded yet). Every response carries `X-Request-Id`: the client's, else the answer's
id (`cmpl-…`, `chatcmpl-…`), else a fresh one.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from specserve.engine.async_engine import AsyncEngine, EngineDeadError
from specserve.engine.intake import Prompt, PromptError
from specserve.sampling_params import SamplingParams
from specserve.server.openai_protocol import (
    NO_TOKENIZER,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIError,
    TokenizeRequest,
    chat_logprobs,
    check_request_id,
    completion_logprobs,
    detokenize,
    finish_reason,
    tokenize,
    usage_dict,
)
from specserve.server.protocol import format_validation_error
from specserve.server.state import NotReadyError, ServerState
from specserve.server.streaming import Delta, RequestStream
from specserve.server.tool_calls import ToolCallStream, ToolPlan
from specserve.server.validation import InputError, check_request_size, is_json_content_type, parse_json_object

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.25
REQUEST_ID = "x-request-id"

Endpoint = Callable[[Request], Awaitable[Response]]


def openai_routes() -> list[Route]:
    return [Route("/v1/models", _with_request_id(list_models), methods=["GET"]),
            Route("/v1/models/{model:path}", _with_request_id(retrieve_model), methods=["GET"]),
            Route("/v1/completions", _with_request_id(completions), methods=["POST"]),
            Route("/v1/chat/completions", _with_request_id(chat_completions), methods=["POST"])]


def tokenizer_routes() -> list[Route]:
    """vLLM's /tokenize and /detokenize (outside /v1/; ApiKeyMiddleware guards them too: KEYED_PATHS)."""
    return [Route("/tokenize", _with_request_id(_tokenizer_endpoint(TokenizeRequest, tokenize)), methods=["POST"]),
            Route("/detokenize", _with_request_id(_tokenizer_endpoint(DetokenizeRequest, detokenize)),
                  methods=["POST"])]


def _error_response(e: OpenAIError, request_id: str | None = None) -> JSONResponse:
    headers = dict(e.headers or {}) | ({REQUEST_ID: request_id} if request_id else {})
    return JSONResponse(e.body(), status_code=e.status, headers=headers or None)


def _with_request_id(endpoint: Endpoint) -> Endpoint:
    """`endpoint` whose every response carries X-Request-Id: the client's (400 if malformed), else the one
    the endpoint set (its answer's id), else a fresh one."""
    async def run(request: Request) -> Response:
        given = request.headers.get(REQUEST_ID)
        try:
            if given is not None:
                check_request_id(given)
        except OpenAIError as e:
            response, given = _error_response(e), None
        else:
            response = await endpoint(request)
        if given is not None:
            response.headers[REQUEST_ID] = given
        elif REQUEST_ID not in response.headers:
            response.headers[REQUEST_ID] = ServerState.new_id("req")
        return response
    return run


def _ready(request: Request) -> tuple[ServerState, AsyncEngine]:
    state: ServerState = request.app.state.server
    try:
        return state, state.require_engine()
    except NotReadyError as e:
        raise OpenAIError(503, str(e), type="service_unavailable", code=e.code) from None


async def _read_body(request: Request, model: type[BaseModel], limit: int) -> BaseModel:
    if not is_json_content_type(request.headers.get("content-type")):
        raise OpenAIError(415, "send the body as JSON with 'Content-Type: application/json' (got "
                          f"{request.headers.get('content-type')!r})", code="unsupported_media_type")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise OpenAIError(413, f"the request body is larger than the server's limit of {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise OpenAIError(413, f"the request body is larger than the server's limit of {limit} bytes")
    try:
        data = parse_json_object(bytes(body))
    except InputError as e:
        raise OpenAIError(400, f"the request body is not accepted: {e.message}", code=e.code,
                          param=e.param) from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        loc = e.errors()[0]["loc"] if e.errors() else ()
        raise OpenAIError(400, format_validation_error(e), param=str(loc[0]) if loc else None) from None


def _check_model(state: ServerState, name: str | None) -> None:
    if name is not None and name not in state.accepted_model_names:
        raise OpenAIError(404, f"the model {name!r} does not exist; this server serves {state.model_name!r}",
                          type="not_found_error", code="model_not_found", param="model")


def _model_card(state: ServerState, engine: AsyncEngine) -> dict:
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "specserve",
            "root": engine.model_info.model, "max_model_len": engine.model_info.max_model_len}


async def list_models(request: Request) -> Response:
    try:
        state, engine = _ready(request)
    except OpenAIError as e:
        return _error_response(e)
    return JSONResponse({"object": "list", "data": [_model_card(state, engine)]})


async def retrieve_model(request: Request) -> Response:
    """The served model's card for any name it accepts (the listed one, or an --extra-model-names alias)."""
    try:
        state, engine = _ready(request)
        _check_model(state, request.path_params["model"])
    except OpenAIError as e:
        return _error_response(e)
    return JSONResponse(_model_card(state, engine))


def _tokenizer_endpoint(body: type[BaseModel], answer: Callable[..., dict]) -> Endpoint:
    """/tokenize or /detokenize: `answer(tokenizer, request body, model_info)` as JSON."""
    async def run(request: Request) -> Response:
        try:
            state, engine = _ready(request)
            req = await _read_body(request, body, state.settings.max_frame_size)
            _check_model(state, req.model)
            return JSONResponse(answer(engine.tokenizer, req, engine.model_info))
        except OpenAIError as e:
            return _error_response(e)
    return run


async def completions(request: Request) -> Response:
    try:
        state, engine = _ready(request)
        req = await _read_body(request, CompletionRequest, state.settings.max_frame_size)
        _check_model(state, req.model)
        params = _checked_params(engine, req)
        prompts = req.prompts()
        _check_size(state, len(prompts), params.n)
        prompts = [_prompt(engine, p, None) for p in prompts]
        _check_context(engine, prompts, *req.requested_max_tokens())
        echo = [_echo_text(engine, p) for p in prompts] if req.echo else None
    except OpenAIError as e:
        return _error_response(e)
    return await _respond(request, state, engine, req, params, prompts, chat=False, echo=echo)


async def chat_completions(request: Request) -> Response:
    try:
        state, engine = _ready(request)
        req = await _read_body(request, ChatCompletionRequest, state.settings.max_frame_size)
        _check_model(state, req.model)
        tools = _tool_plan(state, req)
        params = _checked_params(engine, req)
        _check_size(state, 1, params.n)
        prompts = [_prompt(engine, None, [m.as_template_message() for m in req.messages],
                           tools.template_tools() if tools is not None else None)]
        _check_context(engine, prompts, *req.requested_max_tokens())
    except OpenAIError as e:
        return _error_response(e)
    return await _respond(request, state, engine, req, params, prompts, chat=True, tools=tools)


def _tool_plan(state: ServerState, req: ChatCompletionRequest) -> ToolPlan | None:
    """The request's tool plan; `auto` needs the server's parser (vLLM's flags and answer)."""
    plan = req.tool_plan()
    s = state.settings
    if plan is not None and plan.kind == "auto" and not (s.enable_auto_tool_choice and s.tool_call_parser):
        raise OpenAIError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                          'to be set (tool_choice "auto" is the default when tools are given; "required", '
                          '"none" and a named function work without them)', param="tool_choice")
    return plan


def _checked_params(engine: AsyncEngine, req) -> SamplingParams:
    params = req.sampling_params(engine.model_info.sampling_defaults)
    try:
        engine.intake.check_params(params)
    except PromptError as e:
        param = "top_logprobs" if e.param == "logprobs" and isinstance(req, ChatCompletionRequest) else e.param
        raise OpenAIError(400, str(e), code=e.code, param=param) from None
    return params


def _check_size(state: ServerState, num_prompts: int, n: int) -> None:
    s = state.settings
    try:
        check_request_size(num_prompts, n, s.max_prompts_per_request, s.max_sequences_per_request)
    except InputError as e:
        raise OpenAIError(400, e.message, code=e.code, param=e.param) from None


def _check_context(engine: AsyncEngine, prompts: list[Prompt], max_tokens: int | None, param: str) -> None:
    """A cap the client chose must fit the context with every prompt (vLLM answers 400, never caps)."""
    if max_tokens is None:
        return
    max_model_len = engine.model_info.max_model_len
    for p in prompts:
        num_prompt = len(p.token_ids)
        if num_prompt + max_tokens > max_model_len:
            raise OpenAIError(400, f"This model's maximum context length is {max_model_len} tokens. However, "
                              f"you requested {num_prompt + max_tokens} tokens ({num_prompt} in the prompt, "
                              f"{max_tokens} in the completion). Please reduce the length of the prompt or "
                              f"{param}.", code="context_length_exceeded", param=param)


def _echo_text(engine: AsyncEngine, prompt: Prompt) -> str:
    """The prompt as `echo` shows it: the text it came as, or its token ids decoded."""
    if prompt.text is not None:
        return prompt.text
    if engine.tokenizer is None:
        raise OpenAIError(400, f"echo needs the prompt's text; {NO_TOKENIZER}", param="echo")
    return engine.tokenizer.decode(prompt.token_ids)


def _prompt(engine: AsyncEngine, prompt, messages, tools: list[dict] | None = None) -> Prompt:
    try:
        return engine.intake.chat(messages, tools) if messages is not None else engine.intake.prompt(prompt)
    except PromptError as e:
        raise OpenAIError(400, str(e), code=e.code, param="messages" if messages else "prompt") from None


class _Answer:
    """Builds the response objects of one completions / chat completions call."""

    def __init__(self, state: ServerState, engine: AsyncEngine, req, n: int, chat: bool,
                 echo: list[str] | None = None, tools: ToolPlan | None = None) -> None:
        self.chat, self.n, self.req = chat, n, req
        self.tools, self.tool_call_parser = tools, state.settings.tool_call_parser
        self.tool_streams: dict[int, ToolCallStream | None] = {}  # per choice: its output through the parser
        self.echo = echo  # per prompt: the text each of its choices starts with
        self.tokenizer = engine.tokenizer
        self.id = state.new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self.model = state.model_name
        self.object = "chat.completion" if chat else "text_completion"
        self.text_offsets: dict[int, int] = {}
        self.k = (req.top_logprobs or 0) if chat else (req.logprobs or 0)
        self.want_logprobs = bool(req.logprobs) if chat else req.logprobs is not None
        # chunks that carry tokens but no text yet are sent when the client reads tokens
        self.want_tokens = self.want_logprobs or req.return_token_ids

    def head(self, choices: list, usage: dict | None = None, chunk: bool = False) -> dict:
        obj = self.object + (".chunk" if chunk and self.chat else "")
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices,
               "system_fingerprint": None}
        if not chunk or self.req.include_usage:
            out["usage"] = usage
        return out

    def logprobs(self, index: int, token_ids: list[int], lps: list[dict[int, float]] | None) -> dict | None:
        if not self.want_logprobs or lps is None:
            return None
        if self.chat:
            return chat_logprobs(self.tokenizer, token_ids, lps, self.k)
        out = completion_logprobs(self.tokenizer, token_ids, lps, self.k, self.text_offsets.get(index, 0))
        self.text_offsets[index] = sum(len(t) for t in out["tokens"]) + self.text_offsets.get(index, 0)
        return out

    def final_choice(self, index: int, text: str, reason: str | None, stop_reason: int | str | None,
                     token_ids, lps) -> dict:
        choice = {"index": index, "finish_reason": finish_reason(reason) or "stop",
                  "logprobs": self.logprobs(index, token_ids, lps), "stop_reason": stop_reason}
        if self.chat:
            stream = self._tool_stream(index)
            choice["message"] = {"role": "assistant", "content": text}
            if stream is not None:
                content, calls = stream.message(text)
                choice["message"]["content"] = content
                if calls:
                    choice["message"]["tool_calls"] = calls
                    choice["finish_reason"] = _with_tool_calls(choice["finish_reason"])
        else:
            choice["text"] = self._echoed(index, text, True)
        if self.req.return_token_ids:
            choice["token_ids"] = list(token_ids)
        return choice

    def delta_choice(self, index: int, d: Delta, first: bool, stop_reason: int | str | None) -> dict | None:
        """The chunk's choice for this delta; None when it has nothing to say (text held by a tool parser)."""
        choice = {"index": index, "finish_reason": finish_reason(d.finish_reason),
                  "logprobs": self.logprobs(index, d.token_ids, d.logprobs), "stop_reason": stop_reason}
        stream = self._tool_stream(index) if self.chat else None
        if stream is not None:
            content, calls = stream.delta(d.text, final=d.finish_reason is not None)
            delta = {"role": "assistant", "content": content or None} if first else \
                ({"content": content} if content else {})
            if calls:
                delta["tool_calls"] = calls
            if not (delta or d.finish_reason or (self.want_tokens and d.token_ids)):
                return None
            choice["delta"] = delta
            if d.finish_reason and stream.called:
                choice["finish_reason"] = _with_tool_calls(choice["finish_reason"])
        elif self.chat:
            choice["delta"] = {"role": "assistant", "content": d.text} if first else {"content": d.text}
        else:
            choice["text"] = self._echoed(index, d.text, first)
        if self.req.return_token_ids:
            choice["token_ids"] = d.token_ids
        return choice

    def _tool_stream(self, index: int) -> ToolCallStream | None:
        if self.tools is None:
            return None
        if index not in self.tool_streams:
            parser = self.tools.parser(self.tool_call_parser)
            self.tool_streams[index] = ToolCallStream(parser, self.tools.parallel) if parser is not None else None
        return self.tool_streams[index]

    def _echoed(self, index: int, text: str, first: bool) -> str:
        return self.echo[index // self.n] + text if self.echo and first else text


def _usage(streams: list[RequestStream]) -> dict:
    completion = sum(len(o.token_ids) for s in streams if s.final for o in s.final.outputs)
    return usage_dict(sum(len(s.prompt_ids) for s in streams), completion,
                      sum(s.num_cached_tokens for s in streams))


def _with_tool_calls(reason: str) -> str:
    """A choice that ended by itself with tool calls ends with "tool_calls" (one cut off stays "length")."""
    return "tool_calls" if reason == "stop" else reason


async def _respond(request: Request, state: ServerState, engine: AsyncEngine, req, params,
                   prompts: list[Prompt], chat: bool, echo: list[str] | None = None,
                   tools: ToolPlan | None = None) -> Response:
    answer = _Answer(state, engine, req, params.n, chat, echo, tools)
    streams = [RequestStream(engine, state.metrics, ids, params, f"{answer.id}-{k}", owner=answer.id,
                             log=state.settings.enable_log_requests) for k, ids in enumerate(prompts)]
    if req.stream:
        return StreamingResponse(_sse(answer, streams), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                          REQUEST_ID: answer.id})

    async def drain(s: RequestStream) -> None:
        async for _ in s.deltas():
            pass

    tasks = [asyncio.create_task(drain(s)) for s in streams]
    work = asyncio.ensure_future(asyncio.gather(*tasks))
    try:
        if not await _until_disconnect(request, work):
            return Response(status_code=499)  # nobody is listening; the requests were aborted
        await work
    except Exception as e:  # engine failure: 500 (503 if the engine is gone), the server goes on
        logger.warning("request %s failed: %s", answer.id, e)
        return _error_response(_generation_error(e), answer.id)
    finally:
        for t in tasks:  # after a failure (or a disconnect) the other samples stop too
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(work, return_exceptions=True)  # its outcome is known: retrieve it
    choices = []
    for k, s in enumerate(streams):
        for o in s.final.outputs:
            choices.append(answer.final_choice(k * params.n + o.index, o.text, o.finish_reason, o.stop_reason,
                                               o.token_ids, o.logprobs))
    return JSONResponse(answer.head(choices, _usage(streams)), headers={REQUEST_ID: answer.id})


def _generation_error(e: Exception) -> OpenAIError:
    if isinstance(e, EngineDeadError):
        return OpenAIError(503, f"generation failed: {e}", type="service_unavailable", code="engine_dead")
    return OpenAIError(500, f"generation failed: {e}", type="server_error")


async def _until_disconnect(request: Request, work: asyncio.Future) -> bool:
    """Wait for `work`; if the client goes away first, cancel it and return False."""
    while True:
        done, _ = await asyncio.wait({work}, timeout=DISCONNECT_POLL_S)
        if done:
            return True
        if await request.is_disconnected():
            return False


def _sse_line(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _sse(answer: _Answer, streams: list[RequestStream]) -> AsyncIterator[str]:
    """Chunks of all streams as they come; usage last (if asked), then [DONE]."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(k: int, s: RequestStream) -> None:
        try:
            async for step in s.deltas():
                queue.put_nowait((k, step))
            queue.put_nowait((k, None))
        except Exception as e:  # reported in the stream
            queue.put_nowait((k, e))

    tasks = [asyncio.create_task(pump(k, s)) for k, s in enumerate(streams)]
    started: set[int] = set()
    continuous = bool(answer.req.stream_options and answer.req.stream_options.continuous_usage_stats)
    try:
        remaining = len(tasks)
        while remaining:
            k, item = await queue.get()
            if item is None:
                remaining -= 1
                continue
            if isinstance(item, Exception):
                logger.warning("stream %s failed: %s", answer.id, item)
                yield _sse_line(_generation_error(item).body())
                break
            choices = []
            for d in item:
                index = k * answer.n + d.index
                first = index not in started
                if not (d.text or d.finish_reason or first or (answer.want_tokens and d.token_ids)):
                    continue  # tokens whose text is held back (a partial character or stop string)
                started.add(index)
                # a finished sample's stop_reason is settled in every later output of its stream
                stop_reason = streams[k].final.outputs[d.index].stop_reason if d.finish_reason else None
                choice = answer.delta_choice(index, d, first, stop_reason)
                if choice is not None:
                    choices.append(choice)
            if choices:
                usage = _usage(streams) if continuous and answer.req.include_usage else None
                yield _sse_line(answer.head(choices, usage, chunk=True))
        else:
            if answer.req.include_usage:
                yield _sse_line(answer.head([], _usage(streams), chunk=True))
        yield "data: [DONE]\n\n"
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
