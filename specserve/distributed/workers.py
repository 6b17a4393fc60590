"""WorkerGroup: rank 0's side of the worker processes (ranks 1..N-1): start-up, the watch over them,
the calls it broadcasts to them, and their stop.

Start-up: spawn the workers (torch.multiprocessing's spawn context; NCCL_NVLS_ENABLE=0 is set before,
so they inherit it); each says "started" over its pipe, then all ranks join the group (a rendezvous
file in a private directory), then each loads its shard and says "ready" (or why it could not).

Faults: a thread waits on the workers' process sentinels and pipes. A worker that exits, is killed,
or reports an exception marks the group dead with the rank and the cause; the other workers are
stopped. A call in progress on rank 0 then fails within seconds: gloo raises at once when a peer's
socket closes, NCCL's collectives are aborted; a worker that hangs alive fails the collective after
`ParallelConfig.timeout_s`. Either way rank 0 raises ExecutorDeadError naming the rank and cause.

No orphans: `stop()` (the engine's shutdown) tells the workers to exit, then terminates what is left;
the workers are daemonic (they die with rank 0's interpreter) and each also exits when its parent's
pid changes (rank 0 killed).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator
from datetime import timedelta
from multiprocessing import connection

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from specserve.config import EngineConfig
from specserve.distributed.state import TPGroup, destroy_tp_group, init_tp_group, set_nccl_env
from specserve.utils import exit_reason
from specserve.engine.executor import ExecutorDeadError
from specserve.distributed.wire import encode_header

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0
NAME_WAIT_S = 3.0  # how long a failed call waits for the watcher to name a dead worker


class WorkerGroup:
    def __init__(self, config: EngineConfig, model_path: str, device: torch.device) -> None:
        from specserve.distributed.worker import run_worker

        size = config.parallel.tensor_parallel_size
        set_nccl_env()
        self.size = size
        self.timeout_s = config.parallel.timeout_s
        self.failure: str | None = None
        self.group: TPGroup | None = None
        self._stopping = False
        self._fail_lock = threading.Lock()
        self._errors: dict[int, str] = {}
        self._dir = tempfile.mkdtemp(prefix="specserve-tp-")
        rendezvous = f"file://{self._dir}/rendezvous"
        ctx = mp.get_context("spawn")
        self.procs: dict[int, mp.Process] = {}
        self.conns: dict[int, connection.Connection] = {}
        log_level = logging.getLevelName(logging.getLogger("specserve").getEffectiveLevel())
        for rank in range(1, size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=run_worker, name=f"specserve-tp-rank-{rank}", daemon=True,
                               args=(dataclasses.replace(config, device=str(device)), model_path, rank,
                                     rendezvous, child, os.getpid(), log_level))  # the device resolved here
            proc.start()
            child.close()
            self.procs[rank], self.conns[rank] = proc, parent
        self._finalizer = weakref.finalize(self, _reap, list(self.procs.values()))
        try:
            self._expect("started")
            self.group = init_tp_group(0, size, device, rendezvous, config.parallel.timeout_s)
        except BaseException:
            self.stop()
            raise

    # -- start-up ------------------------------------------------------------------------------
    def _expect(self, kind: str) -> None:
        """Wait for every worker to say `kind`; a worker that fails or exits first raises why."""
        for rank, conn in self.conns.items():
            proc = self.procs[rank]
            ready = connection.wait([conn, proc.sentinel])
            msg = None
            if conn in ready:
                try:
                    got, msg = conn.recv()
                except EOFError:
                    got = None
                if got == kind:
                    continue
            proc.join(5)
            cause = f": {msg}" if msg else ""
            raise RuntimeError(f"tensor-parallel worker rank {rank} {exit_reason(proc.exitcode)} while "
                               f"starting{cause}")

    def wait_ready(self) -> None:
        """Every worker holds its shard; from now on the watcher reports any that fails."""
        try:
            self._expect("ready")
        except BaseException:
            self.stop()
            raise
        threading.Thread(target=self._watch, name="specserve-tp-watch", daemon=True).start()

    # -- faults --------------------------------------------------------------------------------
    def _watch(self) -> None:
        waitables = {conn: rank for rank, conn in self.conns.items()}
        waitables.update({p.sentinel: rank for rank, p in self.procs.items()})
        while not self._stopping and self.failure is None:
            for obj in connection.wait(list(waitables), timeout=0.5):
                rank = waitables[obj]
                if obj is self.conns[rank]:
                    try:
                        kind, msg = obj.recv()
                        if kind == "error":
                            self._errors[rank] = msg
                    except (EOFError, OSError):
                        waitables.pop(obj)
                elif not self._stopping:
                    self._fail(rank)
                    return

    def _fail(self, rank: int) -> None:
        with self._fail_lock:  # the watcher and a failed call may both get here
            if self.failure is None:
                self._name_failure(rank)

    def _name_failure(self, rank: int) -> None:
        proc, conn = self.procs[rank], self.conns[rank]
        proc.join(1)
        with contextlib.suppress(EOFError, OSError):
            while conn.poll():
                kind, msg = conn.recv()
                if kind == "error":
                    self._errors[rank] = msg
        cause = f": {self._errors[rank]}" if rank in self._errors else ""
        self.failure = f"tensor-parallel worker rank {rank} (pid {proc.pid}) {exit_reason(proc.exitcode)}{cause}"
        logger.error("%s; the engine stops", self.failure)
        self._abort_collectives()

    def _abort_collectives(self) -> None:
        """Unblock rank 0 if it waits in a collective the dead rank will never join (NCCL; gloo raises
        by itself), and stop the other workers."""
        if self.group is not None and self.group.device.type == "cuda":
            with contextlib.suppress(Exception):
                from torch.distributed.distributed_c10d import _abort_process_group
                _abort_process_group(self.group.model)
        for proc in self.procs.values():
            if proc.is_alive():
                proc.kill()  # out of step with rank 0: nothing of theirs is worth a clean exit

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Run a mirrored call: any failure in it leaves the ranks out of step, so it kills the group
        and raises ExecutorDeadError (naming the dead rank when one died)."""
        if self.failure is not None:
            raise ExecutorDeadError(self.failure)
        try:
            yield
        except Exception as e:
            deadline = time.monotonic() + NAME_WAIT_S  # let the watcher name a worker that died
            while self.failure is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if self.failure is None:
                dead = [r for r, p in self.procs.items() if not p.is_alive()]
                if dead:
                    self._fail(dead[0])
                else:
                    hung = "timed out" in str(e).lower()
                    what = (f"a collective timed out after {self.timeout_s:g}s: a worker hangs (ranks "
                            f"{', '.join(map(str, self.procs))} are alive but did not answer)" if hung else
                            "a tensor-parallel call failed on rank 0; the ranks are out of step")
                    with self._fail_lock:
                        self.failure = self.failure or f"{what} ({type(e).__name__}: {e})"
                    logger.error("%s; the engine stops", self.failure)
                    self._abort_collectives()
            raise ExecutorDeadError(self.failure) from e

    # -- calls ---------------------------------------------------------------------------------
    def call(self, header: tuple, tensor: torch.Tensor | None = None) -> None:
        """Tell every worker what to run next (and send it `tensor` over the model group). The host
        group never times out (idle workers wait on it), so rank 0 bounds its own wait: a worker that
        does not take the header within `timeout_s` hangs."""
        for part in encode_header(header):
            work = dist.broadcast(part, src=0, group=self.group.control, async_op=True)
            work.wait(timeout=timedelta(seconds=self.timeout_s))
        if tensor is not None:
            dist.broadcast(tensor, src=0, group=self.group.model)

    # -- stop ----------------------------------------------------------------------------------
    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Tell the workers to exit, wait for them, terminate any left; leave the process group."""
        if self._stopping:
            return
        self._stopping = True
        if self.group is not None and self.failure is None and all(p.is_alive() for p in self.procs.values()):
            with contextlib.suppress(Exception):
                self.call(("shutdown",))
                deadline = time.monotonic() + timeout
                for proc in self.procs.values():
                    proc.join(max(0.1, deadline - time.monotonic()))
        _reap(list(self.procs.values()))
        self._finalizer.detach()
        destroy_tp_group()
        shutil.rmtree(self._dir, ignore_errors=True)


def _reap(procs: list) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
