"""Scratch memory of the kernels, owned by the caller (``K.Workspace``).

Some Triton ops need device scratch between their launches (softmax partials, filter and search
state, chunk masses of the draws, argmax partials). They take it from a ``Workspace`` passed as
``workspace=`` or, without one, from a private default workspace of this module. A workspace keeps
one buffer per (name, dtype, device) and hands out views of it; a buffer grows when a call needs
more, so after the first calls at the largest shapes nothing is allocated any more.

CUDA graphs: a captured graph keeps using the buffers it saw at capture. So a workspace never
allocates during capture (a call that would need more than it holds raises ``RuntimeError``;
``reserve`` sizes it for the largest shapes beforehand), and once it has served a capture, a buffer
that later grows keeps its old storage alive instead of freeing it. The PyTorch reference needs no
scratch and ignores the argument.
"""

from __future__ import annotations

import torch

from ._validate import Checker

__all__ = ["Workspace"]


def _capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream is capturing a graph (never, for other devices)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class Workspace:
    """Scratch buffers of the Triton ops, reused across calls (see the module docstring).

    ``ws = K.Workspace(); ws.reserve("cuda", batch=64, proposal_len=7, vocab=151936, rank=256)`` sizes
    it once for an engine; then pass ``workspace=ws`` to the ops that take it.
    """

    def __init__(self):
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}
        self._retired: list[torch.Tensor] = []  # outgrown buffers a captured graph may still use
        self._captured = False

    @property
    def nbytes(self) -> int:
        """Bytes held by the current buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def buffer(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D view of ``numel`` elements of the buffer ``name``, grown first if it is smaller.

        Contents are undefined (whatever the last user left). Raises ``RuntimeError`` when it would
        have to grow during CUDA-graph capture.
        """
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda" and tensors' "cuda:0" share buffers
            device = torch.device("cuda", torch.cuda.current_device())
        key = (name, dtype, device)
        buf = self._buffers.get(key)
        capturing = _capturing(device)
        self._captured |= capturing
        if buf is None or buf.numel() < numel:
            if capturing:
                held = 0 if buf is None else buf.numel()
                raise RuntimeError(
                    f"Workspace: scratch buffer {name!r} ({dtype}, {device}) needs {numel} elements but holds {held}, "
                    f"and a CUDA graph is being captured (it must not allocate); call Workspace.reserve(...) with the "
                    f"largest shapes, or run the op once at this shape, before capturing")
            if buf is not None and self._captured:
                self._retired.append(buf)
            buf = torch.empty(max(numel, 1), dtype=dtype, device=device)
            self._buffers[key] = buf
        return buf[:numel]

    def reserve(self, device, *, batch: int, proposal_len: int, vocab: int, rank: int, rows: int = 0) -> None:
        """Grow every buffer to what the Triton ops need at these largest shapes.

        ``batch`` requests of ``proposal_len`` drafts over a vocabulary of ``vocab`` (exact: buffer
        sizes are not monotone in V) with Markov rank ``rank``; ``rows`` (default ``batch *
        (proposal_len + 1)``, the verify side) bounds the rows of ``logits_to_probabilities`` and
        ``greedy_accept``. Covers every filter setting (top-k, top-p, both, none) and FP8 or
        fp16/bf16 W2. Without Triton installed there is nothing to reserve.
        """
        c = Checker("Workspace.reserve")
        batch = c.integer("batch", batch, low=1)
        width = c.integer("proposal_len", proposal_len, low=1)
        vocab = c.integer("vocab", vocab, low=1)
        rank = c.integer("rank", rank, low=1)
        rows = c.integer("rows", rows, low=0) or batch * (width + 1)
        try:
            device = torch.device(device)
        except (TypeError, RuntimeError) as exc:
            c.fail(f"device must be a torch.device or device string, got {device!r} ({exc})", TypeError)
        try:
            from .triton.workspace import scratch_sizes
        except ImportError as exc:  # triton itself not installed: the reference needs no scratch
            if "triton" not in str(exc):
                raise
            return
        for (name, dtype), numel in scratch_sizes(batch, rows, vocab, rank).items():
            self.buffer(name, numel, dtype, device)


DEFAULT = Workspace()


def resolve(c: Checker, workspace) -> Workspace:
    """``workspace`` checked, or the default workspace for None."""
    if workspace is None:
        return DEFAULT
    if not isinstance(workspace, Workspace):
        c.fail(f"workspace must be a dspark.kernels.Workspace or None, got {type(workspace).__name__}", TypeError)
    return workspace
