"""Per-row sampling settings (``temperature`` / ``top_k`` / ``top_p`` as tensors): each row's result
is the one its own scalar settings give, on both backends, so one launch -- and one CUDA graph --
serves a batch of any mix of settings (the engine's sampled rows)."""

from __future__ import annotations

import pytest
import torch
from conftest import BACKEND_PARAMS, DEVICE, INTERPRETER_WARNINGS
from kernel_cases import markov_case

import dspark.kernels as K

pytestmark = INTERPRETER_WARNINGS

# (temperature, top_k, top_p): greedy, unfiltered, top-k, top-p alone (candidates and search), both,
# top-k past the candidates (the search by count), a greedy top-k 1
SETTINGS = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.9), (0.8, 40, 0.8), (1.0, 200, 1.0),
            (1.1, 1, 1.0), (2.0, 0, 0.999)]


def _columns(settings, device=DEVICE):
    t, k, p = zip(*settings)
    return (torch.tensor(t, dtype=torch.float32, device=device), torch.tensor(k, dtype=torch.int32, device=device),
            torch.tensor(p, dtype=torch.float32, device=device))


def _assert_rows_match(per_row, alone):
    assert torch.equal(per_row > 0, alone > 0)  # the same kept set, exactly
    torch.testing.assert_close(per_row, alone, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("flat", [False, True])
def test_per_row_probabilities_equal_each_rows_own_settings(backend, flat):
    vocab = 300
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(len(SETTINGS), vocab, generator=gen) * 3
    if flat:  # a flat row: top-p alone does not fit the candidates (the value-space search)
        logits[3] = torch.randn(vocab, generator=gen) * 0.01
    logits = logits.to(DEVICE)
    with K.use_backend(backend):
        per_row = K.logits_to_probabilities(logits, *_columns(SETTINGS))
        for i, (t, k, p) in enumerate(SETTINGS):
            _assert_rows_match(per_row[i], K.logits_to_probabilities(logits[i:i + 1], t, k, p)[0])


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_per_row_settings_of_a_batch_apply_to_each_of_its_rows(backend):
    logits = torch.randn(3, 4, 64, device=DEVICE)
    settings = SETTINGS[1:4]
    with K.use_backend(backend):
        per_row = K.logits_to_probabilities(logits, *_columns(settings))
        for b, (t, k, p) in enumerate(settings):
            _assert_rows_match(per_row[b], K.logits_to_probabilities(logits[b], t, k, p))


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_per_row_sampled_markov_round_equals_each_row_alone(backend):
    batch, width, vocab, rank = len(SETTINGS), 3, 300, 16
    case = markov_case(batch, width, vocab, rank, device=DEVICE)
    uniforms = torch.rand(batch, width, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    with K.use_backend(backend):
        tokens, probs = K.vanilla_markov_sample(case.backbone_logits, case.markov_w1, case.markov_w2,
                                                case.first_prev_tokens, uniforms, *_columns(SETTINGS))
        for i, (t, k, p) in enumerate(SETTINGS):
            alone_tokens, alone_probs = K.vanilla_markov_sample(
                case.backbone_logits[i:i + 1], case.markov_w1, case.markov_w2, case.first_prev_tokens[i:i + 1],
                uniforms[i:i + 1], t, k, p)
            assert torch.equal(tokens[i], alone_tokens[0]), SETTINGS[i]
            _assert_rows_match(probs[i], alone_probs[0])


def test_row_filter_settings_are_filter_settings():
    from dspark.kernels._shared import filter_settings, row_filter_settings

    settings = SETTINGS + [(1e-4, 7, 0.5), (0.5, 300, 1.0), (0.5, -1, 1.0)]
    rows = row_filter_settings(*_columns(settings, "cpu"), 300).tolist()
    for (t, k, p), row in zip(settings, rows):
        inv_temp, k_, p_ = filter_settings(t, max(k, 0), torch.tensor(p).item(), 300)
        assert row == [inv_temp, k_, p_], (t, k, p)


def test_per_row_settings_bad_input_names_the_argument():
    logits = torch.randn(2, 16)
    t, k, p = _columns(SETTINGS[:2], "cpu")
    with pytest.raises(TypeError, match="all numbers or all tensors"):
        K.logits_to_probabilities(logits, t, 0, 1.0)
    with pytest.raises(ValueError, match=r"top_p must have shape \[2\]"):
        K.logits_to_probabilities(logits, t, k, p[:1])
    with pytest.raises(TypeError, match="top_k must have dtype"):
        K.logits_to_probabilities(logits, t, k.float(), p)
