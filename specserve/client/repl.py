"""`specserve chat`: a terminal chat with a running server, over the WebSocket client.

Ctrl-C while a reply streams stops that reply (the server frees its work); Ctrl-C at the prompt or
Ctrl-D quits. Commands: /reset (forget the conversation), /stats (toggle the per-reply stats line),
/exit.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import TextIO

from specserve.client.async_client import DEFAULT_URL
from specserve.client.errors import SpecserveError
from specserve.client.sync_client import Client
from specserve.server.protocol import DoneResponse, OutputTextDelta


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="chat with a running specserve server in the terminal",
                       description=__doc__.splitlines()[0])
    p.add_argument("--url", default=os.environ.get("SPECSERVE_URL", DEFAULT_URL),
                   help=f"the server's WebSocket URL (default {DEFAULT_URL}, or $SPECSERVE_URL)")
    p.add_argument("--api-key", default=os.environ.get("SPECSERVE_API_KEY"),
                   help="the server's API key (default $SPECSERVE_API_KEY)")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--stats", action="store_true",
                   help="print TTFT, tokens/s and cache hits after each reply")
    p.set_defaults(func=cmd_chat)


def format_stats(done: DoneResponse) -> str:
    m, u = done.metrics, done.usage
    parts = [f"{u.output_tokens} tokens"]
    if m.ttft_ms is not None:
        parts.append(f"TTFT {m.ttft_ms:.0f} ms")
    if m.tokens_per_s:
        parts.append(f"{m.tokens_per_s:.1f} tok/s")
    parts.append(f"{u.cached_tokens} cached")
    if m.spec.draft_tokens:
        parts.append(f"draft acceptance {100 * m.spec.accepted / m.spec.draft_tokens:.0f}%")
    if done.status != "completed":
        parts.append(done.status)
    return "[" + ", ".join(parts) + "]"


def stream_reply(client: Client, messages: list[dict], args: argparse.Namespace, out: TextIO) -> DoneResponse:
    """Print one reply as it streams; Ctrl-C cancels it and returns the cancelled result."""
    stream = client.create(messages=messages, max_output_tokens=args.max_tokens, temperature=args.temperature,
                           top_p=args.top_p)
    with stream:
        while True:
            try:
                event = next(stream)
            except StopIteration:
                break
            except KeyboardInterrupt:
                stream.cancel()
                continue  # read on until the server confirms with a `cancelled` done event
            if isinstance(event, OutputTextDelta) and event.output_index == 0:
                out.write(event.delta)
                out.flush()
    out.write("\n")
    assert stream.done is not None
    return stream.done


def cmd_chat(args: argparse.Namespace) -> int:
    try:
        client = Client(args.url, api_key=args.api_key)
    except SpecserveError as e:
        print(f"specserve chat: cannot connect to {args.url}: {e.message}", file=sys.stderr)
        return 1
    session = client.session
    print(f"connected to {session.model} ({session.max_model_len} tokens) at {args.url}; "
          "Ctrl-C stops a reply, Ctrl-D quits, /reset forgets", file=sys.stderr)
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict] = []
    show_stats = args.stats
    try:
        while True:
            try:
                line = input(">>> ")
            except (EOFError, KeyboardInterrupt):
                print(file=sys.stderr)
                return 0
            text = line.strip()
            if not text:
                continue
            if text in ("/exit", "/quit"):
                return 0
            if text == "/reset":
                history.clear()
                continue
            if text == "/stats":
                show_stats = not show_stats
                continue
            history.append({"role": "user", "content": text})
            try:
                done = stream_reply(client, system + history, args, sys.stdout)
            except SpecserveError as e:
                history.pop()
                print(f"error: {e.message}", file=sys.stderr)
                if e.code == "connection_closed":
                    return 1
                continue
            reply = done.output[0].text if done.output else ""
            if reply:
                history.append({"role": "assistant", "content": reply})
            if show_stats:
                print(format_stats(done), file=sys.stderr)
    finally:
        client.close()
