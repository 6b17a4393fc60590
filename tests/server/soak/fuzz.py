"""Phase 4's oracle (`Fuzzer`: every input answered well, a canary still served, nothing leaked) and
the hypothesis driver (`run_fuzz`)."""
from __future__ import annotations

import json
import threading
import time
from collections import Counter

import httpx
from websockets.exceptions import ConnectionClosed

from tests.server.harness import ServerThread
from tests.server.soak.clients import http_body
from tests.server.soak.common import check_server
from tests.server.soak.fuzz_inputs import POISON, strategies

# a short context bounds every fuzz request (max_tokens null = up to it); 64 KiB frames hold the
# 5000-digit literals and keep oversize frames cheap
FUZZ_SERVER = (dict(num_kv_blocks=128, max_model_len=64), dict(max_frame_size=65536))
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


class Fuzzer:
    """The fuzz oracle. HTTP: never a 5xx (nor a 200 stream with an error chunk or without [DONE]),
    always an answer within `timeout`. WS: every frame is answered by exactly one well-formed `error` or
    `response.created` (created responses are cancelled at once and must end with a response.done that
    is not `failed`), and the socket is never dropped. Meanwhile a canary thread runs valid requests
    (WS and SSE) that must complete with exactly their tokens. Problems name their input (repr)."""

    def __init__(self, server: ServerThread, timeout: float = 30.0) -> None:
        self.server, self.timeout = server, timeout
        self.http = httpx.Client(timeout=timeout)
        self.problems: list[str] = []
        self.num_inputs: Counter = Counter()
        self.num_canaries = 0
        self.current = ""  # the input under test (named by canary failures)
        self._ws = None
        self._sync = 0
        self._stop = threading.Event()
        self._canary: threading.Thread | None = None
        self.start_canary()

    def start_canary(self) -> None:
        self._stop = threading.Event()
        self._canary = threading.Thread(target=self._canary_loop, args=(self._stop,), name="fuzz-canary",
                                        daemon=True)
        self._canary.start()

    def stop_canary(self) -> None:
        self._stop.set()
        self._canary.join(self.timeout)

    def fail(self, what: str, case) -> None:
        self.problems.append(f"{what}; input: {_short(case)}")

    # -- WebSocket ---------------------------------------------------------------------------------
    def _socket(self):
        if self._ws is None:
            self._ws = _sync_connect(self.server.ws, self.timeout)
            json.loads(self._ws.recv(timeout=self.timeout))  # session.created
        return self._ws

    def check_ws(self, frame: str, must_refuse: bool = False) -> None:
        from specserve.server.protocol import parse_server_event
        self.num_inputs["ws"] += 1
        self.current = frame
        self._sync += 1
        sync_id = f"sync-{self._sync}"
        ws = self._socket()
        answers, open_ids, synced = [], set(), False
        deadline = time.monotonic() + self.timeout
        try:
            ws.send(frame)
            ws.send(json.dumps({"type": "soak.sync", "event_id": sync_id}))  # answered after `frame`
            while not synced or open_ids:
                raw = ws.recv(timeout=max(0.01, deadline - time.monotonic()))
                msg = json.loads(raw)
                parse_server_event(msg)
                kind, err = msg["type"], msg.get("error") or {}
                if kind == "error" and err.get("event_id") == sync_id:
                    synced = True
                elif kind == "error" and str(err.get("event_id")).startswith("cancel-"):
                    pass  # the response ended before its cancel arrived
                elif kind in ("error", "response.created"):
                    answers.append(msg)
                    if kind == "response.created":
                        open_ids.add(msg["response"]["id"])
                        ws.send(json.dumps({"type": "response.cancel", "response_id": msg["response"]["id"],
                                            "event_id": f"cancel-{self._sync}"}))
                elif kind == "response.done":
                    open_ids.discard(msg["response"]["id"])
                    if msg["response"]["status"] == "failed":
                        self.fail(f"ws response failed: {msg['response']['error']}", frame)
        except TimeoutError:
            self.fail(f"ws: no answer within {self.timeout}s", frame)
            self._drop_socket()
            return
        except ConnectionClosed as e:
            self.fail(f"ws socket dropped ({'no close frame' if e.rcvd is None else e.rcvd})", frame)
            self._ws = None
            return
        except Exception as e:  # noqa: BLE001 - a malformed event
            self.fail(f"ws malformed event: {type(e).__name__}: {str(e)[:200]}", frame)
            self._drop_socket()
            return
        if len(answers) != 1:
            self.fail(f"ws frame answered by {len(answers)} events: {[a['type'] for a in answers]}", frame)
        elif must_refuse and answers[0]["type"] != "error":
            self.fail("ws: accepted (response.created), want an error event", frame)

    def _drop_socket(self) -> None:
        if self._ws is not None:
            self._ws.close()
            self._ws = None

    # -- HTTP --------------------------------------------------------------------------------------
    def check_http(self, target: str, case: tuple[str, bytes], must_refuse: bool = False) -> None:
        self.num_inputs[target] += 1
        self.current = case
        content_type, body = case
        headers = {"content-type": content_type} if content_type else {}
        t0 = time.monotonic()
        try:
            with self.http.stream("POST", self.server.http + PATHS[target], content=body, headers=headers) as r:
                if r.status_code >= 500:
                    self.fail(f"HTTP {r.status_code}: {r.read()[:300]!r}", case)
                elif r.status_code == 200 and r.headers.get("content-type", "").startswith("text/event-stream"):
                    lines = [line for line in r.iter_lines() if line.startswith("data: ")]
                    errors = [line for line in lines if line.startswith('data: {"error"')]
                    if errors or not lines or lines[-1] != "data: [DONE]":
                        self.fail(f"SSE ended badly: {(errors or lines[-1:] or ['nothing'])[0][:300]}", case)
                else:
                    data = json.loads(r.read())
                    key = "choices" if r.status_code == 200 else "error"
                    if key not in data:
                        self.fail(f"HTTP {r.status_code} body without {key!r}: {str(data)[:200]}", case)
                if must_refuse and not 400 <= r.status_code < 500:
                    self.fail(f"HTTP {r.status_code}, want a 4xx refusal", case)
        except httpx.TimeoutException:
            self.fail(f"HTTP: no answer within {self.timeout}s", case)
            return
        except (httpx.TransportError, ValueError) as e:
            self.fail(f"HTTP: {type(e).__name__}: {str(e)[:200]}", case)
        if time.monotonic() - t0 > self.timeout:
            self.fail(f"HTTP answered after {time.monotonic() - t0:.1f}s (limit {self.timeout}s)", case)

    def check(self, target: str, case, must_refuse: bool = False) -> None:
        if target == "ws":
            self.check_ws(case, must_refuse)
        else:
            self.check_http(target, case, must_refuse)

    # -- the canary and the end --------------------------------------------------------------------
    def _canary_loop(self, stop: threading.Event) -> None:
        spec = {"prompt": [5, 6, 7, 8], "max_output_tokens": 8, "ignore_eos": True, "temperature": 0.0}
        ws = None
        while not stop.wait(0.05):
            try:
                if ws is None:
                    ws = _sync_connect(self.server.ws, self.timeout)
                    ws.recv(timeout=self.timeout)
                ws.send(json.dumps({"type": "response.create", "response": spec}))
                streamed, done = 0, None
                while done is None:
                    msg = json.loads(ws.recv(timeout=self.timeout))
                    streamed += len(msg.get("token_ids", []))
                    done = msg["response"] if msg["type"] == "response.done" else None
                if done["status"] != "incomplete" or streamed != 8 or done["usage"]["output_tokens"] != 8:
                    self.fail(f"canary (ws) ended {done['status']} with {streamed} tokens "
                              f"({done.get('error')})", self.current)
                body = http_body(spec, False, True)
                with self.http.stream("POST", self.server.http + PATHS["completions"], json=body) as r:
                    lines = [line for line in r.iter_lines() if line.startswith("data: ")]
                usage = json.loads(lines[-2][6:])["usage"] if len(lines) >= 2 and lines[-2].startswith(
                    'data: {"id"') else None
                if r.status_code != 200 or lines[-1:] != ["data: [DONE]"] or not usage or \
                        usage["completion_tokens"] != 8:
                    self.fail(f"canary (sse) HTTP {r.status_code}: {(lines or [''])[-2:]}", self.current)
                self.num_canaries += 1
            except Exception as e:  # noqa: BLE001
                self.fail(f"canary: {type(e).__name__}: {str(e)[:200]}", self.current)
                ws = None
        if ws is not None:
            ws.close()

    def take_problems(self) -> list[str]:
        """The problems so far (cleared), and the server's state once the inputs and canaries ended."""
        self._drop_socket()
        self.stop_canary()
        problems, self.problems = self.problems, []
        problems += check_server(self.server)[0]
        self.start_canary()
        return problems

    def close(self) -> None:
        self.stop_canary()
        self._drop_socket()
        self.http.close()


def _sync_connect(url: str, timeout: float):
    """A blocking client socket kept open across calls (entered by hand: its `with` would close it)."""
    from websockets.sync.client import connect
    return connect(url, max_size=None, open_timeout=timeout).__enter__()


def _short(case, limit: int = 300) -> str:
    text = repr(case)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def run_fuzz(fuzzer: Fuzzer, target: str, max_examples: int, derandomize: bool = True) -> None:
    """Hypothesis-generated inputs for `target` (ws | completions | chat), the POISON inputs first as
    explicit examples; every input goes through the fuzzer's oracle, whose problems are collected (not
    raised) so one run reports every failing input."""
    from hypothesis import HealthCheck, Phase, example, given, settings

    def one(case) -> None:
        fuzzer.check(target, case)

    test = given(case=strategies()[target])(one)
    for t, case, _ in POISON.values():
        if t == target:
            test = example(case=case)(test)
    settings(max_examples=max_examples, derandomize=derandomize, deadline=None, database=None,
             phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck),
             print_blob=False)(test)()
