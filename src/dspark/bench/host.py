"""The engine's own host time per step, without a device: ``python -m dspark.bench.host``.

What a GPU step waits for besides the device -- admission, the scheduler, the commit of each row's
tokens, the outputs (``dspark:engine_host_seconds_total``) -- timed alone: the runner's launches do
nothing and its readout is drawn at random (accepted tokens, accept lengths, the next proposals'
confidences), so each ``LLMEngine.step`` runs only the engine's Python. Per number of running rows R
it prints microseconds per step for plain decoding, DSpark with ``--scheduler off`` and with
``--scheduler cost`` (Algorithm 1 on ``--cost-table``) on the confidence signal and on the online one
(``cost-online``: the estimator's update and estimates instead of reading the proposals), and cost
minus off: the scheduler's own price per step; ``--plan``: the cost scheduler's planning of a round
and its signal's host work (reading the proposals back, or the estimator's update) timed alone. The demo pair's checkpoints set the shapes (block 7); the figures are the host's,
so any CPU measures them (best of ``--repeats`` runs of ``--steps`` steps).
"""

from __future__ import annotations

import argparse
import itertools
import time

import numpy as np
import torch

from ..engine import EngineConfig, LLMEngine
from ..engine.request import Request
from ..engine.step import Proposals, StepResult
from ..training.data import demo_pair

CONFIGS = ("plain", "off", "cost", "cost-online")


def fake_device(engine: LLMEngine, seed: int = 0, variants: int = 64) -> None:
    """Make ``engine``'s runner launch nothing and read back random readouts (drawn up front, so that
    drawing them is not timed): per row its accepted tokens, accept length (1 .. verify length;
    1 in a plain round), verified drafts, next proposal length and confidences, in the runner's
    readout layout. The step's drafting choice is made as the runner makes it."""
    runner, rng = engine.runner, np.random.default_rng(seed)
    t, p, vocab, b = runner.verify_len, runner.num_drafts, engine.target.vocab_size, runner.max_batch
    pool = torch.zeros(variants, b, t + 3 + p, dtype=torch.int32)
    pool[..., :t] = torch.from_numpy(rng.integers(0, vocab, (variants, b, t), dtype=np.int32))
    pool[..., t] = torch.from_numpy(rng.integers(1, t + 1, (variants, b), dtype=np.int32))
    pool[..., t + 1], pool[..., t + 2] = t - 1, p
    pool[..., t + 3:] = torch.from_numpy(rng.uniform(0.5, 0.99, (variants, b, p)).astype(np.float32)).view(torch.int32)
    plain = pool.clone()  # a plain round's readout: the target's one token a row, no draft verified
    plain[..., t], plain[..., t + 1] = 1, 0
    reads = itertools.count()
    last, plain_round = [0], [False]

    def read(rows: int) -> StepResult:
        last[0] = next(reads) % variants
        return StepResult.from_readout((plain if plain_round[0] else pool)[last[0], :rows], runner.readout_columns)

    def read_proposals(rows: int) -> Proposals:
        return Proposals.from_readout(pool[last[0], :rows], runner.readout_columns)

    def launch(plan) -> None:  # the drafting choice is made as on a device (the cost scheduler's plain rounds)
        plain_round[0] = plan.verify_lens is None
        runner.drafted = plan.draft if isinstance(plan.draft, bool) else bool(plan.draft())

    runner.read, runner.read_proposals, runner.launch = read, read_proposals, launch


def _running_engine(config: str, rows: int, cost_table) -> LLMEngine:
    """An engine of ``config`` (``CONFIGS``) on a fake device with ``rows`` running requests."""
    fields = dict(max_batch=rows, cuda_graphs=False, device="cpu", dtype=torch.float32)
    if config.startswith("cost"):
        fields.update(scheduler="cost", cost_table=cost_table,
                      schedule_signal="online" if config == "cost-online" else "confidence")
    pair = demo_pair()
    engine = LLMEngine(pair.target, None if config == "plain" else pair.draft, EngineConfig(**fields))
    fake_device(engine)
    prompt, budget = [1] * 16, engine.max_model_len - 16
    for _ in range(rows):
        engine.add_request(Request(prompt, max_new_tokens=budget, ignore_eos=True))
    while len(engine.scheduler.running) < rows:
        engine.step()
    return engine


