"""`specserve serve [MODEL]`: flags, YAML config files and SPECSERVE_* environment variables.

Every flag can come from three places besides its default. Precedence, highest first:
command line > `--config FILE.yaml` (keys = long flag names, dashes or underscores) >
`SPECSERVE_<FLAG>` environment variables (e.g. SPECSERVE_PORT, SPECSERVE_API_KEY,
SPECSERVE_MAX_MODEL_LEN, SPECSERVE_MODEL) > defaults.
"""
from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from specserve.engine_args import add_engine_args, engine_kwargs
from specserve.server.tool_parsers import PARSERS
from specserve.utils import parse_size

logger = logging.getLogger(__name__)

ENV_PREFIX = "SPECSERVE_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_DEFAULTS: dict[str, Any] = {}  # dest -> default, for the flags of `serve`
_ACTIONS: dict[str, argparse.Action] = {}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over WebSocket and OpenAI-compatible HTTP",
                       description="Serve a model: WebSocket protocol on /v1/ws, OpenAI-compatible HTTP on "
                       "/v1/*, a browser chat demo on /, Prometheus metrics on /metrics.",
                       epilog=__doc__.split("\n\n", 1)[1],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None,
                   help="HF model dir or .gguf (default: SmolLM2-135M-Instruct)")
    g = p.add_argument_group("server")
    g.add_argument("--config", default=None, help="YAML file of flags (keys = long flag names)")
    g.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* and the socket")
    g.add_argument("--allowed-origins", default=None,
                   help="comma-separated browser Origins allowed to open the WebSocket besides this "
                        "server's own pages (those on an allowed host); '*' = any")
    g.add_argument("--allowed-hosts", default=None,
                   help="comma-separated Host names answered besides the loopback names and --host "
                        "(DNS-rebinding protection); '*' = any")
    g.add_argument("--max-prompts-per-request", type=int, default=256,
                   help="most prompts one completions request may hold (default 256)")
    g.add_argument("--max-sequences-per-request", type=int, default=256,
                   help="most sequences (prompts x n) one request may hold (default 256)")
    g.add_argument("--max-frame-size", type=parse_size, default=1 << 20,
                   help="largest WebSocket frame / HTTP body accepted, e.g. 1M (default 1 MiB)")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="the name clients use in `model` (more names: also accepted)")
    g.add_argument("--root-path", default="", help="the path prefix a reverse proxy serves this under")
    g.add_argument("--ssl-keyfile", default=None, help="serve HTTPS / WSS with this key (and --ssl-certfile)")
    g.add_argument("--ssl-certfile", default=None)
    g.add_argument("--uvicorn-log-level", default=None,
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's own log level (default: --log-level); info logs every request")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let tool_choice "auto" (the default with tools) parse tool calls out of the text, '
                        "with --tool-call-parser")
    g.add_argument("--tool-call-parser", choices=PARSERS, default=None,
                   help="the format the model writes tool calls in: hermes (<tool_call> tags: Hermes, Qwen2.5, "
                        "templates without tools) or llama3_json (Llama 3.1/3.2 JSON calls)")
    g.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction, default=False,
                   help="log one line per finished request: id, prompt / output tokens, finish reason, "
                        "time to first token, duration (default off, as vLLM)")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="vLLM's older name: requests are not logged (the default)")
    g.add_argument("--api-server-count", type=int, default=None,
                   help="server processes in front of the one engine core process (default: 2 when the "
                        "engine runs on a GPU and the host has 8+ cores, where one event loop cannot keep "
                        "up with a few hundred streams; else 1)")
    add_engine_args(p)
    # Defaults move out of argparse so that "given on the command line" is visible (present in the
    # namespace) and YAML / environment values can slot in between.
    for action in p._actions:  # argparse offers no public way to list its actions
        if action.dest in ("help", "config") or action.default is argparse.SUPPRESS:
            continue
        _DEFAULTS[action.dest] = action.default
        _ACTIONS[action.dest] = action
        action.default = argparse.SUPPRESS
    p.set_defaults(func=cmd_serve)


