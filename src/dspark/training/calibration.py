"""Confidence calibration: greedy drafting rounds on held-out text, ECE / AUC per position, and
Sequential Temperature Scaling (runtime.md §4 and Part III).

Rounds. The target greedily continues held-out prompts; on that continuation every position p is
an anchor the engine could meet, with exactly the context the engine would have (the target's
hidden states of the greedy sequence before p). For each anchor the draft block runs
(``trainer.block_hidden``, equal to ``forward_block``), the Markov head drafts P tokens greedily
(``backbone_logits`` + ``markov_bias``, each token feeding the next), and the confidence head scores
them (``confidence_logits`` with the drafted previous tokens). Greedy verification accepts draft j
iff drafts ``0..j-1`` were accepted and draft j is the target's argmax at ``p+j``, i.e. the greedy
sequence's next token -- so the prefix-acceptance outcome of every position is known without running
the verifier, and thousands of rounds cost a few batched forwards.

Calibration. The survival ``a_k = Π_{i<=k} σ(logit_i / T_i)`` predicts the outcome "drafts 1..k all
accepted". STS fits ``T_1, T_2, ...`` left to right, each by a grid search minimising the expected
calibration error (equal-width bins) of ``a_k`` with the earlier temperatures frozen. The fitted
temperatures go to the draft directory: ``dspark_calibration.json`` (key ``sts_temperatures``, as
TensorRT-LLM reads it, with the per-position report) and the ``sts_temperatures`` key of
``config.json``, which ``DSparkConfig`` loads and the engine applies (``sigmoid(logit_k / T_k)``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..kernels._validate import Checker
from ..model import DSparkDraftModel
from ..model.checkpoint import read_json_object
from .trainer import block_hidden, greedy_continuation, target_states

__all__ = [
    "CALIBRATION_FILE", "STS_GRID", "Rounds", "greedy_drafts", "collect_rounds",
    "expected_calibration_error", "roc_auc", "fit_sts", "calibration_report", "save_calibration",
    "load_calibration",
]

CALIBRATION_FILE = "dspark_calibration.json"
# 97 temperatures, geometric from 1/16 to 16 (1.0 is the middle point)
STS_GRID = torch.logspace(math.log10(1 / 16), math.log10(16), 97, dtype=torch.float64).float()


@dataclass
class Rounds:
    """Outcomes of n greedy drafting rounds of P drafts each (CPU tensors).

    ``confidence_logits``: fp32 ``[n, P]`` pre-sigmoid confidences (None without a confidence
    head); ``accepted``: bool ``[n, P]``, True at k when drafts ``0..k`` were all accepted.
    """

    confidence_logits: torch.Tensor | None
    accepted: torch.Tensor

    @property
    def num_drafts(self) -> int:
        return self.accepted.shape[1]

    @property
    def tau(self) -> float:
        """Mean tokens per round, bonus included: ``1 + mean accepted drafts``."""
        return 1.0 + float(self.accepted.float().sum(1).mean())

    @property
    def acceptance_per_position(self) -> list[float | None]:
        """Conditional acceptance of each position given the earlier ones were accepted."""
        reached = torch.cat([torch.ones_like(self.accepted[:, :1]), self.accepted[:, :-1]], dim=1)
        out = []
        for k in range(self.num_drafts):
            trials = int(reached[:, k].sum())
            out.append(float(self.accepted[:, k].sum()) / trials if trials else None)
        return out

    def survival(self, temperatures=None) -> torch.Tensor:
        """fp32 ``[n, P]`` predicted survival ``Π_{i<=k} σ(logit_i / T_i)`` (T = 1 when None)."""
        if self.confidence_logits is None:
            Checker("Rounds.survival").fail("these rounds have no confidences (the draft has no confidence head)")
        t = torch.ones(self.num_drafts) if temperatures is None else torch.as_tensor(temperatures, dtype=torch.float32)
        return torch.sigmoid(self.confidence_logits / t).cumprod(dim=1)

    @staticmethod
    def concat(parts: list["Rounds"]) -> "Rounds":
        logits = None if parts[0].confidence_logits is None else torch.cat([p.confidence_logits for p in parts])
        return Rounds(logits, torch.cat([p.accepted for p in parts]))


@torch.no_grad()
def greedy_drafts(model: DSparkDraftModel, hidden: torch.Tensor, anchor_tokens: torch.Tensor):
    """Greedy Markov drafting of R blocks, as the engine drafts: ``(tokens int64 [R, P],
    confidence_logits fp32 [R, P] or None)`` from block hidden states ``[R, N, H]`` and the anchors
    int64 ``[R]`` (all in the target vocabulary)."""
    cfg = model.config
    offset, p = (0 if cfg.sample_from_anchor else 1), cfg.num_draft_tokens
    rows = hidden[:, offset:offset + p]
    logits = model.backbone_logits(rows)
    prev, state, tokens = anchor_tokens, model.markov_start_state(hidden[:, 0], anchor_tokens), []
    for j in range(p):
        bias, state = model.markov_bias(rows[:, j], prev, state)
        prev = (logits[:, j] + bias).argmax(-1)
        tokens.append(prev)
    tokens = torch.stack(tokens, dim=1)
    confidence = None
    if model.confidence_head is not None:
        confidence = model.confidence_logits(rows, torch.cat([anchor_tokens[:, None], tokens[:, :-1]], dim=1))
    return tokens, confidence


@torch.no_grad()
def collect_rounds(target, model: DSparkDraftModel, prompts: torch.Tensor, new_tokens: int, *,
                   batch_size: int = 16, anchor_chunk: int = 64, progress=None) -> Rounds:
    """Greedy rounds at every anchor of the target's greedy continuation of ``prompts`` (int64
    ``[B, S0]`` on the models' device). Anchors p run over ``[S0, S0 + new_tokens - P]``, so each
    of the P drafts has its greedy outcome inside the sequence. Returns CPU ``Rounds``.
    ``progress()`` is called after each batch of ``batch_size`` prompts."""
    c = Checker("collect_rounds")
    cfg = model.config
    c.tensor("prompts", prompts, dtype=torch.int64, ndim=2)
    c.integer("new_tokens", new_tokens, low=cfg.num_draft_tokens + 1)
    parts = []
    for chunk in prompts.split(batch_size):
        sequences = greedy_continuation(target, chunk, new_tokens)
        context, final = target_states(target, sequences, cfg.capture_layer_ids)
        truth = torch.stack([target.get_output_embeddings()(f).argmax(-1) for f in final])  # greedy next token
        first, last = chunk.shape[1], sequences.shape[1] - cfg.num_draft_tokens
        for anchors in torch.arange(first, last + 1, device=prompts.device).split(anchor_chunk):
            parts.append(_rounds_at(model, sequences, context, truth, anchors.expand(chunk.shape[0], -1)))
        if progress is not None:
            progress()
    return Rounds.concat(parts)


def _rounds_at(model, sequences, context, truth, anchors) -> Rounds:
    cfg = model.config
    b, a = anchors.shape
    block_ids = torch.full((b, a, cfg.block_size), cfg.mask_token_id, dtype=torch.int64, device=anchors.device)
    block_ids[..., 0] = sequences.gather(1, anchors)
    hidden = block_hidden(model, context, block_ids, anchors)
    tokens, confidence = greedy_drafts(model, hidden.reshape(b * a, cfg.block_size, -1), block_ids[..., 0].reshape(-1))
    rows = anchors[:, :, None] + torch.arange(cfg.num_draft_tokens, device=anchors.device)
    expected = truth.gather(1, rows.reshape(b, -1)).reshape(b * a, -1)
    accepted = (tokens == expected).cumprod(dim=1).bool()
    return Rounds(None if confidence is None else confidence.float().cpu(), accepted.cpu())


# ---- calibration metrics and STS ----------------------------------------------------------------


def expected_calibration_error(predicted: torch.Tensor, outcome: torch.Tensor, bins: int = 15) -> float:
    """``Σ_b (n_b / n) |mean predicted_b - mean outcome_b|`` over ``bins`` equal-width bins of [0, 1]."""
    c = Checker("expected_calibration_error")
    c.integer("bins", bins, low=1)
    predicted = predicted.double().flatten()
    outcome = outcome.double().flatten()
    if predicted.numel() == 0 or predicted.numel() != outcome.numel():
        c.fail(f"predicted and outcome must be non-empty and of equal size, "
               f"got {predicted.numel()} and {outcome.numel()}")
    index = (predicted * bins).long().clamp(0, bins - 1)
    gap = torch.bincount(index, predicted, minlength=bins) - torch.bincount(index, outcome, minlength=bins)
    return float(gap.abs().sum() / predicted.numel())


def roc_auc(predicted: torch.Tensor, outcome: torch.Tensor) -> float | None:
    """Area under the ROC curve of ``predicted`` scores for the binary ``outcome`` (Mann-Whitney,
    ties counted half); None when one class is absent."""
    predicted, positive = predicted.double().flatten(), outcome.bool().flatten()
    n_pos = int(positive.sum())
    n_neg = positive.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        return None
    values, inverse, counts = torch.unique(predicted, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    ranks = (ends - (counts.double() - 1) / 2)[inverse]  # 1-based average rank within each tie group
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def fit_sts(rounds: Rounds, *, bins: int = 15, grid: torch.Tensor = STS_GRID) -> list[float]:
    """Sequential Temperature Scaling: ``[T_1 .. T_P]``, each the grid temperature that minimises
    the ECE of the survival ``a_k`` given the temperatures already fitted for earlier positions."""
    logits, accepted = rounds.confidence_logits, rounds.accepted
    if logits is None:
        Checker("fit_sts").fail("the rounds have no confidences: the draft has no confidence head")
    prefix = torch.ones(logits.shape[0])
    temperatures = []
    for k in range(rounds.num_drafts):
        errors = [expected_calibration_error(prefix * torch.sigmoid(logits[:, k] / t), accepted[:, k], bins)
                  for t in grid.tolist()]
        best = float(grid[min(range(len(errors)), key=errors.__getitem__)])
        temperatures.append(best)
        prefix = prefix * torch.sigmoid(logits[:, k] / best)
    return temperatures


def calibration_report(rounds: Rounds, temperatures: list[float], bins: int = 15) -> list[dict]:
    """Per position k (1-based): conditional acceptance, observed survival, T_k, and the ECE and AUC
    of the survival before (T = 1) and after STS."""
    before, after = rounds.survival(), rounds.survival(temperatures)
    acceptance = rounds.acceptance_per_position
    report = []
    for k in range(rounds.num_drafts):
        outcome = rounds.accepted[:, k]
        report.append({
            "position": k + 1,
            "acceptance": acceptance[k],
            "survival": float(outcome.float().mean()),
            "temperature": temperatures[k],
            "ece_before": expected_calibration_error(before[:, k], outcome, bins),
            "ece_after": expected_calibration_error(after[:, k], outcome, bins),
            "auc_before": roc_auc(before[:, k], outcome),
            "auc_after": roc_auc(after[:, k], outcome),
        })
    return report


def save_calibration(draft_dir, temperatures: list[float], report: list[dict] | None = None) -> Path:
    """Write ``dspark_calibration.json`` (``sts_temperatures`` + ``report``) into the draft directory
    and set ``sts_temperatures`` in its ``config.json`` (what the engine loads). Returns the file."""
    c = Checker("save_calibration")
    directory = Path(draft_dir)
    config_file = directory / "config.json"
    if not config_file.is_file():
        c.fail(f"{str(directory)!r} is not a draft checkpoint directory (no config.json)")
    values = [c.real("temperatures[]", t, low=1e-6) for t in temperatures]
    file = directory / CALIBRATION_FILE
    file.write_text(json.dumps({"sts_temperatures": values, "report": report or []}, indent=2) + "\n")
    config = read_json_object(config_file)
    config["sts_temperatures"] = values
    config_file.write_text(json.dumps(config, indent=2) + "\n")
    return file


def load_calibration(path) -> list[float]:
    """STS temperatures from a calibration JSON (or the draft directory holding
    ``dspark_calibration.json``): key ``sts_temperatures`` (TensorRT-LLM) or ``temperatures`` (SGLang)."""
    c = Checker("load_calibration")
    file = Path(path)
    if file.is_dir():
        file = file / CALIBRATION_FILE
    if not file.is_file():
        c.fail(f"no calibration file at {str(file)!r}")
    data = read_json_object(file)
    values = data.get("sts_temperatures", data.get("temperatures"))
    if not isinstance(values, list) or not values:
        c.fail(f"{file.name} has no non-empty 'sts_temperatures' (or 'temperatures') list")
    return [c.real("sts_temperatures[]", t, low=1e-6) for t in values]
