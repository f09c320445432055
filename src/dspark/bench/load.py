"""Throughput at high load without a server: the frontier's configurations (``bench.frontier``:
plain decoding, DSpark verifying every draft, the cost scheduler on the confidence head or the
online estimator) on the 8B-shaped target with acceptance replay, each driving ``B`` rows with
``LLMEngine.generate`` -- concurrency B, every row refilled as soon as its request ends. The
requests ask for outputs of different lengths (``--length-spread``: between half of ``--max-tokens``
and all of it by default), so that rows end and take the next prompts at different steps in every
configuration, as under served traffic.

``python -m dspark.bench.load --out DIR --batches 128,256`` (on a GPU; ``--device cpu --shape tiny``:
toy sizes in fp32, the plumbing). ``--workload mixed``: instead, the frontier's mixed-settings
workload -- plain decoding and a random drafter drafting for real (``MIXED_CONFIGS``; with
``dspark-random-vocabulary``, sampled drafts over the whole vocabulary instead of candidate sets) each under greedy requests and
under ``bench.serve.MIXED_SETTINGS`` (request i: setting i mod 4, seed i), side by side.

A served frontier at B = 256 would first capture every graph a server may meet (about 1,900 for the cost scheduler: minutes per
configuration); here each engine runs the requests once, capturing the graphs it meets, then again
with the same requests, timed, and the timed run must capture none. One target and drafter serve
every configuration (the replay's peaked random model, ``bench.replay``); the cost table is profiled
first up to the largest batch's full verify. Prefix caching is off (the requests repeat the
benchmark's prompts). ``DIR/load.json`` / ``load.md``: per batch and configuration total tokens/s,
tau, engine steps, mean step time, and whether every request got the same tokens from every
configuration (greedy: it must); per configuration also the steady throughput, while requests
queue for the rows (``SteadyWindow``; the table's ratios), the seconds of the timed steps that captured a graph and
the throughput without them (a server captures first), what the cost table prices its mean step
at beside the measured one (``table_step_ms``), the plain
steps, the rows a step decoded on average (fewer than B: rows idle, e.g. waiting for their
prompt's turn in the step's token budget), the host ms per step (by phase), the preemptions (none
expected: every engine holds KV blocks -- ``kv_blocks`` -- for all its rows' longest requests) and the steady window's
steps by kind (plain, refresh, verify, verify+draft; ``+prompt`` with prompt chunks) with their host ms
and, with a cost table, their price (``step_price_ms``).
``--cost-table`` runs the cost scheduler on a given table instead of profiling one (a GPU run's table
on the CPU replay: that GPU's decisions); ``--host-ms DRAFTING,PLAIN`` on the CPU prices the host
time of a drafting and of a plain round at those milliseconds (a GPU measures them as it runs, the
CPU not at all): with a GPU's table and its host times, the CPU replays its choices. On a GPU the profile and each configuration run in a
process of their own (``--isolate``, ``Jobs``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from ..engine.schedulers import SPSCostTable
from .common import profile_table, python_profile_table
from .frontier import CONFIGS, MIXED_CONFIGS, _environment, profile
from .replay import TRACES, ReplayEngine, _models, _prompts, load_traces
from .serve import MIXED_SETTINGS
from .step_trace import kind_summary, step_drafted, step_kind, trace_markdown, trace_steps

__all__ = ["main"]

WORKLOADS = {"replay": CONFIGS, "mixed": MIXED_CONFIGS}  # label -> (engine factory, serve flags)
LOAD_CONFIGS = tuple(CONFIGS)  # plain, dspark-fixed, dspark-scheduled, dspark-scheduled-online


def engine_settings(label: str, cost_table: Path, workload: str = "replay") -> dict:
    """``EngineConfig`` settings of a frontier configuration (its ``dspark serve`` flags)."""
    flags = WORKLOADS[workload][label][1]
    settings = {}
    for flag, value in zip(flags[::2], flags[1::2]):
        name = flag.lstrip("-").replace("-", "_")
        settings[name] = str(cost_table) if value == "{cost_table}" else int(value) if value.isdigit() else value
    return settings


def output_lengths(max_tokens: int, spread: float, count: int) -> list[int]:
    """Each request's ``max_tokens``: spread evenly over ``(1 - spread) * max_tokens .. max_tokens``
    in a low-discrepancy order (request i at the golden ratio's multiple i mod 1), so that requests
    end at different steps, as served traffic does -- with one length, plain decoding's rows all
    end in the same step and run the next prompts together, outside the steady window."""
    golden = (5 ** 0.5 - 1) / 2
    return [max(1, round(max_tokens * (1 - spread * ((i * golden) % 1)))) for i in range(count)]


def requests_of(spec: dict, count: int, mixed: bool) -> list:
    """``count`` requests over the benchmark's prompts, of ``output_lengths``: greedy, or (``mixed``)
    request i with ``MIXED_SETTINGS[i % 4]`` and seed i, as ``bench.serve --mixed-settings`` sends them."""
    from ..engine import Request, SamplingParams

    prompts = _prompts(spec)

    def sampling(i: int) -> SamplingParams:
        setting = MIXED_SETTINGS[i % len(MIXED_SETTINGS)] if mixed else {"temperature": 0.0}
        return SamplingParams(**setting, seed=i)

    lengths = output_lengths(spec["max_tokens"], spec.get("length_spread", 0.0), count)
    return [Request(prompts[i % len(prompts)], n, sampling(i), ignore_eos=True) for i, n in enumerate(lengths)]


@dataclass
class Models:
    """What every configuration shares: the target, the drafter, and the replayed prompts'
    continuations once the first replay engine learnt them (at the largest batch, which runs first)."""

    target: object
    draft: object
    known: dict | None = None


def build_engine(label: str, workload: str, batch: int, spec: dict, models: Models, cost_table: Path | None):
    """The engine of a configuration at ``batch`` rows."""
    from ..engine import EngineConfig, LLMEngine

    target, draft = models.target, models.draft
    # KV blocks for every row's longest request (gpu_memory_utilization None): sized from the GPU's free
    # memory, an engine's blocks would depend on what the process still held, and one short of them preempts
    config = EngineConfig(max_batch=batch, max_model_len=spec["prompt_tokens"] + spec["max_tokens"] + 64,
                          enable_prefix_caching=False, gpu_memory_utilization=None, device=spec["device"],
                          dtype=getattr(torch, spec["dtype"]), **engine_settings(label, cost_table, workload))
    if label == "plain":
        return LLMEngine(target, None, config)
    if workload == "mixed":  # a random drafter drafting for real
        return LLMEngine(target, draft, config)
    traces = load_traces(spec["traces"])
    engine = ReplayEngine(target, draft, config, _prompts(spec), traces["traces"], spec["max_tokens"],
                          known=models.known)
    models.known = engine.known
    if spec.get("host_ms"):  # on the CPU the engine measures none: the scheduler prices these
        engine._host_ms = list(spec["host_ms"])
    return engine


@dataclass
class _StepRecord:
    """What ``SteadyWindow`` keeps of a step: its tokens, and as it ended whether requests waited for
    a row, whether the ramp was over (``SteadyWindow``), the engine's step and capture seconds."""

    tokens: int
    waiting: bool
    settled: bool
    step_time: float
    capture_time: float
    plain_steps: int = 0  # the engine's counters as the step ended, for the steady window's step kinds
    draft_tokens: int = 0
    prompt_tokens: int = 0
    host_time: float = 0.0
    row_tokens: int = 0  # the running rows' tokens, and their rounds (a DSpark runner's rows)
    rounds: int = 0


class SteadyWindow:
    """The throughput while requests queue for the rows: from the first step after the ramp -- once
    as many requests as there are rows have produced tokens (the first batch's prompts all ran) --
    to the last that ended with requests still waiting (the queue not yet empty): the tokens of the
    steps after the first, over the engine's step time between them, less the steps that captured
    a graph. Rows that end take the next prompts within it, as under served traffic. The whole run's
    throughput also counts the tail, where rows empty as the last requests end: as long as the
    slowest request in a load of a few requests per row, so DSpark's requests of uneven acceptance
    leave more rows idle there than plain decoding's. With a cost ``table``, each step kind is also
    priced as the cost scheduler prices it (``step_price_ms``)."""

    def __init__(self, engine, table=None):
        self.engine, self.table = engine, table
        self.steps: dict[int, _StepRecord] = {}
        self.started: set[int] = set()  # requests that produced tokens

    def observe(self, output) -> None:
        """``generate``'s ``on_output``: count the step's tokens (the engine's counters as it ended)."""
        m, scheduler = self.engine.metrics, self.engine.scheduler
        if m.steps not in self.steps:
            settled = len(self.started) >= scheduler.max_batch
            self.steps[m.steps] = _StepRecord(0, bool(scheduler.waiting), settled, m.step_time, m.capture_step_time,
                                              m.plain_steps, m.draft_tokens, m.prompt_tokens, m.host_time,
                                              m.row_tokens, m.rounds)
        self.steps[m.steps].tokens += len(output.new_token_ids)
        if output.new_token_ids:
            self.started.add(output.request_id)

    def report(self) -> dict:
        busy = sorted(k for k, step in self.steps.items() if step.waiting)
        start = next((k for k in busy if self.steps[k].settled), None)
        if start is None or start == busy[-1]:
            return {"steady_steps": 0, "steady_tokens_per_s": None}
        first, last = self.steps[start], self.steps[busy[-1]]
        tokens = sum(step.tokens for k, step in self.steps.items() if start < k <= busy[-1])
        seconds = (last.step_time - first.step_time) - (last.capture_time - first.capture_time)
        return {"steady_steps": busy[-1] - start, "steady_tokens_per_s": round(tokens / max(seconds, 1e-9), 1),
                "steady_step_kinds": self._kinds(start, busy[-1])}

    def _kinds(self, start: int, end: int) -> dict[str, dict]:
        """The steady window's steps by kind -- whether the step verified drafts, whether it ran the
        draft pass (``plain``: neither; ``refresh``: drafted without verifying), ``+prompt`` where it
        ran prompt chunks too (``step_trace.step_kind``) -- each kind's count, mean ms, host ms (the
        engine's: all but waiting for the device), tokens a step and, with a table, its price
        (``table_ms``; capture steps left out): where a scheduler's time goes, and how far its
        prices are from it."""
        kinds: dict[str, list[tuple[float, float, int, float]]] = {}
        for k in range(start + 1, end + 1):
            step, before = self.steps.get(k), self.steps.get(k - 1)
            if step is None or before is None or step.capture_time != before.capture_time:
                continue
            speculative = self.engine.runner.drafter is not None
            kind = step_kind(before, step, speculative)
            price = (0.0 if self.table is None
                     else step_price_ms(self.table, before, step, step_drafted(before, step, speculative)))
            kinds.setdefault(kind, []).append((step.step_time - before.step_time, step.host_time - before.host_time,
                                               step.tokens, price))
        return {kind: {"steps": len(v), "ms": round(1e3 * sum(x[0] for x in v) / len(v), 3),
                       "host_ms": round(1e3 * sum(x[1] for x in v) / len(v), 3),
                       "tokens": round(sum(x[2] for x in v) / len(v), 1),
                       **({} if self.table is None else {"table_ms": round(sum(x[3] for x in v) / len(v), 3)})}
                for kind, v in sorted(kinds.items())}


def step_price_ms(table, before: _StepRecord, step: _StepRecord, drafted: bool) -> float:
    """The cost table's price of ``step`` (the counters before and after it), as the cost scheduler
    prices a round: its running rows' tokens over its rows (a DSpark runner's rounds; one token a
    row otherwise) and its prompt tokens in one forward, plus the draft pass where it drafted --
    device time, without the host's."""
    tokens, prompt = step.row_tokens - before.row_tokens, step.prompt_tokens - before.prompt_tokens
    rows = (step.rounds - before.rounds) or tokens
    if not tokens:
        return table.step_time(prompt)
    return table.forward_time(tokens, rows, prompt) + (table.draft_time(rows) if drafted else 0.0)


def run_config(label: str, batch: int, spec: dict, models: Models, cost_table: Path | None, requests_per_row: int,
               workload: str = "replay", mixed: bool = False, profile_to: Path | None = None,
               trace: tuple[Path, int, int] | None = None) -> dict:
    """One configuration at ``batch`` rows: an untimed run, then the timed one (``mixed``: the
    requests of ``MIXED_SETTINGS``); with ``profile_to``, a third run under the PyTorch profiler,
    its table written there (``common.profile_table``), and a fourth under cProfile beside it
    (``-python.txt``: ``common.python_profile_table``); with ``trace`` = ``(path, first, count)``,
    one more run whose steps ``first ..`` are traced (``step_trace``): the Chrome trace at ``path``
    (``.json.gz``), the steps' wall and device busy time beside it (``.md``) and by kind in the result."""
    engine = build_engine(label, workload, batch, spec, models, cost_table)
    table = cost_table and SPSCostTable.from_json(str(cost_table))
    requests = requests_of(spec, batch * requests_per_row, mixed)
    label = f"{label}-mixed" if mixed else label
    try:
        engine.generate(requests)  # captures the graphs this load meets
        m = engine.metrics
        before = dict(steps=m.steps, rounds=m.rounds, drafts=m.draft_tokens, accepted=m.accepted_tokens,
                      step_time=m.step_time, captures=engine.runner.captures, tokens=m.generated_tokens,
                      capture_time=m.capture_step_time, host_time=m.host_time, plain_steps=m.plain_steps,
                      held_rounds=m.held_rounds,
                      host_phases=dict(m.host_phases),
                      preemptions=m.preemptions, forward_tokens=m.row_tokens + m.prompt_tokens)
        _synchronize(spec)
        steady = SteadyWindow(engine, table)
        start = time.perf_counter()
        results = engine.generate(requests, steady.observe)
        _synchronize(spec)
        elapsed = time.perf_counter() - start
        steps, rounds = m.steps - before["steps"], m.rounds - before["rounds"]
        plain_steps = m.plain_steps - before["plain_steps"]
        tokens = sum(len(r.token_ids) for r in results)
        captures = m.capture_step_time - before["capture_time"]
        result = {"config": label, "batch": batch, "requests": len(requests), "tokens": tokens,
                "seconds": round(elapsed, 3), "tokens_per_s": round(tokens / elapsed, 1),
                # a server captures every graph first: its throughput is without the steps that captured
                "capture_seconds": round(captures, 3),
                "tokens_per_s_captured_first": round(tokens / max(elapsed - captures, 1e-9), 1),
                **steady.report(),
                "tau": None if label.startswith("plain") else round((m.accepted_tokens - before["accepted"] + rounds)
                                                          / max(rounds, 1), 3),
                "steps": steps, "step_ms": round(1e3 * (m.step_time - before["step_time"]) / max(steps, 1), 3),
                "captures_timed": engine.runner.captures - before["captures"],
                "plain_steps": plain_steps, "held_rounds": m.held_rounds - before["held_rounds"],
                "preemptions": m.preemptions - before["preemptions"],
                "kv_blocks": engine.runner.num_kv_blocks,
                # rows a step decoded on average (below the batch: rows idle, e.g. waiting for their prompt)
                "rows_per_step": None if label.startswith("plain") else round(rounds / max(steps, 1), 1),
                "host_ms": round(1e3 * (m.host_time - before["host_time"]) / max(steps, 1), 3),
                "host_phase_ms": {k: round(1e3 * (v - before["host_phases"][k]) / max(steps, 1), 3)
                                  for k, v in m.host_phases.items()},
                "drafts_verified_per_round": None if label.startswith("plain") else round(
                    (m.draft_tokens - before["drafts"]) / max(rounds, 1), 2),
                # what the cost scheduler priced a drafting / a plain round's host time at, in the end
                "priced_host_ms": [round(x, 3) for x in engine._host_ms],
                "tokens_per_forward": round((m.row_tokens + m.prompt_tokens - before["forward_tokens"]) / max(steps, 1), 1),
                "failed": sum(r.finish_reason == "error" for r in results),
                "outputs": [r.token_ids for r in results]}
        result["table_step_ms"] = table_step_ms(table, result, engine.runner.drafter is not None)
        if profile_to is not None:  # the same requests once more, profiled
            profile_to.write_text(profile_table(partial(engine.generate, requests), torch.device(spec["device"])))
            python_profile = profile_to.with_name(profile_to.stem + "-python.txt")
            python_profile.write_text(python_profile_table(partial(engine.generate, requests)))
        if trace is not None:
            path, first, count = trace
            rows = trace_steps(engine, partial(engine.generate, requests), first, count, path)
            path.with_name(path.name.replace(".json.gz", ".md")).write_text(
                trace_markdown(f"{label} at {batch} rows: steps {first} .. {first + count - 1}", rows) + "\n")
            result["traced_step_kinds"] = kind_summary(rows)
        return result
    finally:
        engine.close()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


class Jobs:
    """The cost table's profiling and each configuration's run (``run_config``), in this process or
    (``isolate``: on a GPU) each in a process of its own -- every configuration then starts from an
    empty GPU, as a server does: in one process, an 80 GB H100 ran out of memory building the third
    256-row engine, the earlier engines' memory not all given back."""

    def __init__(self, spec: dict, isolate: bool):
        self.spec, self.isolate = spec, isolate
        self.models: Models | None = None

    def run(self, job: dict):
        """``job`` (``kind`` ``profile``: the cost table's path; ``config``: ``run_config``'s result)."""
        if not self.isolate:
            return self._run(job)
        with tempfile.TemporaryDirectory() as tmp:
            result = Path(tmp) / "result.json"
            payload = json.dumps({**job, "spec": self.spec, "result": str(result)})
            subprocess.run([sys.executable, "-m", "dspark.bench.load", "--job", payload], check=True)
            return json.loads(result.read_text())

    def _run(self, job: dict):
        os.environ["DSPARK_REPLAY"] = json.dumps(self.spec)
        if job["kind"] == "profile":
            return str(profile(self.spec, Path(job["out"]), load_traces(TRACES)["num_drafts"], job["batch"]))
        if self.models is None:
            from ..engine import EngineConfig

            self.models = Models(*_models(self.spec, EngineConfig(), draft=True))
        cost_table, profile_to, trace = job["cost_table"], job["profile_to"], job["trace"]
        return run_config(job["label"], job["batch"], self.spec, self.models, cost_table and Path(cost_table),
                          job["requests_per_row"], job["workload"], job["mixed"], profile_to and Path(profile_to),
                          trace and (Path(trace[0]), *trace[1:]))


def _job(payload: str) -> int:
    """``--job``: one of ``Jobs``' jobs in this process, its result written as JSON where it says."""
    job = json.loads(payload)
    result = Jobs(job.pop("spec"), isolate=False).run(job)
    Path(job["result"]).write_text(json.dumps(result))
    return 0


def _or_dash(value) -> str:
    return "-" if value is None else str(value)


def table_step_ms(table: SPSCostTable | None, result: dict, drafts: bool) -> float | None:
    """What the cost table prices the configuration's mean step at: a forward of its mean tokens
    (running rows' and prompt chunks') over its mean rows, plus the draft pass of its mean rows on the steps that
    drafted -- beside the measured ``step_ms``, how far the scheduler's prices are from the steps."""
    if table is None:
        return None
    steps = max(result["steps"], 1)
    drafting = (steps - result["plain_steps"]) / steps if drafts else 0.0
    rows = result["rows_per_step"] or 1
    forward = table.forward_time(max(round(result["tokens_per_forward"]), 1), round(rows))
    return round(forward + drafting * table.draft_time(round(rows)), 3)


def _synchronize(spec: dict) -> None:
    if spec["device"] == "cuda":
        torch.cuda.synchronize()


def markdown(report: dict) -> str:
    """The report's table; its ratios are of the steady throughput (``SteadyWindow``: after the ramp
    while requests queue, capture steps left out), which a server under sustained load sees."""
    lines = [f"Environment: {report['environment']}", "", f"`{report['command']}`", "",
             "| B | config | total tok/s | tok/s captured first | steady tok/s | vs plain | vs fixed | mixed / greedy "
             "| τ | steps | steady steps | plain steps | held rounds | rows / step | step ms | table ms "
             "| host ms (plan/launch/commit) | timed captures (s) | preempted | failed |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for batch, rows in report["batches"].items():
        by = {r["config"]: r for r in rows}
        for r in rows:
            greedy = r["config"].removesuffix("-mixed")
            ratio = {k: (f"{_rate(r) / _rate(by[k]):.3f}x" if k in by else "-")
                     for k in ("plain", "dspark-fixed", greedy)}
            lines.append(f"| {batch} | {r['config']} | {r['tokens_per_s']} | {r['tokens_per_s_captured_first']} "
                         f"| {r['steady_tokens_per_s']} | {ratio['plain']} | {ratio['dspark-fixed']} "
                         f"| {ratio[greedy] if greedy != r['config'] else '-'} "
                         f"| {r['tau'] if r['tau'] is not None else '-'} | {r['steps']} | {r['steady_steps']} "
                         f"| {r['plain_steps']} | {r['held_rounds']} "
                         f"| {r['rows_per_step'] if r['rows_per_step'] is not None else '-'} "
                         f"| {r['step_ms']} | {r['table_step_ms'] if r['table_step_ms'] is not None else '-'} "
                         f"| {r['host_ms']} ({'/'.join(str(x) for x in r['host_phase_ms'].values())}) | {r['captures_timed']} ({r['capture_seconds']}) "
                         f"| {r['preemptions']} | {r['failed']} of {r['requests']} |")
    lines += ["", f"Every greedy request got the same tokens from every configuration: **{report['outputs_identical']}**",
              "", "Steady window by step kind (steps x mean ms, of it host ms; the cost table's price of the step's device "
              "work; tokens a step):", ""]
    for batch, rows in report["batches"].items():
        for r in rows:
            kinds = "; ".join(f"{kind} {v['steps']} x {v['ms']} ms ({v['host_ms']} host"
                              f"{'; table ' + str(v['table_ms']) if 'table_ms' in v else ''}), {v['tokens']} tok"
                              for kind, v in (r.get("steady_step_kinds") or {}).items())
            lines.append(f"- {batch} {r['config']}: {kinds or '-'}")
    traced = [(batch, r) for batch, rows in report["batches"].items() for r in rows if r.get("traced_step_kinds")]
    if traced:
        lines += ["", "Traced steps by kind (steps x ms: wall = device busy + device idle; the host blocked), "
                  "trace-<config>-b<B>.md:", ""]
    for batch, r in traced:
        kinds = "; ".join(f"{kind} {v['steps']} x {v['wall_ms']} = {_or_dash(v['busy_ms'])} + "
                          f"{_or_dash(v['idle_ms'])} ({v['waited_ms']})" for kind, v in r["traced_step_kinds"].items())
        lines.append(f"- {batch} {r['config']}: {kinds}")
    return "\n".join(lines)


def _rate(row: dict) -> float:
    """A row's steady throughput, or without its capture steps where no steady window was seen."""
    return row["steady_tokens_per_s"] or row["tokens_per_s_captured_first"]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--job"] and len(argv) == 2:
        return _job(argv[1])
    parser = argparse.ArgumentParser(prog="python -m dspark.bench.load", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for cost_table.json, load.json, load.md")
    parser.add_argument("--batches", default="128,256", help="comma-separated row counts (concurrency)")
    parser.add_argument("--workload", choices=tuple(WORKLOADS), default="replay",
                        help="replay: greedy requests, acceptance replay; mixed: greedy and mixed-settings requests, "
                             "a random drafter drafting for real")
    parser.add_argument("--configs", default=None,
                        help=f"subset of {','.join(CONFIGS)} (--workload mixed: of {','.join(MIXED_CONFIGS)}; "
                             "default: all but dspark-random-vocabulary)")
    parser.add_argument("--requests-per-row", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=256, help="the longest request's output tokens")
    parser.add_argument("--length-spread", type=float, default=0.5,
                        help="requests ask for (1 - S) x .. 1 x --max-tokens output tokens, spread evenly "
                             "(output_lengths; 0: every request --max-tokens)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--shape", default="qwen3-8b", help="a shape of bench.engine.SHAPES, or tiny (--device cpu)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: fp32")
    parser.add_argument("--draft-rank", type=int, default=256)
    parser.add_argument("--cost-table", default=None,
                        help="the cost scheduler's table to use instead of profiling one (e.g. a GPU run's "
                             "cost_table.json on the CPU replay: that GPU's scheduling decisions, the CPU's times)")
    parser.add_argument("--profile", default="", help="comma-separated labels as reported (e.g. dspark-random-mixed) "
                        "whose requests run again under the PyTorch profiler and under cProfile: "
                        "OUT/profile-<label>-b<B>.txt and OUT/profile-<label>-b<B>-python.txt")
    parser.add_argument("--trace", default="", help="comma-separated labels as reported whose requests run again "
                        "with steps --trace-steps traced (device busy against idle, step by step): "
                        "OUT/trace-<label>-b<B>.json.gz (Chrome trace) and .md")
    parser.add_argument("--trace-steps", default="60,24", help="FIRST,COUNT: the traced steps of that run")
    parser.add_argument("--host-ms", default=None,
                        help="DRAFTING,PLAIN: --device cpu only, the host ms of a drafting and a plain round the "
                             "cost scheduler prices (a GPU run's: its choices on the CPU replay)")
    parser.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                        help="profile and run each configuration in a process of its own (default: on a GPU)")
    args = parser.parse_args(argv)
    known = WORKLOADS[args.workload]
    labels = [x for x in (args.configs or ",".join(x for x in known if x != "dspark-random-vocabulary")).split(",") if x]
    if not labels or any(x not in known for x in labels):
        parser.error(f"--configs must name some of {list(known)}, got {args.configs!r}")
    reportable = [f"{x}{suffix}" for x in labels for suffix in (("", "-mixed") if args.workload == "mixed" else ("",))]
    args.profile = [x for x in args.profile.split(",") if x]
    if any(x not in reportable for x in args.profile):
        parser.error(f"--profile must name labels this run reports ({', '.join(reportable)}), "
                     f"got {','.join(args.profile)!r}")
    args.trace = [x for x in args.trace.split(",") if x]
    if any(x not in reportable for x in args.trace):
        parser.error(f"--trace must name labels this run reports ({', '.join(reportable)}), "
                     f"got {','.join(args.trace)!r}")
    try:
        first, count = (int(x) for x in args.trace_steps.split(","))
    except ValueError:
        first = count = -1
    if first < 0 or count < 1:
        parser.error(f"--trace-steps must be FIRST,COUNT with FIRST >= 0 and COUNT >= 1, got {args.trace_steps!r}")
    try:
        batches = sorted({int(b) for b in args.batches.split(",") if b.strip()}, reverse=True)  # largest first
    except ValueError:
        batches = []
    if not batches or batches[-1] < 1:
        parser.error(f"--batches must be comma-separated integers >= 1, got {args.batches!r}")
    for name in ("requests_per_row", "max_tokens", "prompt_tokens", "num_prompts", "draft_rank"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0.0 <= args.length_spread < 1.0:
        parser.error(f"--length-spread must be in [0, 1), got {args.length_spread}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here (--device cpu --shape tiny runs on the CPU)")
    from .engine import SHAPES, TINY, VOCAB

    if args.shape not in (*SHAPES, "tiny"):
        parser.error(f"--shape must be one of {[*SHAPES, 'tiny']}, got {args.shape!r}")
    shape = {k: v for k, v in TINY.items() if k != "vocab"} if args.shape == "tiny" else args.shape
    vocab = TINY["vocab"] if args.shape == "tiny" else VOCAB
    host_ms = None
    if args.host_ms is not None:
        try:
            host_ms = [float(x) for x in args.host_ms.split(",")]
        except ValueError:
            host_ms = []
        if len(host_ms) != 2 or min(host_ms) < 0:
            parser.error(f"--host-ms must be DRAFTING,PLAIN milliseconds >= 0, got {args.host_ms!r}")
        if args.device != "cpu":
            parser.error("--host-ms prices host times on the CPU replay (--device cpu); a GPU measures them")
    if args.cost_table is not None and not Path(args.cost_table).is_file():
        parser.error(f"--cost-table must be a cost table file (`dspark profile`), got {args.cost_table!r}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    spec = {"shape": shape, "vocab": vocab, "device": args.device,
            "dtype": "bfloat16" if args.device == "cuda" else "float32", "draft_rank": args.draft_rank,
            "traces": str(TRACES), "num_prompts": args.num_prompts, "prompt_tokens": args.prompt_tokens,
            "prompt_tokens_max": None, "max_tokens": args.max_tokens, "length_spread": args.length_spread,
            "host_ms": host_ms}
    isolate = args.device == "cuda" if args.isolate is None else args.isolate
    jobs = Jobs(spec, isolate)
    scheduled = any("{cost_table}" in WORKLOADS[args.workload][x][1] for x in labels)
    cost_table = None
    if scheduled:
        cost_table = (args.cost_table if args.cost_table is not None
                      else jobs.run({"kind": "profile", "out": str(out), "batch": batches[0]}))
    report = {"command": "python -m dspark.bench.load " + " ".join(argv),
              "environment": _environment(args.device), "spec": spec, "batches": {}}
    outputs = {}
    for batch in batches:
        for label, mixed in [(x, m) for x in labels for m in ((False, True) if args.workload == "mixed" else (False,))]:
            reported = f"{label}-mixed" if mixed else label
            profile_to = str(out / f"profile-{reported}-b{batch}.txt") if reported in args.profile else None
            trace = (str(out / f"trace-{reported}-b{batch}.json.gz"), first, count) if reported in args.trace else None
            row = jobs.run({"kind": "config", "label": label, "batch": batch, "cost_table": cost_table,
                            "requests_per_row": args.requests_per_row, "workload": args.workload, "mixed": mixed,
                            "profile_to": profile_to, "trace": trace})
            greedy = [o for i, o in enumerate(row.pop("outputs")) if args.workload != "mixed" or i % len(MIXED_SETTINGS) == 0]
            outputs.setdefault(batch, []).append(greedy)
            report["batches"].setdefault(str(batch), []).append(row)
            print(json.dumps(row), flush=True)
            report["outputs_identical"] = all(o == runs[0] for runs in outputs.values() for o in runs)
            (out / "load.json").write_text(json.dumps(report, indent=1))
    (out / "load.md").write_text(markdown(report) + "\n")
    print(markdown(report))
    return int(not report["outputs_identical"])


if __name__ == "__main__":
    sys.exit(main())
