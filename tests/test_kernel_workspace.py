"""``dspark.kernels.Workspace``: caller-owned scratch of the Triton ops, reused across calls, sized once
by ``reserve``, never grown (or freed) under CUDA-graph capture. The capture check is monkeypatched
on the CPU (the interpreter runs the Triton ops there)."""

import pytest
import torch
from conftest import DEVICE, INTERPRETER_WARNINGS, gpu, requires_triton

import dspark.kernels as K
import sampling_cases as cases
from dspark.kernels import workspace as workspace_module

pytestmark = [requires_triton, INTERPRETER_WARNINGS]

VOCAB, BATCH, WIDTH, RANK = 300, 3, 2, 16


def storage(ws: K.Workspace) -> dict:
    """Each buffer's data pointer and size: a call that reuses the workspace changes neither."""
    return {key: (buf.data_ptr(), buf.numel()) for key, buf in ws._buffers.items()}


def sampled_round(ws, batch=BATCH, top_k=50, top_p=0.9):
    case = cases.markov_sample_inputs(batch, WIDTH, VOCAB, RANK, seed=batch, device=DEVICE)
    with K.use_backend("triton"):
        return K.vanilla_markov_sample(**case, temperature=0.8, top_k=top_k, top_p=top_p, workspace=ws)


def accept(ws, batch=BATCH):
    case = cases.accept_inputs(batch, WIDTH, WIDTH, VOCAB, seed=batch, device=DEVICE)
    with K.use_backend("triton"):
        return K.probabilistic_accept(**case, workspace=ws)


def test_a_workspace_is_reused_across_calls_and_matches_the_default():
    ws = K.Workspace()
    first = sampled_round(ws)
    held = storage(ws)
    assert held and ws.nbytes > 0
    again = sampled_round(ws)
    assert storage(ws) == held  # same buffers, nothing allocated
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert all(torch.equal(a, b) for a, b in zip(first, sampled_round(None)))  # the private default


def test_reserve_covers_every_op_at_the_largest_shapes():
    ws = K.Workspace()
    ws.reserve(DEVICE, batch=BATCH, proposal_len=WIDTH, vocab=VOCAB, rank=RANK)
    held = storage(ws)
    for batch, filters in ((1, [(0, 0.9)]), (BATCH, [(0, 1.0), (5, 1.0), (0, 0.9)])):
        for top_k, top_p in filters:
            sampled_round(ws, batch, top_k, top_p)
        accept(ws, batch)
        with K.use_backend("triton"):
            rows = batch * (WIDTH + 1)
            logits = cases.random_logits(rows, VOCAB, seed=rows, device=DEVICE)
            K.logits_to_probabilities(logits, 0.8, 0, 0.5, workspace=ws)
            settings = (torch.full((rows,), 0.8, device=DEVICE), torch.full((rows,), 5, dtype=torch.int32,
                                                                             device=DEVICE),
                        torch.full((rows,), 0.9, device=DEVICE), torch.full((rows,), 0.05, device=DEVICE))
            K.request_probabilities(logits, *settings, workspace=ws)
            K.greedy_accept(logits, torch.zeros(batch, WIDTH, dtype=torch.int32, device=DEVICE),
                            torch.full((batch,), WIDTH, dtype=torch.int32, device=DEVICE), WIDTH, workspace=ws)
            K.sample_probability_rows(torch.softmax(logits[:batch], -1), torch.rand(batch, 1, device=DEVICE),
                                      torch.zeros(batch, 1, dtype=torch.int32, device=DEVICE), 0, workspace=ws)
    assert storage(ws) == held


def test_growing_during_graph_capture_raises(monkeypatch):
    ws = K.Workspace()
    sampled_round(ws, batch=1)
    monkeypatch.setattr(workspace_module, "_capturing", lambda device: True)
    sampled_round(ws, batch=1)  # fits: no allocation needed, so capture is fine
    with pytest.raises(RuntimeError, match="Workspace.*needs .* elements but holds .*CUDA graph.*reserve"):
        sampled_round(ws, batch=BATCH)


def test_a_buffer_outgrown_after_a_capture_stays_alive(monkeypatch):
    ws = K.Workspace()
    accept(ws, batch=1)
    captured = {key: buf for key, buf in ws._buffers.items()}
    monkeypatch.setattr(workspace_module, "_capturing", lambda device: True)
    accept(ws, batch=1)  # serves a "capture"
    monkeypatch.setattr(workspace_module, "_capturing", lambda device: False)
    accept(ws, batch=BATCH)  # grows after the capture
    grown = [key for key in captured if ws._buffers[key].data_ptr() != captured[key].data_ptr()]
    assert grown, "the larger batch should have grown a buffer"
    retired = {buf.data_ptr() for buf in ws._retired}
    assert all(captured[key].data_ptr() in retired for key in grown)


def test_workspace_bad_input():
    logits = torch.zeros(2, 8)
    with pytest.raises(TypeError, match="logits_to_probabilities: workspace must be a dspark.kernels.Workspace"):
        K.logits_to_probabilities(logits, 1.0, workspace={})
    with pytest.raises(ValueError, match="Workspace.reserve: batch"):
        K.Workspace().reserve("cpu", batch=0, proposal_len=7, vocab=100, rank=16)
    with pytest.raises(TypeError, match="Workspace.reserve: device"):
        K.Workspace().reserve(3.5, batch=1, proposal_len=7, vocab=100, rank=16)


# ------------------------------------------------------------------------------ GPU: real capture


def real_round(batch, ws):
    """A sampled round at V = 151936 (top-k + top-p) on preallocated outputs, as an engine runs it."""
    case = cases.markov_sample_inputs(batch, 7, 151936, 256, seed=batch, device=DEVICE)
    uniforms = case.pop("proposal_uniforms")
    tokens = torch.zeros(batch, 7, dtype=torch.int32, device=DEVICE)
    probs = torch.zeros(batch, 7, 151936, device=DEVICE)

    def run():
        for step in range(7):
            K.markov_sample_step(**case, proposal_uniforms=uniforms, draft_token_ids=tokens, draft_probabilities=probs,
                                 step=step, temperature=0.8, top_k=50, top_p=0.9, workspace=ws)
    return run, tokens, probs


@gpu
def test_reserved_workspace_round_replays_as_a_cuda_graph():
    ws = K.Workspace()
    ws.reserve(DEVICE, batch=8, proposal_len=7, vocab=151936, rank=256)
    held = storage(ws)
    with K.use_backend("triton"):
        warm, _, _ = real_round(8, None)
        warm()  # compiles outside the capture (on the default workspace)
        run, tokens, probs = real_round(8, ws)
        run()
        eager = tokens.clone(), probs.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
    tokens.zero_()
    probs.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(tokens, eager[0]) and torch.equal(probs, eager[1])
    assert storage(ws) == held  # sized once by reserve: nothing grew


@gpu
def test_workspace_growth_during_cuda_capture_raises():
    small = K.Workspace()
    with K.use_backend("triton"):
        real_round(8, None)[0]()  # compiles outside the capture
        real_round(1, small)[0]()
        run = real_round(8, small)[0]
        error = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            try:
                run()
            except RuntimeError as exc:
                error = exc
    assert error is not None and "CUDA graph" in str(error) and "reserve" in str(error)
