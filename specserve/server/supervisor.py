"""`specserve serve --api-server-count N` (N > 1): N server processes in front of one engine core.

One server process's event loop (HTTP parsing, JSON, WebSocket frames, detokenization) can saturate
before the engine does. With N > 1 this process becomes a supervisor: it binds the listening socket,
starts the engine core (engine/core_process.py) with one output socket per server, and starts N
server processes that share the listening socket (the kernel spreads connections over them) and
attach to the core, each before it accepts a connection (a request never meets one still attaching:
it waits in the socket's backlog instead of getting 503). It serves nothing itself; it waits.

- SIGTERM / SIGINT (Ctrl-C reaches every process of the group): each server stops accepting and
  finishes or cancels what it has in flight (uvicorn's graceful shutdown, 5 s); then the core stops;
  every child is reaped; exit 0.
- The engine core dies: every server ends its streams with `engine_dead`, answers /health with 503
  and exits; the supervisor reaps them and exits 1 (a service manager restarts it).
- A server process dies: the others and the core are stopped; exit 1.

Metrics: each server process counts the requests it served (/metrics answers from whichever process
took the connection); the engine's gauges (KV usage, queue lengths) come from the core and are the
same in every process.
"""
from __future__ import annotations

import logging
import signal
import socket
import sys
from multiprocessing import connection, get_context

from specserve.config import EngineConfig
from specserve.server.settings import ServerSettings

logger = logging.getLogger(__name__)

SERVER_STOP_TIMEOUT_S = 15.0


class _Stop(Exception):
    pass


def _raise_stop(*_) -> None:
    raise _Stop


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve_many(config: EngineConfig, settings: ServerSettings, name: str, num_servers: int,
               log_level: str) -> int:
    """Run the supervisor until stopped; returns the exit code."""
    from specserve.engine.core_process import CoreProcess
    from specserve.utils import exit_reason

    sock = _listen(settings.host, settings.port)
    print(f"specserve: serving {name} on {settings.url} with {num_servers} server "
          "processes (loading the model...)", file=sys.stderr, flush=True)
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)
    core = servers = None
    code = 0
    try:
        core = CoreProcess(config, log_level=log_level, num_clients=num_servers)
        ctx = get_context("spawn")
        servers = [ctx.Process(target=run_server, name=f"specserve-api-{i}",
                               args=(core.handle(i), settings, name, sock, log_level)) for i in range(num_servers)]
        for p in servers:
            p.start()
        warm = core.ready["warmup_seconds"]
        print(f"specserve: {name} is ready (engine core pid {core.process.pid}, {num_servers} server processes"
              + (f", warm-up {warm:.1f}s" if warm else "") + ")", file=sys.stderr, flush=True)
        ready = connection.wait([core.process.sentinel, *(p.sentinel for p in servers)])
        if core.process.sentinel in ready:
            core.process.join()
            print(f"specserve: error: the engine process {exit_reason(core.process.exitcode)}; stopping",
                  file=sys.stderr, flush=True)
        else:
            gone = next(p for p in servers if p.sentinel in ready)
            gone.join()
            print(f"specserve: error: server process {gone.name} {exit_reason(gone.exitcode)}; stopping",
                  file=sys.stderr, flush=True)
        code = 1
    except _Stop:
        pass
    except RuntimeError as e:  # the core failed to load
        print(f"specserve: error: loading the model failed: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _stop_servers(servers or [])
        if core is not None:
            core.shutdown()
        sock.close()
    print("specserve: stopped", file=sys.stderr, flush=True)
    return code


def _stop_servers(servers) -> None:
    for p in servers:
        if p.is_alive():
            p.terminate()  # SIGTERM: graceful
    for p in servers:
        p.join(SERVER_STOP_TIMEOUT_S)
        if p.is_alive():
            p.kill()
            p.join(5)


def run_server(handle, settings: ServerSettings, name: str, sock: socket.socket, log_level: str) -> None:
    """One server process: uvicorn on the shared socket, its AsyncEngine attached to the core."""
    import uvicorn

    from specserve.engine.async_engine import AsyncEngine
    from specserve.server.app import build_app, uvicorn_config

    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.WARNING))
    failed: list[object] = []
    server: uvicorn.Server | None = None

    def stop(reason) -> None:
        failed.append(reason)
        if server is not None:
            server.should_exit = True

    # the model is loaded (by the core): attach before accepting, so no connection this process takes
    # meets a server still attaching (503) while the others serve
    app = build_app(lambda: AsyncEngine(handle, on_dead=stop), settings, name, on_load_error=stop,
                    load_before_serving=True)
    server = uvicorn.Server(uvicorn_config(app, settings, log_level))
    signal.signal(signal.SIGTERM, lambda *_: setattr(server, "should_exit", True))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    sys.exit(1 if failed else 0)
