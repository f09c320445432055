"""Per-kernel device time of the sampled path's multi-launch operations (where a benchmark row's time goes),
and of a hybrid target's gated DeltaNet verify window in its two forms.

``python -m dspark.bench.breakdown`` runs each case a few times under ``torch.profiler`` and prints, for
every Triton kernel it launched, the mean device time per call of the operation (the ``gated_delta_*``
cases also the median of one call replayed as a CUDA graph: CUDA events, L2 flushed before each,
``common.graph_us``). The benchmark rows (``python -m dspark.bench``) give the end-to-end numbers; this
says which launch dominates them.

The ``gated_delta_*`` cases are one gated DeltaNet layer of Qwen3.5-9B (32 value heads of 128 x 128,
bf16 inputs, f32 state) over a verify window of 8 positions per request: ``K.gated_delta_scan`` writing
the state after every position (the engine's default) against ``K.gated_delta_replay_scan`` replaying
an accepted prefix of the last window from its kept inputs and writing one checkpoint (the engine's
``gated_delta_checkpoints``).
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch

import dspark.kernels as K

from .common import graph_us
from .sampling import PROPOSAL_LEN, TEMPERATURE, VOCAB, _logits, accept_inputs, draw_inputs, round_inputs

REPEATS = 20


def _accept_case(batch: int):
    args = accept_inputs(batch)
    return lambda: K.probabilistic_accept(*args)


# the mixed-settings workload's settings (bench.serve.MIXED_SETTINGS), one per row in turn
MIXED = ((0.0, 0, 1.0), (0.7, 0, 0.9), (1.0, 0, 0.95), (1.0, 0, 1.0))


def _per_row(rows: int):
    """Per-row ``(temperature, top_k, top_p)`` tensors cycling through ``MIXED``."""
    t, k, p = zip(*(MIXED[i % len(MIXED)] for i in range(rows)))
    return (torch.tensor(t, device="cuda"), torch.tensor(k, dtype=torch.int32, device="cuda"),
            torch.tensor(p, device="cuda"))


def _probabilities_case(rows: int, top_k: int, top_p: float, flat: bool, per_row: bool = False):
    logits = _logits(rows, flat, seed=rows)
    settings = _per_row(rows) if per_row else (TEMPERATURE, top_k, top_p)
    return lambda: K.logits_to_probabilities(logits, *settings)


# the engine's request stage: MIXED's rows with min_p 0, then rows with every filter (top-k, min_p)
REQUEST_FILTERS = ((0.8, 50, 0.9, 0.05), (1.0, 0, 1.0, 0.1), (0.7, 2000, 0.95, 0.0))


def _request_case(rows: int, backend: str, every_filter: bool = False, *, peaked: bool = False, bias: str = "",
                  search_only: bool = False):
    """``K.request_probabilities`` on ``backend`` (its Triton kernels, or the torch reference: one sort
    of each row), per-row settings cycling through ``MIXED`` (and ``REQUEST_FILTERS``). ``peaked``: each
    row's largest logit leads by 100 (the load benchmark's peaked target: every nucleus one token).
    ``bias``: the rows as a verify's ``[rows / 8, 8, V]`` with a dense zero ``logit_bias`` per request,
    the engine's sampled path: ``"fused"`` passed to the op, ``"apart"`` added before it (the stage
    before the op took it). ``search_only``: the Triton op without its candidates kernel (every
    top-k and nucleus row searched in value space, as before the candidates decided them)."""
    logits = _logits(rows, False, seed=rows)
    if peaked:
        logits[torch.arange(rows, device="cuda"), torch.randint(0, VOCAB, (rows,), device="cuda")] = 100.0
    cycle = [(*s, 0.0) for s in MIXED] + list(REQUEST_FILTERS if every_filter else ())
    per = 1
    if bias:
        per, logits = PROPOSAL_LEN + 1, logits.view(rows // (PROPOSAL_LEN + 1), PROPOSAL_LEN + 1, VOCAB)
    t, k, p, m = zip(*(cycle[i % len(cycle)] for i in range(rows // per)))
    settings = (torch.tensor(t, device="cuda"), torch.tensor(k, dtype=torch.int32, device="cuda"),
                torch.tensor(p, device="cuda"), torch.tensor(m, device="cuda"))
    zero_bias = torch.zeros(rows // per, VOCAB, device="cuda")
    from dspark.kernels.triton import request

    def run():
        candidates = request._candidates_kernel
        if search_only:
            request._candidates_kernel = _NoLaunch()
        try:
            with K.use_backend(backend):
                if bias == "fused":
                    K.request_probabilities(logits, *settings, logit_bias=zero_bias)
                elif bias == "apart":
                    K.request_probabilities(logits + zero_bias[:, None], *settings)
                else:
                    K.request_probabilities(logits, *settings)
        finally:
            request._candidates_kernel = candidates

    return run


class _NoLaunch:
    """A kernel that launches nothing (``kernel[grid](...)`` does nothing)."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _top_ids_case(batch: int, backend: str):
    """A sampled draft round's candidates: the 64 largest backbone logits plus the rows' dense (zero)
    ``logit_bias`` of each of ``batch`` x 7 slots of an 8-slot block (``K.markov_candidate_sample``'s
    first step) on ``backend`` (the reference: the bias added, then ``torch.topk``, as the engine did)."""
    from dspark.kernels._backend import implementation

    block, count = PROPOSAL_LEN + 1, 64
    logits = _logits(batch * block, False, seed=batch)
    bias = torch.zeros(batch, VOCAB, device="cuda")
    ids = torch.zeros(batch, PROPOSAL_LEN, count + 16, dtype=torch.int32, device="cuda")
    with K.use_backend(backend):
        top_ids = implementation("candidate_top_ids", logits.device)
    return lambda: top_ids(logits, block, 1, ids, count, bias)


