"""Data-parallel training on PyTorch's own distributed stack: torchrun, ``torch.distributed``, DDP, FSDP2.

``torchrun --nproc-per-node N -m dspark train ...`` starts N processes with ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK`` and the rendezvous address in their environment (several nodes: torchrun's
``--nnodes`` / ``--rdzv-endpoint``); ``init_world`` joins them into one process group (NCCL on
CUDA, gloo on the CPU) with a collective timeout, so that a rank that stops answering ends the job
with an error instead of a hang. Without torchrun's environment a run is one plain process.

Data parallelism here is exact: every rank draws the same global batch and anchors from the same
generators and keeps its contiguous slice (``World.shard``), losses are normalised over the global
batch (``World.mean`` on the denominators), and DDP / FSDP2 average the gradients -- so N processes
compute the one-process step up to float rounding.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..kernels._validate import Checker

__all__ = ["World", "SINGLE", "launched_by_torchrun", "init_world", "close_world", "wrap", "describe_failure"]

_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class World:
    """This process's place among the data-parallel ranks. ``distributed``: a process group is
    initialised (also at world size 1 under torchrun, which exercises the NCCL / FSDP paths)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    distributed: bool = False

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that logs, shows progress and writes checkpoints."""
        return self.rank == 0

    def shard(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous slice of a global batch (dim 0 divisible by the world size)."""
        if batch.shape[0] % self.world_size:
            Checker("World.shard").fail(f"the global batch of {batch.shape[0]} rows does not split into "
                                        f"{self.world_size} equal shards")
        size = batch.shape[0] // self.world_size
        return batch[self.rank * size:(self.rank + 1) * size]

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of ``value`` over the ranks (a new tensor; no autograd), ``value`` itself alone."""
        if not self.distributed:
            return value
        total = value.detach().clone()
        dist.all_reduce(total)
        return total / self.world_size

    def mean_all(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``mean`` of every tensor of ``values`` in one collective (fp32 results)."""
        if not self.distributed:
            return values
        flat = self.mean(torch.cat([v.detach().float().reshape(-1) for v in values.values()]))
        parts = flat.split([v.numel() for v in values.values()])
        return {name: part.view(v.shape) for (name, v), part in zip(values.items(), parts)}

    def broadcast(self, value: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``value`` of rank ``src`` on every rank (in place; every rank passes a tensor of that shape)."""
        if self.distributed:
            dist.broadcast(value, src)
        return value


SINGLE = World()


def launched_by_torchrun() -> bool:
    """True when torchrun (or another launcher with its environment contract) started this process."""
    return all(name in os.environ for name in _TORCHRUN_VARIABLES)


def init_world(device: torch.device, timeout: float = 600.0) -> tuple[World, torch.device]:
    """Join torchrun's process group, or return ``(SINGLE, device)`` for a plain process.

    Under torchrun, ``device`` "cuda" becomes ``cuda:LOCAL_RANK`` (one GPU per process) and the
    backend is NCCL; on the CPU it is gloo. ``timeout`` (seconds) bounds every collective: a rank
    that waits longer for a peer fails with an error (NCCL aborts its communicators).
    """
    c = Checker("init_world")
    timeout = c.real("timeout", timeout, low=1.0)
    if not launched_by_torchrun():
        return SINGLE, device
    rank, world_size, local_rank = (int(os.environ[name]) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if device.type == "cuda":
        if device.index is None:
            if local_rank >= torch.cuda.device_count():
                c.fail(f"local rank {local_rank} has no GPU: this node has {torch.cuda.device_count()}; "
                       f"start at most that many processes per node (--nproc-per-node)")
            device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    elif device.type == "cpu":
        backend = "gloo"
    else:
        c.fail(f"device must be cuda or cpu for data-parallel training, got {device}")
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout),
                            device_id=device if backend == "nccl" else None)
    return World(rank, world_size, local_rank, True), device


def close_world(world: World) -> None:
    """Leave the process group after a successful run (an error exits without waiting for peers)."""
    if world.distributed and dist.is_initialized():
        # every rank past its last collective (rank 0 writes the checkpoint last) before any tears its
        # connections down: a peer leaving early can abort the others' transport threads at exit
        dist.barrier()
        dist.destroy_process_group()


def wrap(module: nn.Module, world: World, *, fsdp: bool = False, shard_units=()) -> nn.Module:
    """``module`` ready for data-parallel training: itself in a plain process, DDP over its trainable
    parameters, or with ``fsdp`` sharded by FSDP2: each of ``shard_units`` (submodules whose
    ``forward`` the step calls) is a unit of its own, gathered only around its own call; the rest
    of ``module`` is the root unit. Parameters, gradients and optimizer state then live 1/N per rank.
    """
    c = Checker("wrap")
    if fsdp and not world.distributed:
        c.fail("fsdp needs a process group: launch with torchrun (torchrun --nproc-per-node N -m dspark train ...)")
    if not world.distributed:
        return module
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for unit in shard_units:
            fully_shard(unit)
        return fully_shard(module)
    device = next(module.parameters()).device
    return nn.parallel.DistributedDataParallel(module, device_ids=[device] if device.type == "cuda" else None)


def describe_failure(exc: BaseException, world: World) -> str:
    """One line for an error on this rank: prefixed with the rank when there are several, and
    naming the likely cause when a collective failed (a peer died, or timed out)."""
    text = " ".join(str(exc).split())
    if world.world_size > 1:
        text = f"rank {world.rank}/{world.world_size}: {text}"
    # NCCL raises DistError; gloo a plain RuntimeError that names its own source file
    if isinstance(exc, dist.DistError) or "/gloo/" in text:
        text += (" -- a collective with the other ranks failed: another rank died or stopped answering "
                 "(see its error; --dist-timeout bounds the wait)")
    return text
