"""A tensor-parallel worker process (ranks 1..N-1): join the group, load this rank's shard, then run
whatever rank 0 announces (executor.py) on it, in the same order, until told to stop. A worker
keeps nothing of the scheduler's: every call carries what it needs."""
from __future__ import annotations

import logging
import os
import signal
import threading
import time

import torch
import torch.distributed as dist

from specserve.config import EngineConfig

logger = logging.getLogger(__name__)

PARENT_POLL_S = 0.5


def run_worker(config: EngineConfig, model_path: str, rank: int, rendezvous: str, conn, parent_pid: int,
               log_level: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group: rank 0 decides
    logging.basicConfig(level=getattr(logging, str(log_level).upper(), logging.WARNING),
                        format=f"%(asctime)s %(levelname)s %(name)s [tp rank {rank}]: %(message)s")
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    try:
        from specserve.distributed.layers import parallelize
        from specserve.distributed.state import init_tp_group, rank_device
        from specserve.models.loader import load_model

        if config.threads is not None:
            torch.set_num_threads(config.threads)
        device = rank_device(torch.device(config.device), rank)  # rank 0 resolved it (cuda / cpu)
        conn.send(("started", None))
        size = config.parallel.tensor_parallel_size
        group = init_tp_group(rank, size, device, rendezvous, config.parallel.timeout_s)
        mc = config.model
        loaded = load_model(model_path, dtype=mc.dtype, device=device, load_format=mc.load_format,
                            max_positions=mc.max_model_len, seed=mc.seed, tensor_parallel=(rank, size))
        parallelize(loaded.model, group, loaded.arch.vocab_size)
        conn.send(("ready", None))
        _serve(group, loaded.model, loaded.dtype)
    except BaseException as e:  # noqa: BLE001 - rank 0 reports it, with this rank
        logger.exception("tensor-parallel worker rank %d failed", rank)
        try:
            conn.send(("error", f"{type(e).__name__}: {e}"))
        except OSError:
            pass
        os._exit(1)
    from specserve.distributed.state import destroy_tp_group
    destroy_tp_group()


def _exit_with_parent(parent_pid: int) -> None:
    """Rank 0 gone (killed, or exited without stopping us): exit too, whatever the main thread waits on."""
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    os._exit(1)


@torch.inference_mode()
def _serve(group, model, dtype: torch.dtype) -> None:
    from specserve.distributed.wire import packed_size, receive_header, unpack_forward
    from specserve.engine.executor import ModelExecutor
    from specserve.models.layers.attention import get_attention_backend
    from specserve.models.layers.cpu_linear import pack_linears

    device = group.device
    executor = None
    while True:
        header = receive_header(group.control)
        op = header[0]
        if op == "forward":
            packed = _receive(group, (packed_size(header),), torch.int64)
            executor.forward(*unpack_forward(header, packed))
        elif op == "logits":
            executor.compute_logits(_receive(group, header[1], getattr(torch, header[2])))
        elif op == "copy":
            executor.copy_blocks(header[1])
        elif op == "capture":
            executor.capture_graphs(*header[1:])
        elif op == "executor":
            _, backend, block_size, num_blocks = header
            if device.type == "cpu":  # as rank 0's (engine/build.py)
                pack_linears(model)
            executor = ModelExecutor(model, get_attention_backend(backend, device), device, dtype, block_size,
                                     num_blocks)
        elif op == "shutdown":
            return
        else:
            raise RuntimeError(f"unknown call {op!r} from rank 0")


def _receive(group, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    buf = torch.empty(shape, dtype=dtype, device=group.device)
    dist.broadcast(buf, src=0, group=group.model)
    return buf
