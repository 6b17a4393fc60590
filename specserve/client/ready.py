"""Wait for a server to be ready: poll `GET /health` until it answers 200 (it answers 503 while the
model loads and warms up)."""
from __future__ import annotations

import time
from collections.abc import Callable

import httpx


def wait_until_ready(base_url: str, timeout: float = 120.0, *, alive: Callable[[], bool] | None = None,
                     interval: float = 0.2, verify: bool | str = True) -> bool:
    """Poll `base_url`/health until it answers 200: True. False as soon as `alive()` (e.g. "is the
    server process still running?") says no; TimeoutError after `timeout` seconds. `verify`: httpx's
    TLS verification (False for a self-signed certificate)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(base_url.rstrip("/") + "/health", timeout=5, verify=verify).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        if alive is not None and not alive():
            return False
        if time.monotonic() > deadline:
            raise TimeoutError(f"{base_url} was not ready within {timeout:g}s")
        time.sleep(interval)
