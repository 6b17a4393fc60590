"""The engine core in its own process, talking to front ends over ZeroMQ with msgpack messages.

Why a process: the engine's step loop and a server's event loop (HTTP parsing, JSON, WebSocket
frames for hundreds of streams) each want a whole core; in one process they take turns on one GIL.
Why ZeroMQ (pyzmq) and msgspec: message framing, queueing and reconnects come for free over a Unix
socket (`ipc://`), sends never block the step loop, and msgspec encodes a step's Structs (every
request's new tokens) in microseconds. This is the pair vLLM's engine core uses too.

Topology: the core binds one PULL socket for its input (every front end PUSHes AddRequest / Abort /
StopSample / Shutdown to it); each front end binds a PULL socket for its outputs and the core PUSHes
that front end's StepOutput to it after every step. The start-up handshake (the model's facts and
the tokenizer, or why loading failed) goes over a multiprocessing pipe.

Lifetime: the core ignores SIGINT (Ctrl-C reaches the whole process group; the front end decides),
exits when told (Shutdown), and exits when its parent is gone (checked before every step and every
POLL_MS while idle; PR_SET_PDEATHSIG would fire when the *thread* that started it ends), so no
engine process outlives the server.
"""
from __future__ import annotations

import gc
import logging
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import connection, get_context

import msgspec
import zmq

from specserve.config import EngineConfig
from specserve.engine.messages import CoreInput, ModelInfo, Shutdown, StepOutput
from specserve.utils import exit_reason

logger = logging.getLogger(__name__)

POLL_MS = 500  # how often an idle core checks that its parent is alive
WATCH_S = 0.2  # how often a front end that did not start the core checks that it is alive
SHUTDOWN_TIMEOUT_S = 15.0
_input_decoder = msgspec.msgpack.Decoder(CoreInput)
_output_decoder = msgspec.msgpack.Decoder(StepOutput)


@dataclass(frozen=True)
class CoreHandle:
    """What a front end needs to attach to a running core (picklable: handed to server processes)."""

    input_addr: str
    output_addrs: tuple[str, ...]
    pid: int
    ready: dict  # the core's handshake: model_info (msgpack), tokenizer (pickle), stats, warmup_seconds
    client: int = 0  # which of output_addrs is this front end's


