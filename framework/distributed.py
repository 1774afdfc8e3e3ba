"""torch.distributed for tensor parallelism and DP attention (reference A1, A4, L2).

One scheduler process per rank; the ranks form one group (gloo on CPU, nccl on CUDA, plus a gloo
group for Python objects). Ranks on node k are ``k * tp_per_node .. (k + 1) * tp_per_node - 1``
with ``tp_per_node = tp_size // nnodes``; node 0 holds rank 0, which talks to the tokenizer.

`ParallelContext` is this process's place in the group and its collectives. The model reads it
through `get_parallel_context()` (as the reference reads its global TP group); a process that never
called `init_parallel` gets the single-rank context, whose collectives are no-ops.
"""

from __future__ import annotations

import hashlib
import hmac
import pickle
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from framework.config import ParallelSettings, Settings
    from framework.model.config import ModelConfig


class ParallelConfigError(ValueError):
    """The parallel settings cannot work for this model or machine layout."""


@dataclass
class ParallelContext:
    """This rank and the collectives of its group.

    With DP attention, attention is data-parallel (each rank runs all heads on its own requests)
    and only the MLP is tensor-parallel, so the attention shard is the whole layer.
    """

    tp_rank: int = 0
    tp_size: int = 1
    dp_attention: bool = False
    device_group: Any = None  # tensors (gloo on CPU, nccl on CUDA)
    cpu_group: Any = None  # pickled objects and small int tensors (always gloo)
    secret: bytes = b""  # authenticates broadcast_pyobj's pickles (parallel.dist_secret)

    @property
    def attn_tp_rank(self) -> int:
        return 0 if self.dp_attention else self.tp_rank

    @property
    def attn_tp_size(self) -> int:
        return 1 if self.dp_attention else self.tp_size

    @property
    def gathers_mlp_tokens(self) -> bool:
        """DP attention over several ranks: the MLP runs on every rank's tokens (L2)."""
        return self.dp_attention and self.tp_size > 1

    # -- tensor collectives ---------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks (the row-parallel layers' reduction)."""
        if self.tp_size == 1:
            return x
        dist.all_reduce(x, group=self.device_group)
        return x

    def gather_rows(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Every rank's rows, each rank's block padded to max(counts): [tp_size * max, ...]."""
        width = max(counts)
        padded = x.new_zeros((width, *x.shape[1:]))
        padded[: x.shape[0]] = x
        blocks = [torch.empty_like(padded) for _ in range(self.tp_size)]
        dist.all_gather(blocks, padded, group=self.device_group)
        return torch.cat(blocks)

    def own_rows(self, gathered: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """This rank's rows of a `gather_rows` layout."""
        start = self.tp_rank * max(counts)
        return gathered[start : start + counts[self.tp_rank]]

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank (same shape and dtype on all ranks)."""
        if self.tp_size > 1:
            dist.broadcast(x, src=0, group=self.cpu_group)
        return x

    # -- small CPU collectives ------------------------------------------------------------------

    def all_gather_int(self, value: int) -> list[int]:
        if self.tp_size == 1:
            return [value]
        out = torch.zeros(self.tp_size, dtype=torch.int64)
        blocks = list(out.chunk(self.tp_size))
        dist.all_gather(blocks, torch.tensor([value], dtype=torch.int64), group=self.cpu_group)
        return out.tolist()

    def any_true(self, flag: bool) -> bool:
        if self.tp_size == 1:
            return flag
        t = torch.tensor([int(flag)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.cpu_group)
        return bool(t.item())

    def broadcast_pyobj(self, objs: list[Any]) -> list[Any]:
        """Rank 0's list on every rank (reference A4: a size tensor, then the pickled bytes)."""
        if self.tp_size == 1:
            return objs
        if self.tp_rank == 0:
            payload = seal(self.secret, pickle.dumps(objs)) if objs else b""
            size = torch.tensor([len(payload)], dtype=torch.int64)
            dist.broadcast(size, src=0, group=self.cpu_group)
            if payload:
                data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
                dist.broadcast(data, src=0, group=self.cpu_group)
            return objs
        size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.cpu_group)
        if size.item() == 0:
            return []
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(data, src=0, group=self.cpu_group)
        return pickle.loads(unseal(self.secret, data.numpy().tobytes()))


_CONTEXT = ParallelContext()
MAC_LEN = hashlib.sha256().digest_size


class UnauthenticatedMessage(RuntimeError):
    """A broadcast whose HMAC does not match parallel.dist_secret: never unpickled."""


def seal(secret: bytes, payload: bytes) -> bytes:
    """`payload` prefixed with its HMAC-SHA256 under `secret`."""
    return hmac.new(secret, payload, hashlib.sha256).digest() + payload


def unseal(secret: bytes, sealed: bytes) -> bytes:
    """The payload of `seal(secret, payload)`; raises UnauthenticatedMessage if it was not."""
    mac, payload = sealed[:MAC_LEN], sealed[MAC_LEN:]
    if not hmac.compare_digest(mac, hmac.new(secret, payload, hashlib.sha256).digest()):
        raise UnauthenticatedMessage("a broadcast from rank 0 failed its HMAC check (parallel.dist_secret differs?)")
    return payload


