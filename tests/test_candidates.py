"""Sampled Markov drafting over candidate sets (``dspark.kernels.candidates``): the filters are the
engine's request stage over the candidates, every C = V is the full-vocabulary path, the successor
table is the bigram's top-M and joins the candidates without duplicates, draws follow the stored q,
each row is request-stable, both backends agree (Triton under ``TRITON_INTERPRET=1`` on the CPU:
tiny shapes), and bad inputs are refused by name.
"""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, INTERPRETER_WARNINGS, gpu, requires_triton
from statistics_cases import assert_distribution, draws_for, uniforms

import dspark.kernels as K
import sampling_cases as cases
from dspark.kernels import candidates as candidates_module
from dspark.kernels.reference.candidates import candidate_probabilities

pytestmark = [INTERPRETER_WARNINGS]
I32 = torch.int32

# (temperature, top_k, top_p, min_p) per row: greedy by temperature and by top_k 1, and each filter
SETTINGS = [(0.0, 0, 1.0, 0.0), (0.7, 0, 0.9, 0.0), (1.0, 3, 1.0, 0.0), (1.3, 0, 1.0, 0.1), (1.0, 5, 0.8, 0.05),
            (0.9, 1, 1.0, 0.0)]


def row_settings(batch: int) -> dict:
    """``SETTINGS`` cycled over ``batch`` rows, as the op's per-row tensors."""
    rows = [SETTINGS[b % len(SETTINGS)] for b in range(batch)]
    t, k, p, m = zip(*rows)
    return dict(temperature=torch.tensor(t), top_k=torch.tensor(k, dtype=I32), top_p=torch.tensor(p),
                min_p=torch.tensor(m))


def round_inputs(batch, width, vocab, rank, *, logits_stride=0, logits_offset=0, seed=0, dtype=torch.bfloat16):
    case = cases.markov_sample_inputs(batch, width, vocab, rank, dtype=dtype, logits_stride=logits_stride,
                                      logits_offset=logits_offset, seed=seed)
    return {**case, **row_settings(batch)}


def dense(ids: torch.Tensor, q: torch.Tensor, vocab: int) -> torch.Tensor:
    """Candidate probabilities ``[..., C]`` added into ``[..., V]`` rows of zeros."""
    return torch.zeros(*q.shape[:-1], vocab).scatter_add_(-1, ids.long(), q)