class CoreProcess:
    """Start the engine core process for `config`, with one output socket per front end
    (`num_clients`); the constructor returns once it is ready (or raises why it is not)."""

    def __init__(self, config: EngineConfig, log_level: str = "WARNING", num_clients: int = 1) -> None:
        self._dir = tempfile.mkdtemp(prefix="specserve-core-")
        self.input_addr = f"ipc://{self._dir}/input"
        self.output_addrs = tuple(f"ipc://{self._dir}/output-{i}" for i in range(num_clients))
        ctx = get_context("spawn")
        parent_conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=run_core, name="specserve-engine-core",
                                   args=(config, self.input_addr, list(self.output_addrs), child_conn, log_level,
                                         os.getpid()))
        self.process.start()
        child_conn.close()
        try:
            self.ready = self._handshake(parent_conn)
        except BaseException:
            self.stop(1.0)
            raise

    def _handshake(self, conn) -> dict:
        ready = connection.wait([conn, self.process.sentinel])
        if conn in ready:
            try:
                kind, payload = conn.recv()
            except EOFError:
                kind, payload = "error", None
            if kind == "ready":
                return payload
            if payload is not None:
                raise RuntimeError(payload)
        self.process.join(5)
        raise RuntimeError(f"the engine process {exit_reason(self.process.exitcode)} while loading")

    def handle(self, client: int = 0) -> CoreHandle:
        return CoreHandle(self.input_addr, self.output_addrs, self.process.pid, self.ready, client)

    def shutdown(self, timeout: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Tell the core to stop (it aborts what still runs), wait for it; terminate it if it hangs."""
        if self.process.is_alive():
            ctx = zmq.Context()
            sock = ctx.socket(zmq.PUSH)
            sock.connect(self.input_addr)
            sock.send(msgspec.msgpack.encode(Shutdown()))
            sock.close(linger=1000)
            ctx.term()
        self.stop(timeout)

    def stop(self, timeout: float) -> None:
        proc = self.process
        proc.join(timeout)
        if proc.is_alive():
            logger.warning("the engine process did not stop within %.0fs; terminating it", timeout)
            proc.terminate()
            proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        shutil.rmtree(self._dir, ignore_errors=True)


class CoreClient:
    """Transport: one front end's sockets to a running engine core (see the module doc). With
    `owner` (the CoreProcess this front end started) it also stops the core on shutdown and watches
    the process; without, it watches the core's pid (the process that started it reaps it)."""

    def __init__(self, handle: CoreHandle, on_output: Callable[[StepOutput], None],
                 on_dead: Callable[[str], None], owner: CoreProcess | None = None) -> None:
        self._on_output, self._on_dead = on_output, on_dead
        self.handle, self.owner, self.client, self.pid = handle, owner, handle.client, handle.pid
        info = handle.ready
        self.model_info: ModelInfo = msgspec.msgpack.decode(info["model_info"], type=ModelInfo)
        self.tokenizer = pickle.loads(info["tokenizer"])
        self.stats: dict = info["stats"]
        self.warmup_seconds: float = info["warmup_seconds"]
        self._ctx = zmq.Context()
        self._out = self._ctx.socket(zmq.PULL)
        self._out.bind(handle.output_addrs[handle.client])
        self._in = self._ctx.socket(zmq.PUSH)
        self._in.setsockopt(zmq.LINGER, 0)
        self._in.connect(handle.input_addr)
        self._send_lock = threading.Lock()
        self._encoder = msgspec.msgpack.Encoder()
        self._stopping = self._closing = False
        self._receiver = threading.Thread(target=self._receive, name="specserve-core-output", daemon=True)
        self._receiver.start()
        self._monitor = threading.Thread(target=self._watch, name="specserve-core-monitor", daemon=True)
        self._monitor.start()

    def send(self, msg: CoreInput) -> None:
        data = self._encoder.encode(msg)
        with self._send_lock:
            if not self._in.closed:
                self._in.send(data, copy=False)

    def _receive(self) -> None:
        """The receiver thread owns the output socket (zmq sockets are not thread-safe)."""
        sock = self._out
        try:
            while not self._closing:
                if sock.poll(100):
                    self._on_output(_output_decoder.decode(sock.recv(copy=False).buffer))
        finally:
            sock.close(linger=0)

    def _watch(self) -> None:
        if self.owner is not None:
            self.owner.process.join()
            reason = f"the engine process {exit_reason(self.owner.process.exitcode)}"
        else:  # not our child: its exit code is its parent's to read
            while _pid_alive(self.pid) and not self._stopping:
                time.sleep(WATCH_S)
            reason = "the engine process is gone"
        if not self._stopping:
            logger.error("%s", reason)
            self._on_dead(reason)

    def shutdown(self, timeout: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Stop the core if this front end started it; close the sockets."""
        if self._stopping:
            return
        self._stopping = True
        if self.owner is not None:
            self.send(Shutdown())
            self.owner.stop(timeout)
        self._closing = True
        self._receiver.join()
        with self._send_lock:
            self._in.close(linger=0)
        self._ctx.term()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# -- the child ---------------------------------------------------------------------------------------
def run_core(config: EngineConfig, input_addr: str, output_addrs: list[str], conn, log_level: str,
             parent_pid: int) -> None:
    """The engine core process: build the engine, say ready (or why not), serve until Shutdown."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=getattr(logging, str(log_level).upper(), logging.WARNING),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        from specserve.engine.engine import LLMEngine

        t0 = time.perf_counter()
        engine = LLMEngine(config)
        info = {"model_info": msgspec.msgpack.encode(engine.model_info()),
                "tokenizer": pickle.dumps(engine.tokenizer), "stats": engine.stats(),
                "warmup_seconds": engine.warmup_seconds, "load_seconds": time.perf_counter() - t0}
    except BaseException as e:  # noqa: BLE001 - any load failure goes to the front end, verbatim
        logger.exception("loading the engine failed")
        conn.send(("error", f"{type(e).__name__}: {e}"))
        conn.close()
        sys.exit(1)
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.bind(input_addr)
    outs = []
    for addr in output_addrs:
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(addr)
        outs.append(sock)
    # everything built so far lives as long as the process: keep it out of the collector's scans, so
    # a full collection costs a step a few milliseconds, not a pause over every tensor and module
    gc.collect()
    gc.freeze()
    conn.send(("ready", info))
    conn.close()
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)

    def receive(block: bool) -> list[CoreInput]:
        msgs = []
        while True:  # before every step, and every POLL_MS while idle: is the parent still there?
            if os.getppid() != parent_pid:
                logger.error("the server process is gone; the engine core exits")
                return [Shutdown()]
            if not block or poller.poll(POLL_MS):
                break
        while True:
            try:
                frame = inbox.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return msgs
            msgs.append(_input_decoder.decode(frame.buffer))

    encoder = msgspec.msgpack.Encoder()

    def send(client: int, out: StepOutput) -> None:
        outs[client].send(encoder.encode(out), copy=False)

    from specserve.engine.core import EngineCore

    core = EngineCore(engine, len(outs))
    try:
        core.run(receive, send)
    finally:
        leaked = engine.kv_manager.pool.num_used_blocks
        if leaked:
            logger.error("the engine core stops with %d KV blocks still held", leaked)
        engine.shutdown()
        for sock in outs:
            sock.close()
        inbox.close(linger=0)
        ctx.term()
