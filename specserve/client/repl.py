"""`specserve chat`: a terminal chat with a running server, over the WebSocket client.

Ctrl-C while a reply streams stops that reply at once (a `response.cancel` frees the server's work);
Ctrl-C at the prompt or Ctrl-D quits. If the server goes away (stopped, killed, connection broken)
the chat says so at once, also while it waits at the prompt, and exits with status 1: run it again
to reconnect. Commands: /reset (forget the conversation), /stats (toggle the per-reply stats line),
/exit.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
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
    p.add_argument("--max-tokens", type=int, default=512, help="the most tokens of one reply (default 512)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="do not stop at the end-of-sequence token: every reply runs to --max-tokens (tests)")
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


def stream_reply(client: Client, messages: list[dict], args: argparse.Namespace,
                 out: TextIO) -> tuple[str, DoneResponse | None]:
    """Print one reply as it streams; returns its text and ResponseDone. Ctrl-C stops it at once: the
    stream closes here (the server is told to stop, not waited for) and the ResponseDone is None."""
    try:
        stream = client.create(messages=messages, max_output_tokens=args.max_tokens,
                               temperature=args.temperature, top_p=args.top_p, ignore_eos=args.ignore_eos or None)
    except KeyboardInterrupt:  # before the server accepted it: the client cancels it
        out.write("\n")
        return "", None
    with stream:
        try:
            for event in stream:
                if isinstance(event, OutputTextDelta) and event.output_index == 0:
                    out.write(event.delta)
                    out.flush()
        except KeyboardInterrupt:
            stream.close()
        finally:
            out.write("\n")
            out.flush()
    return stream.text, stream.done


class _ConnectionLost(BaseException):
    """Raised in input() by IdleWatch: the connection ended while the chat waited at the prompt."""


class IdleWatch:
    """Reads the prompt's line, and breaks off that read if the connection ends meanwhile, so a dead
    server is reported at once rather than at the next question. POSIX only (a SIGUSR1 to the main
    thread wakes input()); elsewhere it is plain input()."""

    def __init__(self, client: Client) -> None:
        self._client = client
        self._at_prompt = False
        self._thread: threading.Thread | None = None
        self._old_handler = None
        if hasattr(signal, "pthread_kill") and threading.current_thread() is threading.main_thread():
            self._old_handler = signal.signal(signal.SIGUSR1, self._on_signal)
            self._thread = threading.Thread(target=self._watch, name="specserve-chat-watch", daemon=True)
            self._thread.start()

    def _watch(self) -> None:
        self._client.wait_closed()
        if self._at_prompt:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)

    def _on_signal(self, signum: int, frame: object) -> None:
        if self._at_prompt:  # a late signal, after input() returned, is dropped: the next step fails anyway
            raise _ConnectionLost

    def input(self, prompt: str) -> str:
        """input(prompt); raises _ConnectionLost if the connection is (or gets) closed."""
        self._at_prompt = True  # before the check: either it sees the close, or _watch sees the prompt
        try:
            if self._client.closed_error is None:
                return input(prompt)
        finally:
            self._at_prompt = False
        raise _ConnectionLost

    def stop(self) -> None:
        """After client.close(): the watcher ends, then the old SIGUSR1 handler returns."""
        if self._thread is not None:
            self._thread.join(timeout=5)
            signal.signal(signal.SIGUSR1, self._old_handler)


def _report_lost(client: Client) -> int:
    err = client.closed_error
    reason = err.message if err is not None else "the server closed the connection"
    print(f"specserve chat: {reason}; exiting (run specserve chat again to reconnect)", file=sys.stderr)
    return 1


def cmd_chat(args: argparse.Namespace) -> int:
    try:
        client = Client(args.url, api_key=args.api_key)
    except SpecserveError as e:
        print(f"specserve chat: cannot connect to {args.url}: {e.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    session = client.session
    print(f"connected to {session.model} ({session.max_model_len} tokens) at {args.url}; "
          "Ctrl-C stops a reply, Ctrl-D quits, /reset forgets", file=sys.stderr)
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict] = []
    show_stats = args.stats
    watch = IdleWatch(client)
    try:
        while True:
            try:
                line = watch.input(">>> ")
            except (EOFError, KeyboardInterrupt):
                print(file=sys.stderr)
                return 0
            except _ConnectionLost:
                print(file=sys.stderr)
                return _report_lost(client)
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
                reply, done = stream_reply(client, system + history, args, sys.stdout)
            except KeyboardInterrupt:  # a second Ctrl-C while the first one stopped the reply
                reply, done = "", None
            except SpecserveError as e:
                history.pop()
                if e.code == "connection_closed":
                    return _report_lost(client)
                print(f"error: {e.message}", file=sys.stderr)
                continue
            if reply:
                history.append({"role": "assistant", "content": reply})
            if done is None:
                print("[cancelled]", file=sys.stderr)
            elif show_stats:
                print(format_stats(done), file=sys.stderr)
    finally:
        try:
            client.close()
        finally:
            watch.stop()
