"""Process placement: each scheduler (rank or replica) process pins itself to its share of the cores.

The reference (`gpu_proc_affinity`, AD1) binds each GPU's process to `physical_cores // tp_size`
cores starting at `gpu_id * share`. Here the cores are the CPUs this process may run on
(`os.sched_getaffinity`, so `taskset` and cgroup limits are respected), split into contiguous
shares, one per scheduler process on this machine; the first ones get one more core when the count
does not divide. With more processes than cores, process k gets core k mod the number of cores.
Torch's intra-op thread pool is sized to the share, so two replicas do not fight over each other's
cores.
"""

from __future__ import annotations

import logging
import os

from framework.config import ParallelSettings

logger = logging.getLogger(__name__)


def plan_cores(cores: list[int], num_procs: int) -> list[list[int]]:
    """The cores of each of `num_procs` processes, in process order."""
    if num_procs < 1 or not cores:
        raise ValueError("plan_cores needs at least one process and one core")
    if num_procs >= len(cores):
        return [[cores[k % len(cores)]] for k in range(num_procs)]
    base, extra = divmod(len(cores), num_procs)
    shares, start = [], 0
    for k in range(num_procs):
        size = base + (k < extra)
        shares.append(cores[start:start + size])
        start += size
    return shares


def process_slot(parallel: ParallelSettings, dp_rank: int | None, tp_rank: int = 0) -> tuple[int, int]:
    """(index, count) of a scheduler process among this machine's scheduler processes.

    Replicas are numbered first: replica d's rank t is process d * tp_size + t. With DP attention
    the dp_size attention ranks are the tp_size rank processes, numbered by tp_rank."""
    tp_size = parallel.tp_size
    num_dp = 1 if parallel.enable_dp_attention else parallel.dp_size
    per_node = max(1, tp_size // parallel.nnodes)
    count = num_dp * per_node
    replica = 0 if parallel.enable_dp_attention or dp_rank is None else dp_rank
    if replica >= num_dp:
        raise ValueError(f"replica {replica} does not exist with parallel.dp_size = {parallel.dp_size}")
    return replica * per_node + tp_rank % per_node, count


def pin_scheduler_process(parallel: ParallelSettings, dp_rank: int | None, tp_rank: int = 0) -> list[int] | None:
    """Pin the calling process to its share and size torch's threads to it; the cores, or None when
    `parallel.cpu_affinity` is off."""
    if not parallel.cpu_affinity:
        return None
    import torch

    index, count = process_slot(parallel, dp_rank, tp_rank)
    share = plan_cores(sorted(os.sched_getaffinity(0)), count)[index]
    os.sched_setaffinity(0, share)
    torch.set_num_threads(len(share))
    logger.info("Scheduler process %d of %d pinned to cores %s", index, count, share)
    return share
