"""The tensor-parallel process groups of one engine: `control` (gloo, host-side: what each rank is
to run next; it never times out, since a worker waits on it while the engine is idle: rank 0 bounds its
own waits on it, workers.py) and `model`
(NCCL on GPUs, gloo on the CPU: the model's all-reduces and gathers, and the step's tensors; a
collective that waits past `timeout_s` fails)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# NVLink multicast (NVLS) stays off on the machines this runs on; every process sets it before NCCL starts
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0"}
RENDEZVOUS_TIMEOUT_S = 300.0  # joining the group (workers import torch and load their shard meanwhile)
_IDLE_TIMEOUT = timedelta(days=365)


@dataclass
class TPGroup:
    rank: int
    size: int
    device: torch.device
    control: dist.ProcessGroup
    model: dist.ProcessGroup

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place."""
        dist.all_reduce(t, group=self.model)
        return t


def set_nccl_env() -> None:
    for key, value in NCCL_ENV.items():
        os.environ.setdefault(key, value)


def init_tp_group(rank: int, size: int, device: torch.device, rendezvous: str, timeout_s: float) -> TPGroup:
    """Join the engine's group (`rendezvous`: a file:// URL rank 0 chose). One engine per process."""
    set_nccl_env()
    if dist.is_initialized():
        raise RuntimeError("this process already runs a tensor-parallel engine (one torch.distributed group "
                           "per process): shut it down first")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=size,
                            timeout=timedelta(seconds=RENDEZVOUS_TIMEOUT_S))
    control = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
    model = dist.new_group(backend="nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=timeout_s))
    return TPGroup(rank, size, device, control, model)


def destroy_tp_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r runs on the r-th GPU from the engine's (cuda:0 -> cuda:r); every CPU rank on the CPU."""
    if device.type != "cuda":
        return device
    index = (device.index or 0) + rank
    if index >= torch.cuda.device_count():
        raise ValueError(f"tensor parallelism needs GPU {index} for rank {rank}, but only "
                         f"{torch.cuda.device_count()} GPUs are visible")
    return torch.device("cuda", index)