def test_the_filters_are_the_request_stage_over_the_candidates():
    """Over C candidates the probabilities are the engine's request stage (vLLM's sampler order)
    applied to the candidates' logits as if they were the vocabulary."""
    z = torch.randn(len(SETTINGS) * 4, 9, generator=cases.generator(1)) * 2
    s = row_settings(z.shape[0])
    expected = K.request_probabilities(z.clone(), s["temperature"], s["top_k"], s["top_p"], s["min_p"])
    torch.testing.assert_close(candidate_probabilities(z, **s), expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("logits_stride, logits_offset", [(0, 0), (5, 1)])
def test_every_candidate_is_the_full_vocabulary_path(logits_stride, logits_offset):
    """With C = V the distributions are those of the full-vocabulary sampled step: the Markov-corrected
    logits (``build_markov_logits``) through the request stage, along the drafted chain."""
    vocab, width = 40, 4
    case = round_inputs(6, width, vocab, 8, logits_stride=logits_stride, logits_offset=logits_offset)
    tokens, ids, q = K.markov_candidate_sample(**case, candidates=vocab)
    s = row_settings(6)
    for step in range(width):
        corrected = K.build_markov_logits(case["backbone_logits"], case["markov_w1"], case["markov_w2"],
                                          case["first_prev_tokens"], tokens, step, logits_stride=logits_stride,
                                          logits_offset=logits_offset)
        expected = K.request_probabilities(corrected, s["temperature"], s["top_k"], s["top_p"], s["min_p"])
        torch.testing.assert_close(dense(ids[:, step], q[:, step], vocab), expected, atol=1e-5, rtol=0)


def test_candidates_are_the_top_backbone_logits_and_q_lives_on_them():
    vocab, width, count = 50, 3, 6
    case = round_inputs(4, width, vocab, 8)
    tokens, ids, q = K.markov_candidate_sample(**case, candidates=count)
    top = case["backbone_logits"].topk(count, dim=-1).indices
    assert torch.equal(ids.long().sort(-1).values, top.sort(-1).values)
    torch.testing.assert_close(q.sum(-1), torch.ones(4, width))
    drafted = (ids == tokens[..., None]).float()
    assert bool((drafted.sum(-1) == 1).all()), "every draft is one of its step's candidates"
    assert bool(((q * drafted).sum(-1) > 0).all()), "every draft has mass under its q"


def test_successor_table_is_the_bigram_top_m(monkeypatch):
    case = round_inputs(1, 1, 50, 8)
    w1, w2 = case["markov_w1"], case["markov_w2"]
    monkeypatch.setattr(candidates_module, "_TABLE_ROWS", 7)  # several chunks
    table = K.markov_successor_table(w1, w2, 5)
    bigram = w1.float() @ w2.float().t()
    assert table.dtype == I32 and table.shape == (50, 5)
    torch.testing.assert_close(bigram.gather(1, table.long()), bigram.topk(5, dim=-1).values)


def test_successors_join_the_candidates_without_duplicates():
    """Each step's last M candidates are its previous token's successors; an id already among the
    backbone candidates gets no mass, and the dense q (added, not assigned) is a distribution."""
    vocab, width, count, m = 40, 3, 6, 5
    case = round_inputs(6, width, vocab, 8, seed=3)
    table = K.markov_successor_table(case["markov_w1"], case["markov_w2"], m)
    table[:, 0] = case["backbone_logits"][0, 0].argmax()  # a duplicate of row 0's first candidate at step 0
    tokens, ids, q = K.markov_candidate_sample(**case, candidates=count, successor_ids=table)
    prev = torch.cat([case["first_prev_tokens"][:, None], tokens[:, :-1]], dim=1)
    assert torch.equal(ids[..., count:], table[prev.long()])
    assert q[0, 0, count] == 0, "a duplicate lane holds no mass"
    q_dense = torch.zeros(6, width, vocab).scatter_add_(2, ids.long(), q)
    torch.testing.assert_close(q_dense.sum(-1), torch.ones(6, width))
    assert bool((q_dense.gather(2, tokens[..., None].long()) > 0).all())


def test_draws_follow_the_stored_distribution():
    """q is exactly what each draft was drawn from: N rows sharing the backbone and the first token,
    each step's drafts fit the mean of the rows' q (chi-square and TV, testing.md §5)."""
    vocab, width, count = 16, 2, 6
    rows = draws_for(vocab)
    case = round_inputs(1, width, vocab, 8, seed=5)
    case["backbone_logits"] = case["backbone_logits"].expand(rows, -1, -1)
    case["first_prev_tokens"] = torch.full((rows,), 3, dtype=I32)
    case["proposal_uniforms"] = uniforms(rows, width, offset=11)
    case.update(temperature=torch.full((rows,), 0.9), top_k=torch.full((rows,), 5, dtype=I32),
                top_p=torch.full((rows,), 0.95), min_p=torch.full((rows,), 0.02))
    table = K.markov_successor_table(case["markov_w1"], case["markov_w2"], 3)
    tokens, ids, q = K.markov_candidate_sample(**case, candidates=count, successor_ids=table)
    for step in range(width):
        mass = dense(ids[:, step], q[:, step], vocab).double().sum(0)
        assert_distribution(tokens[:, step], mass, f"draft step {step}")


def test_a_row_drafts_the_same_alone_and_batched():
    vocab, width = 60, 3
    case = round_inputs(5, width, vocab, 16, logits_stride=4, logits_offset=1, seed=2)
    table = K.markov_successor_table(case["markov_w1"], case["markov_w2"], 4)
    batched = K.markov_candidate_sample(**case, candidates=7, successor_ids=table)
    for b in range(5):
        alone = {name: value[b:b + 1] if name not in ("markov_w1", "markov_w2") and isinstance(value, torch.Tensor)
                 else value for name, value in case.items()}
        for got, want in zip(K.markov_candidate_sample(**alone, candidates=7, successor_ids=table), batched):
            assert torch.equal(got, want[b:b + 1])


@requires_triton
@pytest.mark.parametrize("batch, width, vocab, rank, count, successors, stride, offset", [
    (1, 1, 37, 8, 1, 0, 0, 0), (3, 3, 130, 24, 16, 0, 5, 1), (6, 4, 64, 64, 33, 0, 0, 0), (6, 3, 40, 16, 9, 6, 4, 1)])
def test_backends_agree(batch, width, vocab, rank, count, successors, stride, offset):
    """Same drafts (given the same uniforms), candidates and q to fp32 rounding on both backends; a
    uniform within 1e-6 of a CDF boundary could go either way, which these seeds do not meet."""
    case = round_inputs(batch, width, vocab, rank, logits_stride=stride, logits_offset=offset, seed=vocab)
    table = K.markov_successor_table(case["markov_w1"], case["markov_w2"], successors) if successors else None
    results = []
    for backend in ("reference", "triton"):
        with K.use_backend(backend):
            results.append(K.markov_candidate_sample(**case, candidates=count, successor_ids=table))
    (tokens, ids, q), (t_tokens, t_ids, t_q) = results
    assert torch.equal(ids, t_ids)
    torch.testing.assert_close(t_q, q, atol=1e-5, rtol=0)
    assert torch.equal(t_tokens, tokens)


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=requires_triton)])
def test_a_logit_bias_is_what_adding_it_beforehand_gives(backend):
    """``logit_bias`` ``[B, V]`` on every slot of row b: the same candidates, q and drafts, bit for bit,
    as the backbone logits with the bias added (the kernels add it where they read the logits)."""
    case = round_inputs(3, 3, 130, 24, logits_stride=5, logits_offset=1, seed=9)
    table = K.markov_successor_table(case["markov_w1"], case["markov_w2"], 4)
    bias = torch.randn(3, 130, generator=torch.Generator().manual_seed(10)) * 3
    bias[1, 17] = 50.0
    biased = dict(case, backbone_logits=case["backbone_logits"] + bias[:, None])
    with K.use_backend(backend):
        fused = K.markov_candidate_sample(**case, candidates=16, successor_ids=table, logit_bias=bias)
        apart = K.markov_candidate_sample(**biased, candidates=16, successor_ids=table)
    for got, want in zip(fused, apart):
        assert torch.equal(got, want)
    assert fused[1][1, :, 0].tolist() == [17, 17, 17]  # the biased token leads every slot's candidates


