"""The schedulers' signals on recorded rounds: the confidence head against the online acceptance
estimator (``engine.acceptance.OnlineAcceptance``), without a GPU.

``python -m dspark.bench.signals --cost-table FILE`` replays the demo pair's recorded rounds
(``bench.replay``'s traces: per round the drafts the target accepted with every draft verified, and
the drafter's STS-calibrated confidences) through the scheduler's decision, for each signal:

* **calibration**: every round verifying every draft (so each position up to the first rejection is
  observed), the predicted conditional acceptance of each observed position against its outcome:
  mean predicted vs realised, ECE, Brier score, AUC -- the online estimator predicting each round
  before it observes it;
* **gain**: ``C`` rows at a time for ``steps`` steps, each row a stream of requests (the traces in an
  order of its own, cycling; a request that ends its trace is followed by the next in its row, whose
  estimate starts from the pooled rate), each
  step's verify lengths from the ``cost`` scheduler (the engine's ``batch_schedule`` on the table) or
  the per-row ``threshold`` rule, a round accepting ``min(recorded, verified)`` drafts; its time is
  the table's verify time plus its draft pass. Goodput (tokens per modelled ms) of each signal, of
  fixed blocks (every draft) and of an oracle that verifies exactly what is accepted.

The modelled times are the table's (a GPU's, measured elsewhere); what this measures is how well each
signal picks the drafts to verify. A round after a shortened one is taken as the next recorded one
(as ``bench.replay`` does), and the cost scheduler's plain-round fallback is left out (both signals
alike).
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch

from .. import kernels as K
from ..engine.acceptance import OnlineAcceptance, round_outcomes
from ..engine.schedulers import SPSCostTable, batch_schedule
from ..training.calibration import expected_calibration_error, roc_auc
from .replay import TRACES, load_traces

__all__ = ["calibration", "goodput", "main"]

SIGNALS = ("confidence", "online")


def _rounds(traces: list) -> tuple[np.ndarray, np.ndarray]:
    """Every trace's rounds: accepted drafts int ``[n]`` and confidences float64 ``[n, P]``."""
    rows = np.array([r for trace in traces for r in trace], dtype=np.float64)
    return rows[:, 0].astype(np.int64), rows[:, 1:]


def calibration(traces: list) -> dict:
    """Per signal: the predicted conditional acceptance of every position a full round observed
    against its outcome (module docstring): per-position means, ECE, Brier, AUC."""
    p = len(traces[0][0]) - 1
    predicted = {name: [] for name in SIGNALS}
    tried_all, hit_all = [], []
    estimator = OnlineAcceptance(1, p)
    for trace in traces:
        estimator.reset(0)
        accepted, confidence = _rounds([trace])
        for a, c in zip(accepted, confidence):
            predicted["online"].append(estimator.estimate([0])[0])
            predicted["confidence"].append(c)
            estimator.observe([0], [p], [a])
        tried, hit = round_outcomes(p, np.full(len(accepted), p), accepted)
        tried_all.append(tried)
        hit_all.append(hit)
    tried, hit = np.concatenate(tried_all).astype(bool), np.concatenate(hit_all)
    report = {"observations": int(tried.sum()),
              "realised_per_position": (hit.sum(0) / tried.sum(0)).round(4).tolist()}
    for name, rows in predicted.items():
        pred = np.stack(rows)
        x, y = torch.from_numpy(pred[tried]), torch.from_numpy(hit[tried])
        report[name] = {"predicted_per_position": ((pred * tried).sum(0) / tried.sum(0)).round(4).tolist(),
                        "ece": round(expected_calibration_error(x, y), 4),
                        "brier": round(float(((x - y) ** 2).mean()), 4),
                        "auc": round(roc_auc(x, y), 4)}
    return report


def _lengths(signal: np.ndarray, scheduler: str, table: SPSCostTable, threshold: float, gain: float) -> np.ndarray:
    """Drafts each row verifies from its signal ``[R, P]`` (at least one, as the engine)."""
    if scheduler == "cost":
        return np.asarray(batch_schedule(signal, table, gain))
    lengths = K.threshold_proposal_lengths(torch.from_numpy(signal).float(), threshold)
    return np.maximum(lengths.numpy(), 1)


