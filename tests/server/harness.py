"""Test helpers: a real uvicorn server in a thread, and a tiny model that has a tokenizer."""
from __future__ import annotations

import shutil
import socket
import string
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import uvicorn

from specserve.client import wait_until_ready
from specserve.config import engine_config_from_args
from specserve.engine.async_engine import AsyncEngine
from specserve.engine.engine import LLMEngine
from specserve.server.app import build_app, uvicorn_config
from specserve.server.settings import ServerSettings
from specserve.server.state import ServerState

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def add_char_tokenizer(model_dir: Path, dest: Path, vocab_size: int = 320) -> Path:
    """Copy a tiny random model and give it a character-level tokenizer (ids 0..2 = unk, bos, eos;
    every other id one printable character, so any generated id decodes to valid text)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    shutil.copytree(model_dir, dest, dirs_exist_ok=True)
    chars = list(string.ascii_letters + string.digits + string.punctuation + " \n")
    chars += [chr(c) for c in range(0xC0, 0xC0 + vocab_size)]
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials + chars[:vocab_size - len(specials)])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(dest))
    return dest


def engine_factory(model: str | Path, in_process: bool = False, **engine_args) -> Callable[[], AsyncEngine]:
    """The engine core in its own process, as `specserve serve` runs it; `in_process=True`: in a
    thread of this one (for tests that reach into the engine, e.g. to inject faults)."""
    config = engine_config_from_args(model=str(model), **engine_args)
    if in_process:
        return lambda: AsyncEngine(LLMEngine(config))
    return lambda: AsyncEngine(config)


class ServerThread:
    """uvicorn on 127.0.0.1 and a free port, in a daemon thread."""

    def __init__(self, factory: Callable[[], AsyncEngine], model_name: str = "tiny", wait_ready: bool = True,
                 **settings) -> None:
        self.settings = ServerSettings(host="127.0.0.1", port=0, **settings)
        self.app = build_app(factory, self.settings, model_name)
        self.server = uvicorn.Server(uvicorn_config(self.app, self.settings, "warning"))
        self.thread = threading.Thread(target=self.server.run, name="test-uvicorn", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.http = f"http://127.0.0.1:{self.port}"
        self.ws = f"ws://127.0.0.1:{self.port}/v1/ws"
        if wait_ready and not self.state.wait_loaded(120):
            raise RuntimeError(f"the engine did not load: {self.state.load_error}")

    @property
    def state(self) -> ServerState:
        return self.app.state.server

    def stats(self) -> dict:
        return self.state.engine.stats()

    def wait_blocks(self, baseline: int, timeout: float = 10.0) -> dict:
        """Poll until no request runs and the used KV blocks are back to `baseline`."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats()
            if s["num_used_blocks"] == baseline and s["num_requests_running"] == 0 \
                    and s["num_requests_waiting"] == 0:
                return s
            if time.monotonic() > deadline:
                return s
            time.sleep(0.02)

    def get(self, path: str, **kwargs) -> httpx.Response:
        return httpx.get(self.http + path, timeout=30, **kwargs)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(port: int, proc: subprocess.Popen, output: Callable[[], str],
                       timeout: float = 120.0, scheme: str = "http", verify: bool = True) -> None:
    """Poll a `specserve serve` subprocess's /health until it answers 200; if the process exits first,
    fail with what it printed (`output()`)."""
    try:
        ready = wait_until_ready(f"{scheme}://127.0.0.1:{port}", timeout, alive=lambda: proc.poll() is None,
                                 verify=verify)
    except TimeoutError:
        raise AssertionError("the server did not get ready") from None
    if not ready:
        raise AssertionError(output())