@requires_triton
def test_triton_candidates_are_the_largest_entries_ties_to_the_lower_index():
    """The Triton backend's candidates (group maxima, then entries; V = 4099 over several chunks) are
    each slot's ``count`` largest backbone entries in descending order, tied values by the lower index
    (bf16-rounded rows are full of ties; one holds 200 equal maxima), at a block's slots (stride,
    offset); the successor lanes are left alone."""
    from dspark.kernels.triton.candidates import candidate_top_ids

    batch, stride, offset, width, vocab, count = 2, 4, 1, 3, 4099, 64
    logits = (torch.randn(batch * stride, vocab, generator=torch.Generator().manual_seed(0)) * 2).bfloat16().float()
    logits[1, 100:300] = logits[1].max()
    ids = torch.full((batch, width, count + 2), -7, dtype=I32, device=DEVICE)
    candidate_top_ids(logits.to(DEVICE), stride, offset, ids, count, None)
    ids = ids.cpu()
    rows = logits.view(batch, stride, vocab)[:, offset:offset + width]
    expected = torch.sort(-rows, dim=-1, stable=True).indices[..., :count]  # descending, ties to the lower index
    assert torch.equal(ids[..., :count].long(), expected)
    assert ids[0, 0, :count].tolist() == list(range(100, 164))
    assert bool((ids[..., count:] == -7).all())


