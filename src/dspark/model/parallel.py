"""Tensor parallelism of the target: which part of each weight a rank holds, and the collectives
that put the parts back together (Megatron-LM's split, as vLLM and nano-vllm shard Llama).

A rank of ``size`` holds ``1/size`` of the attention heads (its rows of the q, k and v projections,
its columns of the output projection), of the MLP's intermediate features (rows of gate and up,
columns of down) and of the vocabulary (rows of the embedding and the head, the last shard padded
with zero rows). The output projection and down projection give each rank a partial sum of the
full result, which ``all_reduce`` adds up; the embedding gives each token's row on the rank that
holds it and zeros elsewhere (``all_reduce`` again: adding zeros is exact); the head gives each rank
its vocabulary columns of the logits, which ``gather_vocab`` concatenates. Every rank ends each
layer with the same hidden states and the forward with the same full logits, so all that follows
(acceptance, the draft, the host's bookkeeping) runs replicated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels._validate import Checker

__all__ = ["TensorParallel", "SINGLE_RANK"]


@dataclass(frozen=True)
class TensorParallel:
    """This process's rank among ``size`` tensor-parallel ranks (``size`` 1: no process group, every
    collective the identity). With ``size`` > 1, ``torch.distributed``'s default process group must
    be the ranks' (``dspark.engine.ranks`` starts it: NCCL on GPUs, gloo on the CPU)."""

    rank: int = 0
    size: int = 1

    def part(self, n: int, what: str) -> tuple[int, int]:
        """This rank's ``[lo, hi)`` of ``n`` things split evenly (``what`` names them in the error
        when ``n`` does not split into ``size`` equal parts)."""
        if n % self.size:
            Checker("tensor_parallel_size").fail(
                f"the target's {what} ({n}) do not split into {self.size} equal parts: tensor_parallel_size must "
                f"divide it")
        step = n // self.size
        return self.rank * step, (self.rank + 1) * step

    def vocab_part(self, vocab: int) -> tuple[int, int, int]:
        """``(lo, hi, rows)``: this rank's token ids ``[lo, hi)`` of the embedding and the head, held
        in ``rows`` = ceil(vocab / size) rows (the last rank's padded with zero rows)."""
        rows = -(-vocab // self.size)
        lo = min(self.rank * rows, vocab)
        return lo, min(lo + rows, vocab), rows

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x`` (in place; ``x`` itself at size 1)."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x)
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab: int) -> torch.Tensor:
        """Every rank's vocabulary columns ``[M, rows]`` side by side: ``[M, vocab]``."""
        if self.size == 1:
            return logits
        import torch.distributed as dist

        parts = [torch.empty_like(logits) for _ in range(self.size)]
        dist.all_gather(parts, logits.contiguous())
        return torch.cat(parts, dim=-1)[..., :vocab]

    def min(self, value: int) -> int:
        """The smallest ``value`` of all ranks (what every rank can hold, e.g. KV blocks)."""
        if self.size == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64, device=_collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())


def _collective_device() -> torch.device:
    """Where the default group's collectives take tensors: this rank's GPU under NCCL, else the CPU."""
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


SINGLE_RANK = TensorParallel()
