"""Random and fixed inputs for the greedy drafting, verify and confidence kernel families.

Shared by the reference tests (``test_markov.py``, ``test_verify.py``, ``test_confidence.py``) and
the backend-agreement tests of the Triton kernels. Every builder takes a ``device``; the random
ones also a ``seed``.

``exact=True`` builders draw values on a coarse dyadic grid (multiples of 1/8, 1/64) small enough
that every product and every partial sum is exactly representable in fp32: then any summation order
gives bit-identical logits, so backends must agree exactly (token ids *and* floats, ties included).
The confidence builder uses such a grid too, so only the sigmoid's ``exp`` may differ by an ulp.
For the Markov builders the exact grid also makes FP8 lossless: every ``markov_w2`` row has absmax
7/8, so its scale is 7/8 / 448 = 2^-9 and every weight k/8 maps onto an exact E4M3 code 64*k.
``exact=False`` gives Gaussian values (compare floats with a tolerance, tokens with a tie margin).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# ------------------------------------------------------------------------------ helpers


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _grid(shape, gen, *, levels: int, denominator: int) -> torch.Tensor:
    """f32 values ``k / denominator`` with integer k uniform in ``[-levels, levels]``."""
    return torch.randint(-levels, levels + 1, shape, generator=gen).float() / denominator


def _ids(shape, vocab: int, gen) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=gen, dtype=torch.int32)


# ------------------------------------------------------------------------------ Markov steps


@dataclass
class MarkovCase:
    """Inputs of ``build_markov_logits`` / the fused greedy steps / ``markov_greedy_round``.

    ``backbone_logits`` f32 ``[B, L, V]`` (or ``[B*L, V]`` when built ``flat``), ``L = logits_stride
    or P``; ``markov_w1``/``markov_w2`` ``[V, R]`` in ``dtype``; ``first_prev_tokens`` int32 ``[B]``;
    ``draft_token_ids`` int32 ``[B, P]`` of valid random ids (the chain for ``build_markov_logits``).
    """

    backbone_logits: torch.Tensor
    markov_w1: torch.Tensor
    markov_w2: torch.Tensor
    first_prev_tokens: torch.Tensor
    draft_token_ids: torch.Tensor
    logits_stride: int = 0
    logits_offset: int = 0

    @property
    def batch(self) -> int:
        return self.first_prev_tokens.shape[0]

    @property
    def proposal_len(self) -> int:
        return self.draft_token_ids.shape[1]

    @property
    def vocab(self) -> int:
        return self.markov_w2.shape[0]

    @property
    def rank(self) -> int:
        return self.markov_w2.shape[1]

    def kwargs(self) -> dict:
        """``logits_stride`` / ``logits_offset`` keyword arguments."""
        return {"logits_stride": self.logits_stride, "logits_offset": self.logits_offset}

    def base_rows(self, step: int) -> torch.Tensor:
        """f32 ``[B, V]``: the backbone row of every batch entry at ``step`` (stride/offset applied)."""
        stride = self.logits_stride or self.proposal_len
        flat = self.backbone_logits.reshape(self.batch * stride, self.vocab)
        return flat[torch.arange(self.batch, device=flat.device) * stride + step + self.logits_offset]

    def greedy_slots(self) -> torch.Tensor:
        """Zeroed int64 ``[B, P]`` greedy slots."""
        return torch.zeros(self.batch, self.proposal_len, dtype=torch.int64, device=self.first_prev_tokens.device)

    def stacked_logits(self, fill: float = 0.0) -> torch.Tensor:
        """f32 ``[B, P+1, V]`` stacked-logits buffer filled with ``fill``."""
        return torch.full((self.batch, self.proposal_len + 1, self.vocab), fill, device=self.first_prev_tokens.device)


def markov_case(batch: int, proposal_len: int, vocab: int, rank: int, dtype=torch.float16, *,
                logits_stride: int = 0, logits_offset: int = 0, flat: bool = False, exact: bool = True,
                device="cpu", seed: int = 0) -> MarkovCase:
    """Random Markov-step inputs (see the module docstring for ``exact``).

    The backbone has ``L = logits_stride or P`` rows per batch entry (rows outside
    ``[offset, offset + P)`` are never read); a whole round needs ``logits_offset + P <= L``.
    """
    gen = _generator(seed)
    stride = logits_stride or proposal_len
    if exact:
        logits = _grid((batch, stride, vocab), gen, levels=512, denominator=64)  # [-8, 8] in steps of 1/64
        w1 = _grid((vocab, rank), gen, levels=7, denominator=8)
        w2 = _grid((vocab, rank), gen, levels=7, denominator=8)
        pin = torch.randint(0, rank, (vocab,), generator=gen)
        sign = torch.randint(0, 2, (vocab,), generator=gen).float() * 2 - 1
        w2[torch.arange(vocab), pin] = sign * 7 / 8  # every row's absmax is 7/8: exact FP8
    else:
        logits = torch.randn((batch, stride, vocab), generator=gen) * 2
        w1 = torch.randn((vocab, rank), generator=gen) / rank**0.25
        w2 = torch.randn((vocab, rank), generator=gen) / rank**0.25
    logits = logits.reshape(batch * stride, vocab) if flat else logits
    return MarkovCase(
        backbone_logits=logits.to(device),
        markov_w1=w1.to(dtype).to(device),
        markov_w2=w2.to(dtype).to(device),
        first_prev_tokens=_ids((batch,), vocab, gen).to(device),
        draft_token_ids=_ids((batch, proposal_len), vocab, gen).to(device),
        logits_stride=logits_stride,
        logits_offset=logits_offset,
    )


def _wave(n: int, amplitude: float, frequency: float, fn) -> torch.Tensor:
    return amplitude * fn(frequency * torch.arange(n, dtype=torch.float64))


def nvidia_fused_step_case(device="cpu") -> MarkovCase:
    """NVIDIA vector 14 (FusedGreedyStepMatchesCpuReference): B=2, P=3, V=131, R=512.

    ``backbone[i] = 5 sin(0.61 i)``, ``W1[i] = cos(0.29 i)``, ``W2[i] = 0.4 sin(0.83 i)`` over flat
    indices (weights fp16-rounded), ``first_prev_tokens = [3, 77]``. Check: stacked rows (depth
    row step+1) within 2e-3 of corrected logits computed on the CPU along the chain, and each
    winner's value within 2e-3 of that row's max.
    """
    batch, width, vocab, rank = 2, 3, 131, 512
    return MarkovCase(
        backbone_logits=_wave(batch * width * vocab, 5.0, 0.61, torch.sin).float().view(batch, width, vocab).to(device),
        markov_w1=_wave(vocab * rank, 1.0, 0.29, torch.cos).half().view(vocab, rank).to(device),
        markov_w2=_wave(vocab * rank, 0.4, 0.83, torch.sin).half().view(vocab, rank).to(device),
        first_prev_tokens=torch.tensor([3, 77], dtype=torch.int32, device=device),
        draft_token_ids=torch.zeros(batch, width, dtype=torch.int32, device=device),
    )


def nvidia_fp8_step_case(device="cpu") -> tuple[MarkovCase, torch.Tensor]:
    """NVIDIA vector 15 (FusedGreedyStepFp8MatchesFp16Closely): B=2, P=2, V=103, R=512.

    ``backbone[i] = 3 cos(0.41 i)`` plus 1000 at token ``7 + 13 b + 17 step``; ``W1[i] = sin(0.67 i)``,
    ``W2[i] = 0.4 cos(1.19 i)``; ``first_prev_tokens = [9, 55]``. Returns the case and the expected
    int32 ``[B, P]`` tokens (the spikes). Check: FP8 tokens == FP16 tokens == spikes; stacked rows
    within ``R * max|W2| * 0.125`` of the FP16 rows.
    """
    batch, width, vocab, rank = 2, 2, 103, 512
    logits = _wave(batch * width * vocab, 3.0, 0.41, torch.cos).float().view(batch, width, vocab)
    spikes = torch.tensor([[7 + 13 * b + 17 * s for s in range(width)] for b in range(batch)], dtype=torch.int32)
    for b in range(batch):
        for s in range(width):
            logits[b, s, spikes[b, s]] += 1000.0
    case = MarkovCase(
        backbone_logits=logits.to(device),
        markov_w1=_wave(vocab * rank, 1.0, 0.67, torch.sin).half().view(vocab, rank).to(device),
        markov_w2=_wave(vocab * rank, 0.4, 1.19, torch.cos).half().view(vocab, rank).to(device),
        first_prev_tokens=torch.tensor([9, 55], dtype=torch.int32, device=device),
        draft_token_ids=torch.zeros(batch, width, dtype=torch.int32, device=device),
    )
    return case, spikes.to(device)


# ------------------------------------------------------------------------------ greedy accept


@dataclass
class GreedyAcceptCase:
    """Inputs of ``greedy_accept``: ``base_logits`` f32 ``[B, P_v+1, V]`` (``[B*(P_v+1), V]`` when
    ``flat``), ``draft_token_ids`` int32 ``[B, S]``, ``proposal_lengths`` int32 ``[B]``, ``P_v``."""

    base_logits: torch.Tensor
    draft_token_ids: torch.Tensor
    proposal_lengths: torch.Tensor
    verify_proposal_len: int

    def args(self) -> tuple:
        return self.base_logits, self.draft_token_ids, self.proposal_lengths, self.verify_proposal_len


def greedy_accept_case(batch: int, draft_stride: int, verify_proposal_len: int, vocab: int, *, flat: bool = False,
                       special_rows: bool = True, device="cpu", seed: int = 0) -> GreedyAcceptCase:
    """Random greedy-accept inputs exercising every branch.

    Each base row has a planted maximum, often tied with a second index (the lower must win); each
    batch entry's drafts match the base argmax for a random prefix (0 .. S) and then differ;
    ``proposal_lengths`` range over ``[-1, S + 2]`` (0 and > P_v included). With ``special_rows``
    (needs V >= 4), the last entry's rows are all -inf and rows with NaN and -inf entries appear
    (NaN never wins). Values are multiples of 1/8, so every backend sees exact ties.
    """
    gen = _generator(seed)
    verify_len = verify_proposal_len + 1
    logits = _grid((batch, verify_len, vocab), gen, levels=64, denominator=8)
    winner = _ids((batch, verify_len), vocab, gen)
    logits.scatter_(2, winner.long()[..., None], 16.0)
    tie = _ids((batch, verify_len), vocab, gen)
    tied = torch.rand((batch, verify_len), generator=gen) < 0.3
    logits.scatter_(2, tie.long()[..., None], torch.where(tied, 16.0, -16.0)[..., None])
    if special_rows and vocab >= 4:
        nan = torch.rand((batch, verify_len), generator=gen) < 0.3
        logits[:, :, 1] = torch.where(nan, float("nan"), logits[:, :, 1])
        logits[:, :, 2] = float("-inf")
        logits[-1] = float("-inf")
    argmax = torch.where(logits.isnan(), float("-inf"), logits).argmax(-1).to(torch.int32)  # to plant matches
    prefix = torch.randint(0, draft_stride + 1, (batch,), generator=gen)
    drafts = _ids((batch, draft_stride), vocab, gen)
    for b in range(batch):
        n = int(prefix[b])
        drafts[b, : min(n, verify_proposal_len)] = argmax[b, : min(n, verify_proposal_len)]
        if n < verify_proposal_len:
            drafts[b, n] = (argmax[b, n] + 1) % vocab
    lengths = torch.randint(-1, draft_stride + 3, (batch,), generator=gen, dtype=torch.int32)
    logits = logits.reshape(batch * verify_len, vocab) if flat else logits
    return GreedyAcceptCase(logits.to(device), drafts.to(device), lengths.to(device), verify_proposal_len)


# ------------------------------------------------------------------------------ confidence


@dataclass
class ConfidenceCase:
    """Inputs of the confidence functions: ``draft_hidden_states`` ``[B, L, H]`` (``[B*L, H]`` when
    ``flat``), ``markov_w1`` ``[V, R]``, ``confidence_weight`` ``[H+R]`` (``[H]`` without Markov),
    ``confidence_bias`` ``[1]``, ``first_prev_tokens`` int32 ``[B]``, ``draft_token_ids`` int32 ``[B, P]``."""

    draft_hidden_states: torch.Tensor
    markov_w1: torch.Tensor
    confidence_weight: torch.Tensor
    confidence_bias: torch.Tensor
    first_prev_tokens: torch.Tensor
    draft_token_ids: torch.Tensor
    confidence_with_markov: bool
    hidden_stride: int = 0
    hidden_offset: int = 0

    def args(self) -> tuple:
        return (self.draft_hidden_states, self.markov_w1, self.confidence_weight, self.confidence_bias,
                self.first_prev_tokens, self.draft_token_ids)

    def kwargs(self) -> dict:
        return {"confidence_with_markov": self.confidence_with_markov, "hidden_stride": self.hidden_stride,
                "hidden_offset": self.hidden_offset}


def confidence_case(batch: int, proposal_len: int, hidden: int, rank: int, vocab: int, dtype=torch.float16, *,
                    with_markov: bool = True, hidden_stride: int = 0, hidden_offset: int = 0, flat: bool = False,
                    device="cpu", seed: int = 0) -> ConfidenceCase:
    """Random confidence-head inputs on an exact grid (the fp32 dot is order-independent).

    Hidden entries are multiples of 1/8, weights multiples of 1/16, bias 2 - so confidences spread
    over roughly (0.3, 1) and the schedulers pick a variety of lengths. ``hidden_stride`` 0 means P.
    """
    gen = _generator(seed)
    stride = hidden_stride or proposal_len
    states = _grid((batch, stride, hidden), gen, levels=8, denominator=8)
    weight = _grid((hidden + (rank if with_markov else 0),), gen, levels=8, denominator=16)
    w1 = _grid((vocab, rank), gen, levels=8, denominator=8)
    states = states.reshape(batch * stride, hidden) if flat else states
    return ConfidenceCase(
        draft_hidden_states=states.to(dtype).to(device),
        markov_w1=w1.to(dtype).to(device),
        confidence_weight=weight.to(dtype).to(device),
        confidence_bias=torch.tensor([2.0], dtype=dtype, device=device),
        first_prev_tokens=_ids((batch,), vocab, gen).to(device),
        draft_token_ids=_ids((batch, proposal_len), vocab, gen).to(device),
        confidence_with_markov=with_markov,
        hidden_stride=hidden_stride,
        hidden_offset=hidden_offset,
    )


def confidence_case_from_scores(scores, dtype=torch.float16, device="cpu") -> ConfidenceCase:
    """A head (H = 1, no Markov, weight 1, bias 0) whose confidences approximate ``scores`` [B, P].

    The hidden state is ``logit(score)`` rounded to ``dtype``; the exact confidences are what the
    reference returns (close to ``scores``; NVIDIA vectors 10/11 use such one-hot hidden states).
    """
    scores = torch.as_tensor(scores, dtype=torch.float64)
    batch, width = scores.shape
    logit = torch.log(scores) - torch.log1p(-scores)
    return ConfidenceCase(
        draft_hidden_states=logit.view(batch, width, 1).to(dtype).to(device),
        markov_w1=torch.zeros(1, 1, dtype=dtype, device=device),
        confidence_weight=torch.ones(1, dtype=dtype, device=device),
        confidence_bias=torch.zeros(1, dtype=dtype, device=device),
        first_prev_tokens=torch.zeros(batch, dtype=torch.int32, device=device),
        draft_token_ids=torch.zeros(batch, width, dtype=torch.int32, device=device),
        confidence_with_markov=False,
    )


def nvidia_confidence_threshold_case(device="cpu") -> ConfidenceCase:
    """NVIDIA vector 10: P=3, H=2, R=1, hidden [[2,0],[1,0],[-2,0]], w=[1,0], bias 0, no Markov.

    With threshold 0.5, min 1, max 3: scores [0.8807971, 0.7310586, 0.1192029], length 2.
    """
    return ConfidenceCase(
        draft_hidden_states=torch.tensor([[[2.0, 0.0], [1.0, 0.0], [-2.0, 0.0]]], dtype=torch.float16, device=device),
        markov_w1=torch.zeros(4, 1, dtype=torch.float16, device=device),
        confidence_weight=torch.tensor([1.0, 0.0], dtype=torch.float16, device=device),
        confidence_bias=torch.zeros(1, dtype=torch.float16, device=device),
        first_prev_tokens=torch.zeros(1, dtype=torch.int32, device=device),
        draft_token_ids=torch.zeros(1, 3, dtype=torch.int32, device=device),
        confidence_with_markov=False,
    )


def nvidia_confidence_sps_case(device="cpu") -> ConfidenceCase:
    """NVIDIA vector 11: P=4, H=1, hidden [3,0,0,0], w=[1], bias 0, no Markov.

    With floor 0, min 1, max 4: scores [0.9525741, 0.5, 0.5, 0.5], SPS scores 0.80685, 0.84044,
    0.79375, 0.72744, length 2.
    """
    return ConfidenceCase(
        draft_hidden_states=torch.tensor([[[3.0], [0.0], [0.0], [0.0]]], dtype=torch.float16, device=device),
        markov_w1=torch.zeros(4, 1, dtype=torch.float16, device=device),
        confidence_weight=torch.ones(1, dtype=torch.float16, device=device),
        confidence_bias=torch.zeros(1, dtype=torch.float16, device=device),
        first_prev_tokens=torch.zeros(1, dtype=torch.int32, device=device),
        draft_token_ids=torch.zeros(1, 4, dtype=torch.int32, device=device),
        confidence_with_markov=False,
    )


# Extra spec-derived SPS vectors (kernels.md section 6): (confidences, survival_floor, expected length).
SPS_VECTORS = (
    ([0.9] * 8, 0.0, 6),
    ([0.6] * 8, 0.0, 2),
    ([0.95, 0.9, 0.8, 0.5, 0.9, 0.9, 0.9, 0.9], 0.3, 3),
)
