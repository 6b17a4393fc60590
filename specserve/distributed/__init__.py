"""Tensor parallelism over torch.distributed (NCCL between GPUs, gloo between CPU processes).

Rank 0 is the engine: scheduler, sampling, proposers. It runs the target through a
`ParallelExecutor` (executor.py), which mirrors each of its calls (forward, logits, block copies,
graph capture) on the worker processes (worker.py), one per device, each holding its shard of the
model (layers.py, sharding.py). See docs/tensor_parallel.md.
"""