def get_parallel_context() -> ParallelContext:
    return _CONTEXT


def init_parallel(settings: "Settings", tp_rank: int, init_addr: str) -> ParallelContext:
    """Join the group of `settings.parallel.tp_size` ranks at `init_addr` (host:port)."""
    global _CONTEXT
    par = settings.parallel
    if par.tp_size == 1:
        _CONTEXT = ParallelContext(dp_attention=par.enable_dp_attention)
        return _CONTEXT
    on_cuda = settings.worker.device.startswith("cuda")
    # Idle ranks wait in a collective for the next poll of rank 0, and busy ones for the
    # slowest forward pass; the watchdog bounds the latter.
    timeout = timedelta(seconds=settings.scheduler.watchdog_timeout + 60)
    dist.init_process_group(
        "nccl" if on_cuda else "gloo", init_method=f"tcp://{init_addr}", world_size=par.tp_size,
        rank=tp_rank, timeout=timeout,
    )
    device_group = dist.group.WORLD
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if on_cuda else device_group
    secret = (par.dist_secret or "").encode()
    _CONTEXT = ParallelContext(tp_rank, par.tp_size, par.enable_dp_attention, device_group, cpu_group, secret)
    return _CONTEXT


def destroy_parallel() -> None:
    global _CONTEXT
    if dist.is_initialized():
        dist.destroy_process_group()
    _CONTEXT = ParallelContext()


def local_device(device: str, tp_rank: int, par: "ParallelSettings") -> str:
    """`cuda` becomes this rank's GPU on its node; other devices are used as given."""
    if device != "cuda":
        return device
    return f"cuda:{tp_rank % (par.tp_size // par.nnodes)}"


def node_ranks(par: "ParallelSettings") -> list[int]:
    """The ranks whose scheduler processes run on this node (reference A1)."""
    per_node = par.tp_size // par.nnodes
    return list(range(par.node_rank * per_node, (par.node_rank + 1) * per_node))


def check_layout(par: "ParallelSettings", one_replica: bool = False) -> None:
    """Settings-only checks, before anything is loaded or spawned. `one_replica`: the server is
    one replica of dp_size (DP_RANK is set), started on its own."""
    if par.tp_size % par.nnodes:
        raise ParallelConfigError(
            f"parallel.tp_size ({par.tp_size}) must be a multiple of parallel.nnodes ({par.nnodes})"
        )
    if par.node_rank >= par.nnodes:
        raise ParallelConfigError(f"parallel.node_rank ({par.node_rank}) must be below nnodes ({par.nnodes})")
    if par.nnodes > 1 and not par.dist_init_addr:
        raise ParallelConfigError("parallel.dist_init_addr (host:port of node 0) is required when nnodes > 1")
    if par.enable_dp_attention and par.nnodes > 1:
        raise ParallelConfigError(
            "parallel.enable_dp_attention runs on one node: every rank needs the tokenizer's IPC sockets"
        )
    if par.enable_dp_attention and one_replica:
        raise ParallelConfigError(
            "DP_RANK names one replica, but with parallel.enable_dp_attention the ranks of one group are "
            "the replicas: unset DP_RANK"
        )
    if par.dp_size > 1 and not par.enable_dp_attention and not one_replica:
        check_replicas_layout(par)


def check_replicas_layout(par: "ParallelSettings") -> None:
    """dp_size replicas behind the controller run on one node, each rank group at a free port."""
    if par.nnodes > 1:
        raise ParallelConfigError(
            "parallel.dp_size > 1 runs its replicas on one node; across nodes, start one server per "
            "replica with DP_RANK set"
        )
    if par.dist_init_addr and par.tp_size > 1:
        raise ParallelConfigError(
            "parallel.dist_init_addr names one rendezvous, but dp_size > 1 replicas are one tensor-parallel "
            "group each (each gets a free local port): leave it empty"
        )


def check_lora_layout(par: "ParallelSettings", lora_paths: list[str]) -> None:
    """LoRA adapters are loaded whole into each layer, so they need unsharded layers (DP attention
    shards the MLP too); data-parallel replicas each load their own copy and are fine."""
    if lora_paths and par.tp_size > 1:
        raise ParallelConfigError(
            f"model.lora_paths: LoRA adapters need parallel.tp_size = 1 (got {par.tp_size}); "
            "for several replicas use parallel.dp_size"
        )


def check_model_fits(config: "ModelConfig", tp: int, dp_attention: bool) -> None:
    """Every rank must get whole attention heads and an equal slice of the MLP."""
    problems = []
    if not dp_attention:
        for name, value in (("attention heads", config.num_heads), ("KV heads", config.num_kv_heads)):
            if value % tp:
                problems.append(f"the model's {value} {name} do not divide into tp_size={tp} ranks")
    if config.intermediate_size % tp:
        problems.append(f"the MLP's intermediate size {config.intermediate_size} does not divide by tp_size={tp}")
    if problems:
        raise ParallelConfigError("parallel.tp_size: " + "; ".join(problems))
