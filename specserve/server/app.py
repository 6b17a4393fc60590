"""The Starlette app: routes, middleware, error bodies, and the uvicorn configuration.

`build_app(engine_factory, settings, model_name)` returns an app whose lifespan starts loading the
engine in a background thread; `uvicorn_config(app, settings)` holds the transport limits
(WebSocket frame cap, keep-alive pings) that go with the app's own checks.
"""
from __future__ import annotations

import asyncio
import importlib.util
import logging
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles

from specserve import __version__
from specserve.server.metrics import CONTENT_TYPE
from specserve.server.openai import openai_routes, tokenizer_routes
from specserve.server.security import ApiKeyMiddleware, TrustedHostMiddleware, error_body
from specserve.server.settings import ServerSettings
from specserve.server.state import EngineFactory, ServerState
from specserve.server.ws import websocket_endpoint

logger = logging.getLogger(__name__)


def web_dir() -> Path:
    """The browser demo's folder: the installed `specserve.web` package, else the repo's web/."""
    spec = importlib.util.find_spec("specserve.web")
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (Path(location) / "index.html").is_file():
            return Path(location)
    return Path(__file__).resolve().parents[2] / "web"


async def health(request: Request) -> Response:
    state: ServerState = request.app.state.server
    phase = state.current_phase
    if phase == "ready":
        return JSONResponse({"status": "ok", "model": state.model_name})
    body = {"status": phase, "model": state.model_name}
    if state.error:
        body["error"] = state.error
    return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})


async def version(request: Request) -> Response:
    return JSONResponse({"version": __version__})


async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.server
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


async def index(request: Request) -> Response:
    page = web_dir() / "index.html"
    if not page.is_file():
        return JSONResponse(error_body("the web demo is not installed", "not_found_error"), status_code=404)
    return FileResponse(page, headers={"Cache-Control": "no-cache"})


async def http_error(request: Request, exc: HTTPException) -> Response:
    kinds = {404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error"}
    body = error_body(exc.detail or "error", kinds.get(exc.status_code, "invalid_request_error"))
    return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))


async def server_error(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled error on %s", request.url.path)
    return JSONResponse(error_body("internal server error", "server_error"), status_code=500)


def build_app(engine_factory: EngineFactory, settings: ServerSettings | None = None,
              model_name: str = "model", on_load_error: Callable[[BaseException], None] | None = None,
              on_ready: Callable[[], None] | None = None, load_before_serving: bool = False) -> Starlette:
    """A Starlette app serving `engine_factory()`'s engine (built in a background thread at startup).

    `on_load_error(exc)` / `on_ready()` are called from the loader thread when building the engine
    fails (the CLI stops the server) / succeeds. `load_before_serving`: the startup waits for the
    engine, so uvicorn accepts no connection before it (a server process attaching to an engine
    core that is already loaded, beside others on one socket: a connection it took while attaching
    would be answered 503 although the others serve).
    """
    settings = settings or ServerSettings()
    if settings.enable_log_requests:  # the request lines are INFO records, whatever --log-level says
        logging.getLogger("specserve.server.streaming").setLevel(logging.INFO)
    state = ServerState(settings, model_name, engine_factory, on_load_error, on_ready)

    @asynccontextmanager
    async def lifespan(app: Starlette):
        state.start_loading()
        if load_before_serving:
            await asyncio.to_thread(state.wait_loaded)
        try:
            yield
        finally:
            state.shutdown()

    routes = [
        Route("/", index),
        Route("/health", health),
        Route("/version", version),
        Route("/metrics", metrics),
        WebSocketRoute("/v1/ws", websocket_endpoint),
        *openai_routes(),
        *tokenizer_routes(),
    ]
    static = web_dir()
    if static.is_dir():
        routes.append(Mount("/static", StaticFiles(directory=static), name="static"))
    middleware = [Middleware(TrustedHostMiddleware, host_names=settings.host_names),
                  Middleware(ApiKeyMiddleware, api_key=settings.api_key)]
    if settings.allowed_origins:
        middleware.insert(1, Middleware(CORSMiddleware, allow_origins=settings.allowed_origins,
                                        allow_methods=["GET", "POST"],
                                        allow_headers=["authorization", "content-type"]))
    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan,
                    exception_handlers={HTTPException: http_error, Exception: server_error})
    app.state.server = state
    return app


def uvicorn_config(app: Starlette, settings: ServerSettings, log_level: str = "warning") -> uvicorn.Config:
    """uvicorn settings that go with the app: frames above `hard_frame_limit` close the socket (1009);
    frames between `max_frame_size` and that cap get an `error` event from the app."""
    level = (settings.uvicorn_log_level or log_level).lower()
    return uvicorn.Config(app, host=settings.host, port=settings.port, ws="websockets-sansio",
                          ws_max_size=settings.hard_frame_limit, ws_ping_interval=20.0, ws_ping_timeout=20.0,
                          lifespan="on", log_level=level, access_log=level in ("debug", "trace", "info"),
                          timeout_graceful_shutdown=5, root_path=settings.root_path,
                          ssl_keyfile=settings.ssl_keyfile, ssl_certfile=settings.ssl_certfile)
