"""What one server process holds: settings, metrics, and the engine, loaded in a background thread.

uvicorn starts listening first; the engine loads in a thread so `/health` can answer 503 (loading)
and then 200 (ready), and a failed load is reported rather than hidden.
"""
from __future__ import annotations

import gc
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Literal

from specserve.engine.async_engine import AsyncEngine
from specserve.server.metrics import ServerMetrics
from specserve.server.settings import ServerSettings

logger = logging.getLogger(__name__)

EngineFactory = Callable[[], AsyncEngine]
Phase = Literal["loading", "ready", "failed", "dead", "stopped"]


class NotReadyError(Exception):
    """No engine to serve with: HTTP 503 and `code` — `model_not_ready` (still loading, or loading
    failed) or `engine_dead` (the engine core died)."""

    def __init__(self, message: str, code: str = "model_not_ready") -> None:
        super().__init__(message)
        self.code = code


class ServerState:
    def __init__(self, settings: ServerSettings, model_name: str, engine_factory: EngineFactory,
                 on_load_error: Callable[[BaseException], None] | None = None,
                 on_ready: Callable[[], None] | None = None) -> None:
        self.settings = settings
        self.model_name = model_name
        self.accepted_model_names = {model_name, *settings.extra_model_names}
        self.engine: AsyncEngine | None = None
        self.phase: Phase = "loading"
        self.load_error: str | None = None
        self.created = int(time.time())
        self.metrics = ServerMetrics(model_name, self._stats)
        self._factory = engine_factory
        self._on_load_error = on_load_error
        self._on_ready = on_ready
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    def start_loading(self) -> None:
        """Build the engine in a daemon thread (idempotent)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._load, name="specserve-load", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        t0 = time.perf_counter()
        try:
            engine = self._factory()
        except BaseException as e:  # any load failure must reach /health and the CLI
            self.load_error = f"{type(e).__name__}: {e}"
            self.phase = "failed"
            logger.error("loading the engine failed: %s", self.load_error)
            if self._on_load_error is not None:
                self._on_load_error(e)
            return
        if self.phase == "stopped":  # the server went away while we loaded
            engine.shutdown()
            return
        self.engine = engine
        # the process's long-lived objects (the engine's, the tokenizer's, the modules') stay out of the
        # collector's scans: a full collection then takes milliseconds, not a stall of every stream
        gc.collect()
        gc.freeze()
        self.phase = "ready"
        logger.info("engine ready in %.1fs: %s (max_model_len %d)", time.perf_counter() - t0,
                    self.model_name, engine.model_info.max_model_len)
        if self._on_ready is not None:
            self._on_ready()

    def wait_loaded(self, timeout: float | None = None) -> bool:
        if self._thread is not None:
            self._thread.join(timeout)
        return self.phase == "ready"

    def shutdown(self) -> None:
        self.phase = "stopped"
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.shutdown()

    # -- access ----------------------------------------------------------------------------------
    @property
    def current_phase(self) -> Phase:
        """The phase, "dead" once the engine core died while serving."""
        engine = self.engine
        if self.phase == "ready" and engine is not None and engine.dead is not None:
            return "dead"
        return self.phase

    @property
    def error(self) -> str | None:
        """Why the server cannot serve: the load error, or how the engine core died."""
        engine = self.engine
        if engine is not None and engine.dead is not None and self.phase == "ready":
            return engine.dead
        return self.load_error

    def require_engine(self) -> AsyncEngine:
        engine = self.engine
        if engine is not None and self.phase == "ready" and engine.dead is not None:
            raise NotReadyError(f"the engine is gone: {engine.dead}", code="engine_dead")
        if engine is None or self.phase != "ready":
            if self.phase == "failed":
                raise NotReadyError(f"the model failed to load: {self.load_error}")
            raise NotReadyError("the model is still loading; retry shortly")
        return engine

    def _stats(self) -> dict | None:
        engine = self.engine
        return engine.stats() if engine is not None else None

    @staticmethod
    def new_id(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex[:16]}"

    def speculative_info(self) -> dict | None:
        engine = self.engine
        return engine.model_info.speculative if engine is not None else None