def _stream(traces: list, row: int, steps: int) -> tuple[np.ndarray, np.ndarray, set[int]]:
    """Row ``row``'s ``steps`` rounds: the traces in a seeded order of the row's own, cycling
    (accepted int ``[steps]``, confidences ``[steps, P]``) and the steps after which a request ends."""
    order, picked, total = np.random.default_rng(row).permutation(len(traces)), [], 0
    while total < steps:
        picked.extend(traces[t] for t in order)
        total = sum(map(len, picked))
    accepted, confidence = _rounds(picked)
    return accepted[:steps], confidence[:steps], set(np.cumsum([len(t) for t in picked]).tolist())


def goodput(traces: list, concurrency: int, table: SPSCostTable, scheduler: str = "cost", threshold: float = 0.3,
            gain: float = 0.04, steps: int = 1024) -> dict:
    """Per policy (fixed, each signal, oracle): tokens per round, drafts verified per round and
    modelled goodput (tokens / ms) of ``concurrency`` rows for ``steps`` steps (module docstring)."""
    p = len(traces[0][0]) - 1
    streams = [_stream(traces, row, steps) for row in range(concurrency)]
    rounds = [(a, c) for a, c, _ in streams]
    ends = [e for _, _, e in streams]
    out = {}
    for policy in ("fixed", *SIGNALS, "oracle"):
        estimator = OnlineAcceptance(concurrency, p)
        slots = np.arange(concurrency)
        tokens = verified = ms = 0.0
        for step in range(steps):
            accepted = np.array([a[step] for a, _ in rounds])
            if policy == "fixed":
                lengths = np.full(concurrency, p)
            elif policy == "oracle":
                lengths = np.clip(accepted + 1, 1, p)
            else:
                signal = np.stack([c[step] for _, c in rounds]) if policy == "confidence" else estimator.estimate(slots)
                lengths = _lengths(signal, scheduler, table, threshold, gain)
            kept = np.minimum(accepted, lengths)
            estimator.observe(slots, lengths, kept)
            for row, end in enumerate(ends):
                if step + 1 in end:  # the row's request ended: a new one takes it
                    estimator.reset(row)
            tokens += float(kept.sum() + concurrency)
            verified += float(lengths.sum())
            ms += table.forward_time(int(lengths.sum()) + concurrency, concurrency) + table.draft_time(concurrency)
        out[policy] = {"tau": round(tokens / (steps * concurrency), 4),
                       "verified_per_round": round(verified / (steps * concurrency), 3),
                       "tokens_per_ms": round(tokens / ms, 4)}
    plain_ms = table.forward_time(concurrency, concurrency)
    out["plain"] = {"tau": 1.0, "verified_per_round": 0.0, "tokens_per_ms": round(concurrency / plain_ms, 4)}
    for policy in (*SIGNALS, "oracle"):
        out[policy]["gain_vs_fixed"] = round(out[policy]["tokens_per_ms"] / out["fixed"]["tokens_per_ms"], 4)
    out["steps"] = steps
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dspark.bench.signals", description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", default=str(TRACES), help="recorded rounds (python -m dspark.bench.replay)")
    parser.add_argument("--cost-table", required=True, help="the verify / draft-pass times (dspark profile's JSON)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--steps", type=int, default=1024, help="steps per concurrency")
    parser.add_argument("--scheduler", choices=("cost", "threshold"), default="cost")
    parser.add_argument("--threshold", type=float, default=0.3, help="threshold scheduler: the survival floor")
    parser.add_argument("--min-predicted-gain", type=float, default=0.04)
    parser.add_argument("--json", default=None, help="also write the report here")
    args = parser.parse_args(argv)
    if min(args.concurrency) < 1 or args.steps < 1:
        parser.error(f"--concurrency and --steps must be >= 1, got {args.concurrency} and {args.steps}")
    try:
        traces = load_traces(args.traces)["traces"]
        table = SPSCostTable.from_json(args.cost_table)
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    report = {"traces": args.traces, "cost_table": args.cost_table, "scheduler": args.scheduler,
              "calibration": calibration(traces),
              "goodput": {c: goodput(traces, c, table, args.scheduler, args.threshold, args.min_predicted_gain,
                                     args.steps) for c in args.concurrency}}
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
