"""`specserve chat` in a real terminal (a pty) against a real `specserve serve` process: Ctrl-C stops a
streaming reply at once and the chat goes on; a server that dies is reported within seconds."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import build_tiny_model
from tests.server.harness import add_char_tokenizer, free_port, wait_until_healthy

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="needs a POSIX pty")

MAX_TOKENS = 3000  # a reply that streams for seconds, so Ctrl-C lands mid-stream
PROMPT = re.compile(rb"(^|\n)>>> ")
# The chat runs in its own session with the pty as its controlling terminal, so that \x03 typed into
# the pty becomes a SIGINT from the terminal, exactly as in a shell.
_AS_TERMINAL = ("import fcntl, os, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
                "os.execv(sys.executable, [sys.executable, '-m', 'specserve.cli', 'chat', *sys.argv[1:]])")


@pytest.fixture(scope="module")
def long_chat_dir(tmp_path_factory) -> Path:
    model = build_tiny_model("llama", tmp_path_factory.mktemp("tiny-long"), max_position_embeddings=4096)
    return add_char_tokenizer(model, tmp_path_factory.mktemp("tiny-long-chat"))


class Server:
    """`specserve serve` in a subprocess on a free 127.0.0.1 port."""

    def __init__(self, model_dir: Path) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "specserve.cli", "serve", str(model_dir), "--port", str(self.port),
               "--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "260", "--max-model-len", "4096",
               "--served-model-name", "tiny"]
        env = {k: v for k, v in os.environ.items() if k != "SPECSERVE_API_KEY"}
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     start_new_session=True)
        self.ws = f"ws://127.0.0.1:{self.port}/v1/ws"
        wait_until_healthy(self.port, self.proc, lambda: self.proc.stderr.read().decode(errors="replace"))

    def wait_cancelled(self, num: int, timeout: float = 20.0) -> None:
        """Wait until the server counts `num` cancelled requests (its Prometheus counter)."""
        pattern = re.compile(r"^specserve:request_cancelled_total\{[^}]*\} (\S+)$", re.M)
        deadline = time.monotonic() + timeout
        while True:
            found = pattern.search(httpx.get(f"http://127.0.0.1:{self.port}/metrics", timeout=5).text)
            seen = int(float(found.group(1))) if found else 0
            if seen >= num:
                return
            assert time.monotonic() < deadline, f"the server counted {seen} cancelled requests, not {num}"
            time.sleep(0.1)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self.proc.stderr.close()


@pytest.fixture(scope="module")
def server(long_chat_dir):
    s = Server(long_chat_dir)
    yield s
    s.kill()


@pytest.fixture
def own_server(long_chat_dir):
    """A server this test kills."""
    s = Server(long_chat_dir)
    yield s
    s.kill()


class Chat:
    """`specserve chat` on a pty; everything it prints collects in `out`."""

    def __init__(self, url: str) -> None:
        master, slave = os.openpty()
        args = ["--url", url, "--max-tokens", str(MAX_TOKENS), "--temperature", "0", "--ignore-eos"]
        self.proc = subprocess.Popen([sys.executable, "-c", _AS_TERMINAL, *args], stdin=slave, stdout=slave,
                                     stderr=slave, start_new_session=True, close_fds=True)
        os.close(slave)
        self.master = master
        self.out = b""
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.master, 4096)
            except OSError:  # EIO: the chat exited and the pty closed
                return
            if not data:
                return
            with self._lock:
                self.out += data

    def mark(self) -> int:
        with self._lock:
            return len(self.out)

    def text(self, since: int = 0) -> str:
        with self._lock:
            return self.out[since:].decode(errors="replace")

    def wait_for(self, pattern: re.Pattern[bytes], since: int, timeout: float) -> float:
        """Seconds until `pattern` shows in the output after offset `since`."""
        t0 = time.monotonic()
        while True:
            with self._lock:
                if pattern.search(self.out, since):
                    return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                raise AssertionError(f"no {pattern.pattern!r} within {timeout}s; output after the mark:\n"
                                     f"{self.text(since)[-2000:]}")
            time.sleep(0.01)

    def ask(self, question: str, num_chars: int = 40) -> int:
        """Type a question; returns once `num_chars` of the reply have streamed in."""
        self.wait_for(PROMPT, 0, 60)
        mark = self.mark()
        self.type(question + "\n")
        self.wait_for(re.compile(re.escape(question.encode()) + rb"\r?\n"), mark, 10)  # the echo
        start = self.mark()
        deadline = time.monotonic() + 60
        while len(self.text(start)) < num_chars:
            assert self.proc.poll() is None, self.text(mark)
            assert time.monotonic() < deadline, f"no reply streamed:\n{self.text(mark)}"
            time.sleep(0.01)
        return start

    def type(self, keys: str) -> None:
        os.write(self.master, keys.encode())

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the chat did not exit; its output:\n{self.text()[-2000:]}") from None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        os.close(self.master)
        self._reader.join(timeout=5)


@pytest.fixture
def chat_on():
    chats: list[Chat] = []

    def start(url: str) -> Chat:
        chats.append(Chat(url))
        return chats[-1]

    yield start
    for c in chats:
        c.close()


def _ctrl_c_to_prompt(chat: Chat) -> float:
    mark = chat.mark()
    t0 = time.monotonic()
    chat.type("\x03")
    chat.wait_for(re.compile(rb"\[cancelled\][\s\S]*" + PROMPT.pattern), mark, 30)
    return time.monotonic() - t0


def test_ctrl_c_stops_the_reply_at_once_and_the_chat_goes_on(server, chat_on):
    chat = chat_on(server.ws)
    chat.ask("hello")
    first = _ctrl_c_to_prompt(chat)
    print(f"Ctrl-C -> prompt: {first * 1000:.0f} ms")
    assert first < 1.0, chat.text()
    server.wait_cancelled(1)  # the chat sent response.cancel: the server stopped the reply

    start = chat.ask("and again")  # the same connection still answers
    assert len(chat.text(start)) >= 40
    second = _ctrl_c_to_prompt(chat)
    assert second < 1.0, chat.text()
    server.wait_cancelled(2)

    chat.type("\x04")  # Ctrl-D at an empty prompt quits cleanly
    assert chat.wait_exit(30) == 0, chat.text()
    assert "Traceback" not in chat.text()


def test_ctrl_c_at_the_prompt_quits(server, chat_on):
    chat = chat_on(server.ws)
    chat.wait_for(PROMPT, 0, 60)
    chat.type("\x03")
    assert chat.wait_exit(30) == 0, chat.text()
    assert "Traceback" not in chat.text()


def test_a_killed_server_is_reported_mid_reply_and_at_the_prompt(own_server, chat_on):
    streaming, idle = chat_on(own_server.ws), chat_on(own_server.ws)
    streaming.ask("hello")
    idle.wait_for(PROMPT, 0, 60)
    marks = streaming.mark(), idle.mark()
    lost = re.compile(rb"specserve chat: the server closed the connection")
    t0 = time.monotonic()
    own_server.proc.send_signal(signal.SIGKILL)
    for chat, mark, where in ((streaming, marks[0], "mid-reply"), (idle, marks[1], "at the prompt")):
        chat.wait_for(lost, mark, 30)
        took = time.monotonic() - t0
        print(f"server killed -> reported {where}: {took * 1000:.0f} ms")
        assert took < 5.0, chat.text()
    for chat in (streaming, idle):
        assert chat.wait_exit(30) == 1, chat.text()
        assert "Traceback" not in chat.text()