def _best(fn, calls: int, repeats: int) -> float:
    """Microseconds per call of ``fn``: the best of ``repeats`` runs of ``calls`` calls."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return 1e6 * best


def plan_time(config: str, rows: int, *, cost_table, calls: int = 200, repeats: int = 9) -> dict[str, float]:
    """The cost scheduler's own host work per step at ``rows`` running rows, in microseconds:
    ``plan`` (the round's verify lengths and whether it drafts: ``LLMEngine._plan_round``) and
    ``signal`` (reading the proposals back, or the online estimator's update) of ``config``
    ``"cost"`` or ``"cost-online"``."""
    engine = _running_engine(config, rows, cost_table)
    running = list(engine.scheduler.running)
    if engine.acceptance is None:
        def signal() -> None:
            engine._unread = running
            engine._take_proposals()
    else:
        slots, p = np.array([seq.slot for seq in running]), engine.num_drafts
        verified, accepted = np.full(rows, p), np.arange(rows) % (p + 1)
        signal = lambda: engine.acceptance.observe(slots, verified, accepted)  # noqa: E731
    def plan() -> None:  # the verify lengths, then the drafting choice (a callable where it is made later)
        draft = engine._plan_round([])[1]
        if callable(draft):
            draft()

    return {"plan": _best(plan, calls, repeats), "signal": _best(signal, calls, repeats)}


def host_time(config: str, rows: int, *, cost_table=None, steps: int = 50, repeats: int = 4) -> float:
    """Microseconds per step of ``config`` (``CONFIGS``) at ``rows`` running rows on a fake device
    (best of ``repeats`` runs of ``steps`` steps; no request finishes meanwhile)."""
    engine = _running_engine(config, rows, cost_table)
    budget = engine.max_model_len - 16
    room = budget - max(len(seq.output_ids) for seq in engine.scheduler.running)
    if repeats * steps * engine.runner.verify_len > room:
        raise ValueError(f"{repeats} x {steps} steps may run past the context ({engine.max_model_len}); take fewer")
    best = _best(engine.step, steps, repeats)
    assert len(engine.scheduler.running) == rows and not engine.metrics.errors
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dspark.bench.host", description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,16,64", help="running rows, comma-separated")
    parser.add_argument("--cost-table", default=None, help="the cost scheduler's table (`dspark profile`); "
                                                          "without it the cost column is left out")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--plan", action="store_true",
                        help="instead: the cost scheduler's planning and signal alone (needs --cost-table)")
    args = parser.parse_args(argv)
    try:
        rows_list = [int(r) for r in args.rows.split(",")]
    except ValueError:
        rows_list = []
    if not rows_list or min(rows_list) < 1:
        parser.error(f"--rows must be positive integers separated by commas, got {args.rows!r}")
    if args.steps < 1 or args.repeats < 1:
        parser.error(f"--steps and --repeats must be at least 1, got {args.steps} and {args.repeats}")
    if args.plan:
        if not args.cost_table:
            parser.error("--plan times the cost scheduler: give --cost-table")
        print("rows  cost plan  proposals read  cost-online plan  estimator update  (us per step)")
        for rows in rows_list:
            us = [plan_time(c, rows, cost_table=args.cost_table, repeats=args.repeats) for c in CONFIGS[2:]]
            print(f"{rows:4d}  {us[0]['plan']:9.1f}  {us[0]['signal']:14.1f}  {us[1]['plan']:16.1f}  "
                  f"{us[1]['signal']:16.1f}", flush=True)
        return 0
    configs = CONFIGS if args.cost_table else CONFIGS[:2]
    print("rows  " + "  ".join(f"{c:>8s}" for c in configs) + ("  cost - off" if args.cost_table else "") + "  (us per step)")
    for rows in rows_list:
        us = {c: host_time(c, rows, cost_table=args.cost_table, steps=args.steps, repeats=args.repeats) for c in configs}
        extra = f"  {us['cost'] - us['off']:10.1f}" if args.cost_table else ""
        print(f"{rows:4d}  " + "  ".join(f"{us[c]:8.1f}" for c in configs) + extra, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
