"""Statistical checks shared by the losslessness tests (testing.md §5) of every backend.

chi-square goodness of fit (bins with expected count >= 5, the rest pooled; p > 1e-3) and total
variation distance (< 0.01), with N sized so an exact sampler's expected TV, about 0.4*sqrt(V/N),
is <= 0.005.
"""

from __future__ import annotations

import math

import torch
from scipy import stats

import dspark.kernels as K
import sampling_cases as cases


def draws_for(vocab: int) -> int:
    """Smallest power of two N with 0.4 * sqrt(vocab / N) <= 0.005."""
    return 1 << math.ceil(math.log2(vocab * (0.4 / 0.005) ** 2))


def uniforms(rows: int, cols: int, offset: int) -> torch.Tensor:
    return K.fill_uniforms(rows * cols, cases.RUNTIME_SEED, offset).reshape(rows, cols)


def fit(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """(chi-square p-value, total-variation distance) of ``counts`` [V] against ``probs`` [V]."""
    counts, probs = counts.double(), probs.double() / probs.double().sum()
    total = counts.sum()
    expected = probs * total
    big = expected >= 5
    observed_bins, expected_bins = list(counts[big]), list(expected[big])
    if float(expected[~big].sum()) >= 5:
        observed_bins.append(counts[~big].sum())
        expected_bins.append(expected[~big].sum())
    observed_bins, expected_bins = torch.stack(observed_bins), torch.stack(expected_bins)
    statistic = float(((observed_bins - expected_bins) ** 2 / expected_bins).sum())
    p_value = float(stats.chi2.sf(statistic, len(expected_bins) - 1))
    return p_value, float(0.5 * (counts / total - probs).abs().sum())


def check_distribution(tokens: torch.Tensor, probs: torch.Tensor) -> str | None:
    """None when ``tokens`` (1-D ids) fit ``probs`` [V] (expected mass per id); else what is wrong."""
    counts = torch.bincount(tokens.long(), minlength=probs.shape[0])
    outside = int(counts[probs <= 0].sum())
    if outside:
        return f"{outside} draws outside the support"
    p_value, tv = fit(counts, probs)
    if p_value <= 1e-3 or tv >= 0.01:
        return f"chi-square p = {p_value:.2e}, TV = {tv:.4f}"
    return None


def assert_distribution(tokens, probs, what: str) -> None:
    problem = check_distribution(tokens, probs)
    assert problem is None, f"{what}: {problem}"


def check_transitions(sequences: torch.Tensor, table: torch.Tensor) -> str | None:
    """None when the transitions of ``sequences`` ``[rows, L]`` follow the Markov chain ``table``
    ``[V, V]`` (row = the previous token's next-token distribution); else what is wrong. The pair
    counts against each previous token's count times its row: chi-square (bins with expected count
    >= 5; one constraint per previous token) p > 1e-3, and TV of the pair frequencies < 0.01."""
    vocab = table.shape[0]
    previous, following = sequences[:, :-1].flatten().long(), sequences[:, 1:].flatten().long()
    pairs = torch.bincount(previous * vocab + following, minlength=vocab * vocab).reshape(vocab, vocab).double()
    outside = int(pairs[table <= 0].sum())
    if outside:
        return f"{outside} transitions the target forbids"
    expected = pairs.sum(1, keepdim=True) * table.double()
    big = expected >= 5
    statistic = float(((pairs[big] - expected[big]) ** 2 / expected[big]).sum())
    p_value = float(stats.chi2.sf(statistic, int(big.sum()) - int((big.sum(1) > 0).sum())))
    tv = float(0.5 * (pairs - expected).abs().sum() / pairs.sum())
    if p_value <= 1e-3 or tv >= 0.01:
        return f"transitions: chi-square p = {p_value:.2e}, TV = {tv:.4f}"
    return None


def check_conditionals(tokens: torch.Tensor, probs: torch.Tensor, bins: torch.Tensor) -> str | None:
    """None when draws ``tokens`` [N], each from its own distribution ``probs`` [N, V] (a history's,
    say), fit them; else what is wrong. Outcomes are pooled into bins (``bins`` int [N, V]: the bin
    of each draw's each outcome): the draws per bin against the sum of their outcomes'
    probabilities, chi-square (bins with expected count >= 5, the rest pooled; p > 1e-3:
    conservative, a draw's variance p(1-p) being at most the multinomial's) and TV < 0.01. A draw
    of probability 0 is an immediate failure."""
    drawn = probs.gather(1, tokens[:, None].long())[:, 0]
    outside = int((drawn <= 0).sum())
    if outside:
        return f"{outside} draws outside their support"
    size = int(bins.max()) + 1
    observed = torch.bincount(bins.gather(1, tokens[:, None].long())[:, 0], minlength=size)
    expected = torch.zeros(size, dtype=torch.float64).index_add_(0, bins.flatten(), probs.flatten().double())
    p_value, tv = fit(observed, expected)
    if p_value <= 1e-3 or tv >= 0.01:
        return f"chi-square p = {p_value:.2e}, TV = {tv:.4f}"
    return None


def assert_rate(hits: torch.Tensor, rate: float, what: str) -> None:
    """Binomial frequency within 4.5 standard errors of ``rate``."""
    observed = float(hits.double().mean())
    bound = 4.5 * math.sqrt(max(rate * (1 - rate), 1e-12) / hits.numel())
    assert abs(observed - rate) <= bound, f"{what}: rate {observed:.5f}, closed form {rate:.5f}"


def forced_prefix_case(width: int, position: int, vocab: int, seed: int):
    """One round's distributions in which drafts before ``position`` are always accepted
    (``q_s = p_s`` and tokens are drawn from q), so every row emits a token at ``position``; the other
    positions pair random target and draft distributions with zeros in both supports.
    Returns (target [P+1, V], draft [P, V])."""
    target = cases.random_distributions((width + 1,), vocab, zero_fraction=0.35, seed=seed)
    draft = cases.random_distributions((width,), vocab, zero_fraction=0.35, seed=seed + 1)
    draft[:position] = target[:position]
    return target, draft
