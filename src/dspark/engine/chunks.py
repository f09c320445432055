"""Prompt chunks: the prompt tokens of admitted requests that a step runs beside the running rows.

The scheduler plans ``PrefillChunk`` s; the runner stages them in ``ChunkBuffers`` -- pinned host
rows copied to fixed device addresses in one transfer, padded to a power-of-two bucket, so that a
captured CUDA graph of a step with chunks reads any step's chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .drafting import MAX_LOGIT_BIAS_TOKENS, RowSampling, SamplingParams

__all__ = ["ChunkBuffers", "GRAPH_CHUNK_TOKENS", "MAX_CHUNKS", "PrefillChunk", "pads_verify"]

MAX_CHUNKS = 8  # prompt chunks per step (the static seats of a captured mixed step)
# chunk buckets with a graph per verify total (rows bucket x 1 .. P + 1 tokens per row); a step with
# more chunk tokens verifies every row's full length (the padding is small beside its chunks), so
# that the larger buckets -- the slowest graphs to capture -- need one verify total each
GRAPH_CHUNK_TOKENS = 256


@dataclass
class PrefillChunk:
    """Prompt tokens of an admitted request run in this step: ``token_ids`` at positions ``start ..``
    of cache line ``slot``. ``row`` >= 0 when the chunk ends the prompt: the batch row the request
    takes, its first token drawn from the last position's logits with its sampling settings -- or,
    with ``anchor`` >= 0 (a preempted request running its tokens again), that token kept as the
    row's anchor, so that its next round is the one it would have run."""

    slot: int
    token_ids: list[int]
    start: int
    row: int = -1
    sampling: SamplingParams = field(default_factory=SamplingParams)
    anchor: int = -1



