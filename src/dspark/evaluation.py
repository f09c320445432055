"""Evaluation of drafts on a prompt set: τ, per-position acceptance, speedup over plain decoding.

For every prompt, plain target decoding and speculative decoding with each draft (an ``LLMEngine``
per draft and its plain twin, ``LLMEngine.plain``) run back to back on the same target, one prompt
at a time, so all timings see the same machine state. Per draft, the prompts' ``GenerationStats`` are merged
(rounds concatenated, times summed) and the engine's own statistics give τ (mean accepted length,
bonus included) and the conditional acceptance of each draft position; the speedup is the ratio of
the rates, speculative tokens per second over plain decoding's, totalled over the prompts (a ratio
of times would be wrong when sampled outputs differ in length). Without a drafting round (one
generated token or none) τ and the speedup are undefined: None. Greedy outputs are compared with
plain decoding's token for token (they must be identical: verification is lossless).
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Callable

import torch

from .engine import GenerationStats, LLMEngine, Request, SamplingParams, engine_config
from .engine.config import DEFAULT_DRAFT_CANDIDATES, DEFAULT_DRAFT_SUCCESSORS
from .kernels._validate import Checker

__all__ = ["merge_stats", "speedup", "evaluate", "format_table", "format_per_prompt"]

_WARMUP_TOKENS = 8


def merge_stats(stats: list[GenerationStats]) -> GenerationStats:
    """One ``GenerationStats`` for several calls: per-round lists concatenated, counts and times summed."""
    c = Checker("merge_stats")
    if not stats:
        c.fail("stats must hold at least one GenerationStats")
    if len({s.num_drafts for s in stats}) != 1:
        c.fail(f"stats must share num_drafts, got {sorted({s.num_drafts for s in stats})}")
    merged = GenerationStats(num_drafts=stats[0].num_drafts)
    for f in fields(GenerationStats):
        if f.name != "num_drafts":
            setattr(merged, f.name, sum((getattr(s, f.name) for s in stats), type(getattr(merged, f.name))()))
    return merged


def speedup(stats: GenerationStats, plain: GenerationStats) -> float | None:
    """Speculative over plain tokens per second; None without a drafting round or a measured rate."""
    if stats.rounds == 0 or stats.tokens_per_second == 0 or plain.tokens_per_second == 0:
        return None
    return stats.tokens_per_second / plain.tokens_per_second


def evaluate(target, drafts: dict, prompts: list[list[int]], *, max_new_tokens: int = 128,
             sampling: SamplingParams = SamplingParams(), scheduler: str = "off", threshold: float = 0.0,
             progress: Callable[[int, int], None] | None = None, engine: str = "auto", cost_table=None,
             min_predicted_gain: float = 0.04, draft_top_k: int = 1, tree_budget: int = 0,
             draft_candidates: int = DEFAULT_DRAFT_CANDIDATES,
             draft_successors: int = DEFAULT_DRAFT_SUCCESSORS, schedule_signal: str = "confidence",
             tensor_parallel_size: int = 1, device=None, dtype=None) -> dict:
    """Evaluate ``drafts`` (name -> ``DSparkDraftModel``) for ``target`` (a Hugging Face causal LM
    on the drafts' device) on ``prompts`` (token id lists). Returns the report: ``plain`` (tokens,
    time_s, tokens_per_second) and, per draft, ``tau``, ``acceptance_per_position``, ``rounds``,
    ``tokens``, ``time_s`` (with its draft / verify split), ``tokens_per_second``, ``speedup`` and
    ``identical`` (prompts whose output equals plain decoding; None when sampling).
    ``progress(done, total)`` is called after each prompt. ``engine``: as ``engine_config`` (one
    prompt at a time either way, so that per-prompt speedups stay comparable; ``"batched"`` adds CUDA
    graphs on a GPU); ``scheduler="cost"`` with ``cost_table`` and ``min_predicted_gain``, and tree
    mode with ``draft_top_k`` > 1 and ``tree_budget``, and ``draft_candidates`` / ``draft_successors`` and
    ``schedule_signal``, as ``EngineConfig``. With ``tensor_parallel_size`` N > 1 the target is a
    checkpoint directory and the drafts directories (or builders), run on ``device`` / ``dtype``:
    each engine's N ranks load their shards, and as one tensor-parallel engine runs at a time, plain
    decoding runs every prompt, then each draft does (``progress`` counts every engine's prompts)."""
    c = Checker("evaluate")
    if not drafts:
        c.fail("drafts must name at least one draft model")
    if not prompts or not all(prompts):
        c.fail("prompts must be a non-empty list of non-empty token id lists")
    parallel = tensor_parallel_size > 1
    on_device = (device if device is not None else "cuda" if torch.cuda.is_available() else "cpu") if parallel \
        else next(target.parameters()).device
    where = dict(device=on_device, dtype=dtype, tensor_parallel_size=tensor_parallel_size) if parallel else {}
    config = engine_config(engine, on_device, name="evaluate", max_batch=1, gpu_memory_utilization=None, **where,
                           scheduler=scheduler, threshold=threshold, cost_table=cost_table,
                           min_predicted_gain=min_predicted_gain, draft_top_k=draft_top_k, tree_budget=tree_budget,
                           draft_candidates=draft_candidates, draft_successors=draft_successors,
                           schedule_signal=schedule_signal)
    if parallel:
        plain, runs = _evaluate_in_turn(target, drafts, prompts, config, sampling, max_new_tokens, progress)
    else:
        plain, runs = _evaluate_side_by_side(target, drafts, prompts, config, sampling, max_new_tokens, progress)
    plain_stats = merge_stats([r.stats for r in plain])
    report = {
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "sampling": {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
                     "seed": sampling.seed},
        "scheduler": scheduler,
        "draft_top_k": draft_top_k,
        "tree_budget": tree_budget,
        "draft_candidates": draft_candidates,
        "draft_successors": draft_successors,
        "plain": _timing(plain_stats),
        "drafts": [],
    }
    for name, results in runs.items():
        stats = merge_stats([r.stats for r in results])
        identical = None if not sampling.greedy else sum(r.token_ids == p.token_ids for r, p in zip(results, plain))
        report["drafts"].append({
            "name": name,
            "tau": stats.mean_accepted_length if stats.rounds else None,
            "acceptance_per_position": stats.acceptance_per_position,
            "rounds": stats.rounds,
            "mean_scheduled_length": sum(stats.scheduled_lengths) / stats.rounds if stats.rounds else None,
            **_timing(stats),
            "draft_time_s": stats.draft_time if stats.parts_timed else None,
            "verify_time_s": stats.verify_time if stats.parts_timed else None,
            "speedup": speedup(stats, plain_stats),
            "identical": identical,
            "per_prompt": [_prompt_row(r, p, sampling) for r, p in zip(results, plain)],
        })
    return report


def _evaluate_side_by_side(target, drafts: dict, prompts, config, sampling, max_new_tokens: int, progress):
    """(plain results, results per draft): every engine on one prompt, back to back, then the next."""
    engines = {name: LLMEngine(target, draft, config) for name, draft in drafts.items()}
    speculative = {name: _runner(e, sampling) for name, e in engines.items()}
    baseline = _runner(next(iter(engines.values())).plain(), sampling)
    for run in [*speculative.values(), baseline]:  # first calls pay one-off costs: not timed
        run(prompts[0], _WARMUP_TOKENS)
    plain, runs = [], {name: [] for name in speculative}
    for done, ids in enumerate(prompts, start=1):
        plain.append(baseline(ids, max_new_tokens))
        for name, run in speculative.items():
            runs[name].append(run(ids, max_new_tokens))
        if progress is not None:
            progress(done, len(prompts))
    return plain, runs


def _evaluate_in_turn(target, drafts: dict, prompts, config, sampling, max_new_tokens: int, progress):
    """(plain results, results per draft) under tensor parallelism: one engine (of N ranks) at a
    time runs every prompt -- plain decoding (no draft, ``LLMEngine.plain``'s settings), then each draft."""
    plain_config = replace(config, scheduler="off", schedule_signal="confidence", draft_top_k=1, tree_budget=0)
    turns = [(None, None, plain_config)] + [(name, draft, config) for name, draft in drafts.items()]
    results, done = {}, 0
    for name, draft, settings in turns:
        engine = LLMEngine(target, draft, settings)
        try:
            run = _runner(engine, sampling)
            run(prompts[0], _WARMUP_TOKENS)  # the first call pays one-off costs: not timed
            results[name] = []
            for ids in prompts:
                results[name].append(run(ids, max_new_tokens))
                done += 1
                if progress is not None:
                    progress(done, len(prompts) * len(turns))
        finally:
            engine.close()
    return results.pop(None), results


def _runner(engine: LLMEngine, sampling: SamplingParams):
    """``run(prompt_ids, max_new_tokens) -> GenerationResult`` on ``engine``."""
    return lambda ids, n: engine.generate_requests([Request(ids, n, sampling)])[0]


def _prompt_row(result, plain, sampling: SamplingParams) -> dict:
    """One prompt's τ, speedup over its own plain decoding, and (greedy) whether the outputs agree."""
    return {"tau": result.stats.mean_accepted_length if result.stats.rounds else None, "rounds": result.stats.rounds,
            "speedup": speedup(result.stats, plain.stats),
            "identical": None if not sampling.greedy else result.token_ids == plain.token_ids}


def _timing(stats: GenerationStats) -> dict:
    return {"tokens": stats.generated_tokens, "time_s": stats.total_time, "tokens_per_second": stats.tokens_per_second}


def format_table(report: dict) -> str:
    """The report as a text table: one row per draft, then the per-position acceptances."""
    plain = report["plain"]
    lines = [f"{report['prompts']} prompts, up to {report['max_new_tokens']} new tokens, "
             f"temperature {report['sampling']['temperature']}, scheduler {report['scheduler']}"
             + (f", tree mode: top-{report['draft_top_k']}, {report['tree_budget'] or 'block + 1'} nodes"
                if report.get("draft_top_k", 1) > 1 else ""),
             f"plain decoding: {plain['tokens']} tokens in {plain['time_s']:.2f} s "
             f"({plain['tokens_per_second']:.1f} tok/s)",
             "",
             f"{'draft':<24} {'tau':>6} {'rounds':>7} {'tok/s':>8} {'speedup':>8} {'identical':>10}"]
    for d in report["drafts"]:
        same = "-" if d["identical"] is None else f"{d['identical']}/{report['prompts']}"
        lines.append(f"{_short(d['name']):<24} {_cell(d['tau'], 6)} {d['rounds']:7d} {d['tokens_per_second']:8.1f} "
                     f"{_cell(d['speedup'], 7, 'x')} {same:>10}")
    positions = len(report["drafts"][0]["acceptance_per_position"])
    lines += ["", f"{'acceptance per position':<24} " + " ".join(f"{k:>5}" for k in range(1, positions + 1))]
    for d in report["drafts"]:
        values = " ".join("    -" if a is None else f"{a:5.2f}" for a in d["acceptance_per_position"])
        lines.append(f"{_short(d['name']):<24} {values}")
    return "\n".join(lines)


def format_per_prompt(report: dict, labels: list[str]) -> str:
    """Per-prompt τ and speedup of every draft (``labels``: one name per prompt)."""
    drafts = report["drafts"]
    lines = [f"{'prompt':<32} " + " ".join(f"{_short(d['name'], 20):>20}" for d in drafts),
             f"{'':<32} " + " ".join(f"{'tau  speedup':>20}" for _ in drafts)]
    for i, label in enumerate(labels):
        cells = (f"{_cell(d['per_prompt'][i]['tau'], 6)} {_cell(d['per_prompt'][i]['speedup'], 7, 'x')}"
                 for d in drafts)
        lines.append(f"{_short(label, 32):<32} " + " ".join(f"{c:>20}" for c in cells))
    return "\n".join(lines)


def _cell(value: float | None, width: int, unit: str = "") -> str:
    """``value`` to 2 decimals in ``width`` characters plus ``unit``; ``-`` when undefined."""
    return "-".rjust(width) + " " * len(unit) if value is None else f"{value:{width}.2f}{unit}"


def _short(name: str, width: int = 24) -> str:
    return name if len(name) <= width else "..." + name[-(width - 3):]