def _convert(dest: str, value: Any, source: str) -> Any:
    """Type a YAML or environment value the way argparse would type the flag."""
    action = _ACTIONS[dest]
    if action.nargs == 0:  # boolean flags (store_true, --x/--no-x)
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in _TRUE | _FALSE:
            return text in _TRUE
        raise ValueError(f"{source}: {value!r} is not a boolean (true/false)")
    if isinstance(value, str) and action.type is not None:
        try:
            value = action.type(value)
        except (argparse.ArgumentTypeError, ValueError) as e:
            raise ValueError(f"{source}: {e}") from None
    elif isinstance(value, (dict, list)) and dest == "speculative_config":
        pass  # a YAML mapping: build_spec_config takes it as is
    elif isinstance(value, bool) or (action.type is int and not isinstance(value, int)):
        raise ValueError(f"{source}: {value!r} is not a valid value")
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"{source}: {value!r} is not one of {', '.join(map(str, action.choices))}")
    return value


def _from_env(environ: dict[str, str]) -> dict[str, Any]:
    out = {}
    for dest in _DEFAULTS:
        name = ENV_PREFIX + dest.upper()
        if name in environ and environ[name] != "":
            out[dest] = _convert(dest, environ[name], f"environment variable {name}")
    return out


def load_yaml_config(path: str | Path) -> dict[str, Any]:
    """Flags from a YAML mapping whose keys are long flag names."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"cannot read config file {path}: {e}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"config file {path} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must be a mapping of flag names to values")
    out = {}
    for key, value in data.items():
        dest = str(key).lstrip("-").replace("-", "_")
        if dest not in _DEFAULTS:
            known = ", ".join(sorted(d.replace("_", "-") for d in _DEFAULTS))
            raise ValueError(f"config file {path}: unknown key {key!r}; keys are the long flag names of "
                             f"`specserve serve` ({known})")
        out[dest] = None if value is None else _convert(dest, value, f"config file {path}, key {key!r}")
    return out


def resolve_serve_args(args: argparse.Namespace, environ: dict[str, str] | None = None) -> argparse.Namespace:
    """Merge defaults < environment < YAML < command line into one namespace."""
    env = os.environ if environ is None else environ
    values = dict(_DEFAULTS)
    values.update(_from_env(env))
    config = getattr(args, "config", None) or env.get(ENV_PREFIX + "CONFIG") or None
    if config:
        values.update(load_yaml_config(config))
    values.update({k: v for k, v in vars(args).items() if k in _DEFAULTS})
    values["config"] = config
    values["func"] = getattr(args, "func", None)
    values["log_level"] = getattr(args, "log_level", "WARNING")
    return argparse.Namespace(**values)


def _list(value: str | None) -> list[str] | None:
    """A comma-separated flag value, or a JSON list (vLLM's form, e.g. '["*"]')."""
    if not value:
        return None
    text = value.strip()
    if text.startswith("["):
        import json
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"not a JSON list: {value!r} ({e})") from None
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise ValueError(f"expected a JSON list of strings: {value!r}")
        return [i.strip() for i in items if i.strip()] or None
    return [v.strip() for v in text.split(",") if v.strip()] or None