def _draft_store_case(batch: int, in_place: bool):
    """A sampled draft round's q (80 candidates per step) made dense in the rows' ``[B, 7, V]`` buffer:
    in place (zero, scatter), or in a new tensor then copied (as before the drafter took the buffer)."""
    gen = torch.Generator(device="cuda").manual_seed(batch)
    q = torch.rand(batch, PROPOSAL_LEN, 80, device="cuda", generator=gen)
    ids = torch.randint(0, VOCAB, (batch, PROPOSAL_LEN, 80), device="cuda", generator=gen)
    rows = torch.zeros(batch, PROPOSAL_LEN, VOCAB, device="cuda")
    if in_place:
        return lambda: rows.zero_().scatter_add_(2, ids, q)
    return lambda: rows.copy_(torch.zeros_like(rows).scatter_add_(2, ids, q))


def _draw_case(batch: int):
    probs, uniforms, tokens = draw_inputs(batch)
    return lambda: K.sample_probability_rows(probs, uniforms, tokens, 3)


def _sample_step_case(batch: int, rank: int, top_k: int, top_p: float, per_row: bool = False):
    backbone, w1, w2, first, uniforms, tokens, probs = round_inputs(rank, batch)
    settings = _per_row(batch) if per_row else (TEMPERATURE, top_k, top_p)
    return lambda: K.markov_sample_step(backbone, w1, w2, first, uniforms, tokens, probs, 0, *settings)


QWEN35_DELTA_HEADS, QWEN35_DELTA_DK, QWEN35_DELTA_DV = 32, 128, 128  # Qwen3.5-9B's gated DeltaNet (value heads)
VERIFY_WINDOW = 8  # a DSpark round's verify positions per request (block 7 + the anchor)


def _delta_window(batch: int, seed: int) -> tuple[torch.Tensor, ...]:
    """``q, k, v, g, beta`` of ``batch`` requests' ``VERIFY_WINDOW`` tokens each (bf16; ``g`` f32)."""
    n, heads = batch * VERIFY_WINDOW, QWEN35_DELTA_HEADS
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(n, heads, d, generator=gen, device="cuda").bfloat16()
               for d in (QWEN35_DELTA_DK, QWEN35_DELTA_DK, QWEN35_DELTA_DV))
    g = -torch.rand(n, heads, generator=gen, device="cuda")
    return q, k, v, g, torch.rand(n, heads, generator=gen, device="cuda").bfloat16()