class ChunkBuffers:
    """The prompt chunks of one step, staged on the host (pinned) and copied to the device in one
    transfer, at fixed addresses so that a captured mixed step reads any step's chunks.

    Up to ``max_chunks`` chunks of ``capacity`` tokens in all, padded to the step's chunk bucket
    by one padding request on the dummy line; per chunk its request (slot, first position, token
    offsets ``cu``); per seat (a chunk that ends its prompt) its row, the offset of its last token,
    the prompt length, seed, kept anchor (or -1), slot and sampling settings -- unused seats name
    the scratch row. A seat's logit bias travels sparse, as up to ``MAX_LOGIT_BIAS_TOKENS`` (token
    id, bias) entries at fixed offsets (unused ones: id 0, bias 0), and becomes its row of the dense
    per-row bias inside the step (``write_seat_biases``): 160 kB staged per step rather than a
    vocabulary per seat.
    """

    def __init__(self, capacity: int, max_chunks: int, device):
        self.capacity, self.max_chunks, self.device = capacity, max_chunks, device
        m = max_chunks
        self.sizes = {"positions": capacity, "slots": capacity, "request_slots": m + 1, "request_starts": m + 1,
                      "cu": m + 2, "seat_ends": m, "seat_slots": m, "seat_top_k": m}
        width = sum(self.sizes.values())
        pinned = device.type == "cuda"
        self.bias_capacity = MAX_LOGIT_BIAS_TOKENS
        entries = m * MAX_LOGIT_BIAS_TOKENS
        # int64 ids, seats' rows / last offsets / seeds / kept anchors, the seats' biased token ids;
        # int32 metadata the kernels read (and the seats' top-k); the seats' f32 temperatures, top-p,
        # min-p and biases
        self.host64 = torch.zeros(capacity + 4 * m + entries, dtype=torch.int64, pin_memory=pinned)
        self.host32 = torch.zeros(width, dtype=torch.int32, pin_memory=pinned)
        self.hostf = torch.zeros(3 * m + entries, dtype=torch.float32, pin_memory=pinned)
        self.dev64 = torch.zeros_like(self.host64, device=device)
        self.dev32 = torch.zeros_like(self.host32, device=device)
        self.devf = torch.zeros_like(self.hostf, device=device)
        self.ids = self.dev64[:capacity]
        self.seat_rows, self.seat_last = self.dev64[capacity:capacity + m], self.dev64[capacity + m:capacity + 2 * m]
        self.seat_seeds = self.dev64[capacity + 2 * m:capacity + 3 * m]
        self.seat_anchors = self.dev64[capacity + 3 * m:capacity + 4 * m]
        self.bias_ids, self.bias_values = self.dev64[capacity + 4 * m:], self.devf[3 * m:]
        self._meta = self._views(self.dev32)
        # the seats' settings but their bias, which ``write_seat_biases`` puts in the seats' rows
        self.seat_sampling = RowSampling(self.devf[:m], self._meta["seat_top_k"], self.devf[m:2 * m],
                                         self.devf[2 * m:3 * m])
        self._copied = None  # the event of the last transfer: the pinned rows are reused after it

    def _views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        views, at = {}, 0
        for name, size in self.sizes.items():
            views[name], at = flat[at:at + size], at + size
        return views

    def write_seat_biases(self, logit_bias: torch.Tensor) -> None:
        """Each seat's staged bias as its row of the dense ``logit_bias`` f32 ``[rows, V]`` (unused
        seats': the scratch row's, zero): the seats' rows zeroed, then the entries added (an unused
        entry adds 0, so it changes nothing where it lands). Device ops only: captured in the step."""
        logit_bias.index_fill_(0, self.seat_rows, 0.0)
        rows = self.seat_rows[:, None].expand(-1, self.bias_capacity).reshape(-1)
        logit_bias.view(-1).scatter_add_(0, rows * logit_bias.shape[1] + self.bias_ids, self.bias_values)

    def device_meta(self) -> dict[str, torch.Tensor]:
        return self._meta

    def stage(self, chunks: list[PrefillChunk], bucket: int, dummy_slot: int, scratch_row: int) -> int:
        """Write ``chunks`` padded to ``bucket`` tokens; returns ``bucket``."""
        if self._copied is not None:
            self._copied.synchronize()
        m, cap = self.max_chunks, self.capacity
        lengths = [len(c.token_ids) for c in chunks]
        n = sum(lengths)
        if len(chunks) > m or n > cap:
            raise ValueError(f"a step takes at most {m} prompt chunks of {cap} tokens in all, got "
                             f"{len(chunks)} of {n}")
        h64, h = self.host64, self._views(self.host32)
        h64[:n] = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.int64)
        h64[n:bucket] = 0
        offsets = [0]
        for c, k in zip(chunks, lengths):
            at = offsets[-1]
            h["positions"][at:at + k] = torch.arange(c.start, c.start + k, dtype=torch.int32)
            h["slots"][at:at + k] = c.slot
            offsets.append(at + k)
        h["positions"][n:bucket] = torch.arange(bucket - n, dtype=torch.int32)  # the padding request
        h["slots"][n:bucket] = dummy_slot
        h["request_slots"].fill_(dummy_slot)
        h["request_starts"].zero_()
        h["cu"][: len(offsets)] = torch.tensor(offsets, dtype=torch.int32)
        h["cu"][len(offsets):m + 1] = n
        h["cu"][m + 1] = bucket
        seats = [(c, offsets[i + 1] - 1) for i, c in enumerate(chunks) if c.row >= 0]
        for i, c in enumerate(chunks):
            h["request_slots"][i], h["request_starts"][i] = c.slot, c.start
        rows, last, seeds, anchors = (h64[cap + i * m:cap + (i + 1) * m] for i in range(4))
        temperature, top_k, top_p, min_p = self.hostf[:m], h["seat_top_k"], self.hostf[m:2 * m], self.hostf[2 * m:3 * m]
        bias_ids, bias_values = h64[cap + 4 * m:], self.hostf[3 * m:]
        rows.fill_(scratch_row), last.zero_(), seeds.zero_(), top_k.zero_(), temperature.zero_(), top_p.fill_(1.0)
        anchors.fill_(-1), min_p.zero_(), bias_ids.zero_(), bias_values.zero_()
        h["seat_ends"].fill_(1), h["seat_slots"].fill_(dummy_slot)
        for j, (c, end) in enumerate(seats):
            rows[j], last[j], seeds[j], anchors[j] = c.row, end, c.sampling.seed_bits, c.anchor
            temperature[j], top_k[j], top_p[j] = c.sampling.temperature, c.sampling.top_k, c.sampling.top_p
            min_p[j] = c.sampling.min_p
            if c.sampling.logit_bias:
                ids, values = zip(*c.sampling.logit_bias)
                at = j * self.bias_capacity
                bias_ids[at:at + len(ids)] = torch.tensor(ids, dtype=torch.int64)
                bias_values[at:at + len(ids)] = torch.tensor(values, dtype=torch.float32)
            h["seat_ends"][j], h["seat_slots"][j] = c.start + len(c.token_ids), c.slot
        blocking = self.device.type != "cuda"
        self.dev64.copy_(self.host64, non_blocking=not blocking)
        self.dev32.copy_(self.host32, non_blocking=not blocking)
        self.devf.copy_(self.hostf, non_blocking=not blocking)
        if not blocking:
            self._copied = torch.cuda.Event()
            self._copied.record()
        return bucket


def pads_verify(bucket: int) -> bool:
    """Whether a step with ``bucket`` chunk tokens pads its running rows' verify to their full length."""
    return bucket > GRAPH_CHUNK_TOKENS