def _log_requests(args: argparse.Namespace) -> bool:
    if args.enable_log_requests and args.disable_log_requests:
        raise ValueError("--enable-log-requests and --disable-log-requests contradict each other")
    return bool(args.enable_log_requests)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def default_api_server_count(config) -> int:
    """2 server processes for an engine on a GPU of a host with 8+ cores, else 1: measured on an H200
    (BENCHMARKS.md), one event loop falls behind 256 streams (frames then carry several tokens and
    inter-token gaps swing 7x), two keep up."""
    if config.device == "cpu" or (os.cpu_count() or 1) < 8:
        return 1
    import torch

    return 2 if config.device.startswith("cuda") or torch.cuda.is_available() else 1


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from specserve.config import engine_config_from_args
    from specserve.engine.async_engine import AsyncEngine
    from specserve.server.app import build_app, uvicorn_config
    from specserve.server.settings import ServerSettings, model_aliases, served_name_for

    args = resolve_serve_args(args)
    names = [args.served_model_name] if isinstance(args.served_model_name, str) else list(args.served_model_name or [])
    settings = ServerSettings(host=args.host, port=args.port, api_key=args.api_key,
                              allowed_origins=_list(args.allowed_origins), allowed_hosts=_list(args.allowed_hosts),
                              max_prompts_per_request=args.max_prompts_per_request,
                              max_sequences_per_request=args.max_sequences_per_request,
                              max_frame_size=args.max_frame_size, served_model_name=names[0] if names else None,
                              extra_model_names=model_aliases(args.model) + names[1:], root_path=args.root_path,
                              ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
                              uvicorn_log_level=args.uvicorn_log_level,
                              enable_auto_tool_choice=args.enable_auto_tool_choice,
                              tool_call_parser=args.tool_call_parser,
                              enable_log_requests=_log_requests(args))
    config = engine_config_from_args(model=args.model, **engine_kwargs(args))  # bad flags fail here, early
    name = served_name_for(args.model, names[0] if names else None)
    if not _is_loopback(settings.host) and settings.api_key is None:
        logger.warning("listening on %s without --api-key: anyone who can reach it can use it", settings.host)
    if settings.host in ("0.0.0.0", "::") and not settings.allowed_hosts:
        logger.warning("listening on all interfaces: only loopback Host names are answered; give the "
                       "names clients use with --allowed-hosts")

    servers = args.api_server_count if args.api_server_count is not None else default_api_server_count(config)
    if servers < 1:
        raise ValueError(f"--api-server-count must be >= 1, got {servers}")
    if servers > 1:
        from specserve.server.supervisor import serve_many
        return serve_many(config, settings, name, servers, args.log_level)

    failures: list[BaseException] = []
    died: list[str] = []
    server: uvicorn.Server | None = None

    def on_load_error(e: BaseException) -> None:
        failures.append(e)
        if server is not None:
            server.should_exit = True

    def on_engine_dead(reason: str) -> None:  # streams end with engine_dead; /health says 503 until exit
        died.append(reason)
        print(f"specserve: error: {reason}; stopping the server", file=sys.stderr, flush=True)
        if server is not None:
            server.should_exit = True

    def on_ready() -> None:
        engine = app.state.server.engine
        warm = f", warm-up {engine.warmup_seconds:.1f}s" if engine.warmup_seconds else ""
        print(f"specserve: {name} is ready (engine core pid {engine.pid}{warm})", file=sys.stderr, flush=True)

    app = build_app(lambda: AsyncEngine(config, on_dead=on_engine_dead, log_level=args.log_level),
                    settings, name, on_load_error, on_ready)
    server = uvicorn.Server(uvicorn_config(app, settings, args.log_level))
    print(f"specserve: serving {name} on {settings.url} (loading the model...)",
          file=sys.stderr, flush=True)
    # uvicorn handles SIGINT/SIGTERM while it runs (stop accepting, finish or cancel what is in
    # flight, then the lifespan stops the engine core) and re-raises the signal afterwards: with
    # this handler in place a SIGTERM ends in "stopped" and exit code 0, like Ctrl-C.
    signal.signal(signal.SIGTERM, lambda *_: setattr(server, "should_exit", True))
    try:
        server.run()
    except KeyboardInterrupt:  # Ctrl-C: uvicorn has already shut down gracefully and re-raised it
        pass
    print("specserve: stopped", file=sys.stderr, flush=True)
    if failures:
        print(f"specserve: error: loading the model failed: {failures[0]}", file=sys.stderr)
        return 1
    return 1 if died else 0