def _per_position_case(batch: int):
    """``K.gated_delta_scan``: each request reads its state once and writes it after each position."""
    window = VERIFY_WINDOW
    inputs = _delta_window(batch, seed=batch)
    ring = torch.randn(batch + 1, window + 1, QWEN35_DELTA_HEADS, QWEN35_DELTA_DK, QWEN35_DELTA_DV,
                       device="cuda") * 0.1
    lines = torch.arange(batch, device="cuda")
    addressing = (lines, torch.zeros_like(lines), lines * window, torch.full_like(lines, window),
                  lines.repeat_interleave(window), torch.arange(batch * window, device="cuda") % window + 1)
    return lambda: K.gated_delta_scan(*inputs, ring, *addressing, scale=QWEN35_DELTA_DK ** -0.5)


def _replay_case(batch: int, replayed: int):
    """``K.gated_delta_replay_scan``: each request reads its checkpoint, replays ``replayed`` kept
    tokens of its last window, writes the new checkpoint (into its other slot, as the engine would),
    then runs and keeps this window's tokens."""
    window, heads = VERIFY_WINDOW, QWEN35_DELTA_HEADS
    inputs = _delta_window(batch, seed=batch)
    checkpoints = torch.randn(batch + 1, 2, heads, QWEN35_DELTA_DK, QWEN35_DELTA_DV, device="cuda") * 0.1
    last = _delta_window(batch, seed=batch + 1)[1:]  # the last window's k, v, g, beta in entries 0 .. window - 1
    kept = [torch.zeros(batch + 1, 2 * window, *t.shape[1:], dtype=t.dtype, device="cuda") for t in last]
    for store, t in zip(kept, last):
        store[:batch, :window] = t.view(batch, window, *t.shape[1:])
    lines = torch.arange(batch, device="cuda")
    addressing = K.Replay(lines, read_entries=torch.zeros_like(lines), replay_entries=torch.zeros_like(lines),
                          replay_counts=torch.full_like(lines, replayed), write_entries=torch.ones_like(lines),
                          keep_entries=torch.full_like(lines, window), first_tokens=lines * window,
                          token_counts=torch.full_like(lines, window))
    return lambda: K.gated_delta_replay_scan(*inputs, checkpoints, *kept, *addressing, scale=QWEN35_DELTA_DK ** -0.5)


CASES = {
    "probabilistic_accept B=1": lambda: _accept_case(1),
    "probabilistic_accept B=64": lambda: _accept_case(64),
    "sample_probability_rows B=64": lambda: _draw_case(64),
    "logits_to_probabilities rows=64 none": lambda: _probabilities_case(64, 0, 1.0, False),
    "logits_to_probabilities rows=64 top-k 50": lambda: _probabilities_case(64, 50, 1.0, False),
    "logits_to_probabilities rows=64 top-p 0.9 flat": lambda: _probabilities_case(64, 0, 0.9, True),
    "logits_to_probabilities rows=512 top-k 50": lambda: _probabilities_case(512, 50, 1.0, False),
    "logits_to_probabilities rows=512 top-p 0.9 flat": lambda: _probabilities_case(512, 0, 0.9, True),
    "markov_sample_step B=1 R=64 top-k 50 + top-p 0.9": lambda: _sample_step_case(1, 64, 50, 0.9),
    "markov_sample_step B=1 R=256 top-p 0.9": lambda: _sample_step_case(1, 256, 0, 0.9),
    "markov_sample_step B=64 R=256 none": lambda: _sample_step_case(64, 256, 0, 1.0),
    "markov_sample_step B=64 R=256 top-k 50": lambda: _sample_step_case(64, 256, 50, 1.0),
    # per-row settings (the engine's sampled rows) beside one setting for all rows
    "logits_to_probabilities rows=512 top-p 0.9": lambda: _probabilities_case(512, 0, 0.9, False),
    "logits_to_probabilities rows=512 per-row mixed": lambda: _probabilities_case(512, 0, 1.0, False, True),
    "markov_sample_step B=64 R=256 top-p 0.9": lambda: _sample_step_case(64, 256, 0, 0.9),
    "markov_sample_step B=64 R=256 per-row mixed": lambda: _sample_step_case(64, 256, 0, 1.0, True),
    # the engine's request stage (vLLM's filters): 64 rows x 8 verify positions, and one draft step of 64 rows
    "request_probabilities rows=512 per-row mixed": lambda: _request_case(512, "triton"),
    "request_probabilities rows=512 per-row mixed (torch reference)": lambda: _request_case(512, "reference"),
    "request_probabilities rows=512 every filter": lambda: _request_case(512, "triton", True),
    "request_probabilities rows=512 every filter (torch reference)": lambda: _request_case(512, "reference", True),
    "request_probabilities rows=64 per-row mixed": lambda: _request_case(64, "triton"),
    # issue 40's mixed-settings cost per B = 64 round, before / after in one run (the "apart", "search
    # only" and "copy" cases are the earlier code paths)
    "request_probabilities rows=512 per-row mixed (search only)": lambda: _request_case(512, "triton",
                                                                                        search_only=True),
    "request_probabilities rows=512 every filter (search only)": lambda: _request_case(512, "triton", True,
                                                                                       search_only=True),
    "request_probabilities rows=512 per-row mixed peaked": lambda: _request_case(512, "triton", peaked=True),
    "request_probabilities rows=512 per-row mixed peaked (search only)": lambda: _request_case(
        512, "triton", peaked=True, search_only=True),
    "request stage B=64 verify, logit_bias fused": lambda: _request_case(512, "triton", peaked=True, bias="fused"),
    "request stage B=64 verify, logit_bias apart (search only)": lambda: _request_case(
        512, "triton", peaked=True, bias="apart", search_only=True),
    "candidate top ids B=64, logit_bias fused": lambda: _top_ids_case(64, "triton"),
    "candidate top ids B=64, logit_bias apart (torch.topk)": lambda: _top_ids_case(64, "reference"),
    "draft q store B=64 in place": lambda: _draft_store_case(64, True),
    "draft q store B=64 (copy)": lambda: _draft_store_case(64, False),
}
# one gated DeltaNet layer's verify window (Qwen3.5-9B): a state per position, or checkpoint + replay;
# one launch each, without host synchronisation: also timed as CUDA graph replays
DELTA_CASES = {
    "gated_delta_scan B=1 W=8 per-position": lambda: _per_position_case(1),
    "gated_delta_scan B=64 W=8 per-position": lambda: _per_position_case(64),
    "gated_delta_replay_scan B=1 W=8 replay=4": lambda: _replay_case(1, 4),
    "gated_delta_replay_scan B=64 W=8 replay=4": lambda: _replay_case(64, 4),
    "gated_delta_replay_scan B=64 W=8 replay=8": lambda: _replay_case(64, 8),
}
CASES.update(DELTA_CASES)