@requires_triton
@gpu
def test_real_size_round_matches_reference_and_replays_as_a_cuda_graph():
    """V = 151936, R = 256, C = 32 + M = 16: the Triton round equals the reference, and a CUDA graph of
    it replays the same drafts."""
    batch, width, vocab = 8, 7, 151936
    case = cases.markov_sample_inputs(batch, width, vocab, 256, dtype=torch.float16, seed=4, device=DEVICE)
    case.update({name: value.to(DEVICE) for name, value in row_settings(batch).items()})
    table = K.markov_successor_table(case["markov_w1"], case["markov_w2"], 16)
    results = []
    for backend in ("reference", "triton"):
        with K.use_backend(backend):
            results.append(K.markov_candidate_sample(**case, candidates=32, successor_ids=table))
    (tokens, ids, q), (t_tokens, t_ids, t_q) = results
    assert torch.equal(t_ids, ids) and torch.equal(t_tokens, tokens)
    torch.testing.assert_close(t_q, q, atol=1e-5, rtol=0)
    graph = torch.cuda.CUDAGraph()
    with K.use_backend("triton"):
        K.markov_candidate_sample(**case, candidates=32, successor_ids=table)  # compiled before the capture
        with torch.cuda.graph(graph):
            replayed = K.markov_candidate_sample(**case, candidates=32, successor_ids=table)
    graph.replay()
    assert torch.equal(replayed[0], tokens)


def test_bad_inputs_are_refused_by_name():
    case = round_inputs(2, 2, 30, 16)
    with pytest.raises(ValueError, match=r"markov_candidate_sample: candidates must be in \[1, 30\], got 31"):
        K.markov_candidate_sample(**case, candidates=31)
    with pytest.raises(ValueError, match=r"markov_candidate_sample: top_p must have shape \[2\], got \[3\]"):
        K.markov_candidate_sample(**{**case, "top_p": torch.ones(3)}, candidates=4)
    with pytest.raises(TypeError, match=r"temperature must have dtype torch.float32, got torch.float64"):
        K.markov_candidate_sample(**{**case, "temperature": torch.ones(2, dtype=torch.float64)}, candidates=4)
    with pytest.raises(ValueError, match=r"markov_candidate_sample: logit_bias must have shape \[2, 30\], got \[2, 29\]"):
        K.markov_candidate_sample(**case, candidates=4, logit_bias=torch.zeros(2, 29))
    codes, _ = K.quantize_markov_w2_fp8(case["markov_w2"])
    with pytest.raises(TypeError, match="markov_w2 must have dtype torch.float16 or torch.bfloat16, got torch.uint8"):
        K.markov_candidate_sample(**{**case, "markov_w2": codes}, candidates=4)

    step_args = dict(backbone_logits=case["backbone_logits"], markov_w1=case["markov_w1"],
                     markov_w2=case["markov_w2"], first_prev_tokens=case["first_prev_tokens"],
                     proposal_uniforms=case["proposal_uniforms"], draft_token_ids=torch.zeros(2, 2, dtype=I32),
                     candidate_probabilities=torch.zeros(2, 2, 4), step=0, **row_settings(2))
    ids = torch.zeros(2, 2, 4, dtype=I32)
    with pytest.raises(TypeError, match="_step: candidate_ids must have dtype torch.int32, got torch.int64"):
        K.markov_candidate_sample_step(**step_args, candidate_ids=ids.long())
    with pytest.raises(ValueError, match=r"candidate_ids\[:, 0, :C\] holds token id 30, outside \[0, 30\)"):
        K.markov_candidate_sample_step(**step_args, candidate_ids=ids + 30)
    with pytest.raises(ValueError, match=r"successor_ids must have shape \[30, \*\], got \[29, 2\]"):
        K.markov_candidate_sample_step(**step_args, candidate_ids=ids, successor_ids=torch.zeros(29, 2, dtype=I32))
    with pytest.raises(ValueError, match=r"candidate_ids must hold C >= 1 backbone candidates and the M = 4 "):
        K.markov_candidate_sample_step(**step_args, candidate_ids=ids, successor_ids=torch.zeros(30, 4, dtype=I32))
    with pytest.raises(ValueError, match=r"candidate_probabilities must have shape \[2, 2, 4\], got \[2, 2, 3\]"):
        K.markov_candidate_sample_step(**{**step_args, "candidate_probabilities": torch.zeros(2, 2, 3)},
                                       candidate_ids=ids)