def kernel_times(fn, repeats: int = REPEATS) -> dict[str, float]:
    """Mean device µs per call of ``fn`` for each kernel it launches (``torch.profiler``)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.time_range.elapsed_us() / repeats
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def sweep_draws() -> None:
    """Graph-replayed µs of the draw-based operations for each ``DRAW_LAUNCH`` candidate."""
    from dspark.kernels.triton import draw as tdraw

    cases = {"accept B=1": _accept_case(1), "accept B=64": _accept_case(64),
             "draw B=1": _draw_case(1), "draw B=64": _draw_case(64)}
    default = dict(tdraw.DRAW_LAUNCH)
    print("chunk mass_warps walk_warps  " + "  ".join(f"{name:>12}" for name in cases), flush=True)
    for chunk in (2048, 4096, 8192):
        for mass_warps in (4, 8):
            for walk_warps in (4, 8, 16):
                tdraw.DRAW_LAUNCH.update(chunk=chunk, mass_warps=mass_warps, walk_warps=walk_warps,
                                             accept_walk_warps=walk_warps)
                times = [graph_us(fn) for fn in cases.values()]
                print(f"{chunk:5d} {mass_warps:10d} {walk_warps:10d}  " + "  ".join(f"{t:12.2f}" for t in times),
                      flush=True)
    tdraw.DRAW_LAUNCH.update(default)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dspark.bench.breakdown", description=__doc__)
    parser.add_argument("--case", action="append", choices=sorted(CASES), help="only these cases")
    parser.add_argument("--sweep-draws", action="store_true", help="time the draw kernels' launch parameters instead")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    with K.use_backend("triton"):
        if args.sweep_draws:
            sweep_draws()
            return 0
        for name in args.case or CASES:
            fn = CASES[name]()
            times = kernel_times(fn)
            replayed = f", median {graph_us(fn):.1f} us per graph replay (cold L2)" if name in DELTA_CASES else ""
            print(f"{name}: {sum(times.values()):.1f} us of kernels per call{replayed}", flush=True)
            for kernel, us in times.items():
                print(f"  {us:8.1f} us  {kernel[:90]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
