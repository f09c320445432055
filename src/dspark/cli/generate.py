"""Generate text with DSpark speculative decoding (target + draft checkpoint directories).

Prints the prompt and streams the continuation as rounds are accepted (token ids when the target
has no tokenizer; the prompt's ids in brackets), then the statistics: tau = tokens produced per
verification round (accepted drafts + the target's own bonus token), mean verified drafts = drafts
the scheduler sent to verification per round. Without --target/--draft the demo pair shipped with
the package runs; --target / --draft may also be Hugging Face Hub names (from the cache, else downloaded
unless HF_HUB_OFFLINE=1), and --no-draft decodes with the target alone. Prompts: --prompt, --prompt-ids or --prompt-file (a text file is one prompt, - reads
stdin, a .jsonl file holds one request per line: {"prompt": TEXT} or {"prompt_ids": [...]}, optionally
with max_new_tokens, temperature, top_k, top_p, min_p, logit_bias (token ids as keys), presence_penalty,
frequency_penalty, repetition_penalty, min_tokens, bad_words (strings), seed). The output ends after the
target's EOS (unless --ignore-eos; not before --min-tokens tokens), before a --stop string, at --max-new-tokens
or at the context limit (--max-model-len; an over-long prompt is refused). --compare also runs plain target decoding and
prints the speedup (ratio of tokens/s): after the printed run and one untimed plain run (warm-ups:
kernels, graphs, caches), --compare-runs timed runs of each side, alternating; the median speedup
and its range, the statistics of the median run. In greedy mode it checks that every run's outputs
are identical (exit status 1 otherwise in float32; in bfloat16/float16 a difference is reported as
rounding).
Structured outputs (llama.cpp's flags): --json-schema FILE, --json-object, --regex RE, --grammar FILE
(EBNF, xgrammar's dialect) or --choice TEXT (repeated): every output matches, and ends when complete.
--json prints one JSON object per request per line, in input order. Ctrl-C prints the statistics so
far and exits with status 130.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass, replace

from ._prompts import read_prompt_file
from ._runtime import (add_eager_argument, add_kv_cache_arguments, add_parallel_argument, add_penalty_arguments,
                       add_runtime_arguments, add_sampling_arguments, add_scheduler_arguments,
                       check_scheduler_arguments, kv_cache_options, mismatch_status, penalty_settings, resolve_pair,
                       runtime, sampling_params, stop_string)

COMPARE_RUNS = 5  # --compare's timed runs of each side by default (the README's first command: ~N x 4 s)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", help="Hugging Face causal LM: a directory or a Hub name such as Qwen/Qwen3-0.6B "
                                         "(default: the verifier --draft's config names; neither: the demo pair)")
    parser.add_argument("--draft", help="DSpark draft, speculators or DeepSpec format: a directory or a Hub name "
                                        "(default: the demo pair's draft)")
    parser.add_argument("--no-draft", action="store_true",
                        help="plain decoding with the target alone (the baseline)")
    prompt = parser.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help="prompt text (needs the target's tokenizer; "
                                         "default with the demo pair: the start of a held-out file)")
    prompt.add_argument("--prompt-ids", help="prompt token ids, comma-separated (e.g. 1,2,3)")
    prompt.add_argument("--prompt-file", metavar="FILE",
                        help="a text file (one prompt; - reads stdin) or a .jsonl file of requests")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="most tokens generated per request")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="context limit, prompt + output (default: the target's max_position_embeddings)")
    parser.add_argument("--stop", action="append", metavar="TEXT", type=stop_string,
                        help="end the output before this text (repeatable; needs the tokenizer); escapes as in "
                             "llama.cpp: \\n, \\t, \\r, \\\\, \\\", \\', \\xHH, \\uXXXX")
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at the target's end-of-sequence token")
    add_sampling_arguments(parser)
    add_penalty_arguments(parser)
    add_structured_arguments(parser)
    add_scheduler_arguments(parser)
    add_runtime_arguments(parser)
    parser.add_argument("--engine", choices=("auto", "batched", "reference"), default="auto",
                        help="both run the LLMEngine: batched decodes up to --max-batch requests together (CUDA "
                             "graphs on a GPU); reference one request at a time, eagerly (max batch 1, no CUDA "
                             "graphs); auto: batched on CUDA, else reference")
    add_eager_argument(parser)
    add_kv_cache_arguments(parser)
    add_parallel_argument(parser)
    parser.add_argument("--max-batch", type=int, default=64, help="batched engine: requests decoded together")
    parser.add_argument("--compare", action="store_true", help="also run plain target decoding and report the speedup")
    parser.add_argument("--compare-runs", type=int, default=None, metavar="N",
                        help=f"--compare: timed runs of each side after one untimed run of each; prints their median "
                             f"speedup and range (default: {COMPARE_RUNS})")
    parser.add_argument("--json", action="store_true", help="print one JSON object per request instead of streaming text")


def add_structured_arguments(parser: argparse.ArgumentParser) -> None:
    """Structured outputs, llama.cpp's flags: at most one of them."""
    group = parser.add_argument_group("structured outputs (at most one; the output ends when it is complete)")
    group.add_argument("--json-schema", metavar="FILE", help="the output is JSON matching this JSON schema file")
    group.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    group.add_argument("--regex", metavar="RE", help="the output matches this regular expression")
    group.add_argument("--grammar", metavar="FILE", help="the output matches this EBNF grammar file (xgrammar's "
                                                         "dialect: root ::= ...)")
    group.add_argument("--choice", metavar="TEXT", action="append", help="the output is one of these strings "
                                                                         "(repeat the flag)")


def structured_outputs(args: argparse.Namespace):
    """The ``StructuredOutputs`` of --json-schema / --json-object / --regex / --grammar / --choice, or
    None; ValueError naming the flags when more than one is given or a file cannot be read."""
    from dspark.engine import StructuredOutputs

    given = {flag: value for flag, value in (("--json-schema", args.json_schema), ("--json-object", args.json_object),
                                             ("--regex", args.regex), ("--grammar", args.grammar),
                                             ("--choice", args.choice)) if value}
    if len(given) > 1:
        raise ValueError(f"give at most one of --json-schema, --json-object, --regex, --grammar, --choice; got "
                         f"{', '.join(given)}")
    if not given:
        return None
    (flag, value), = given.items()
    if flag in ("--json-schema", "--grammar"):
        try:
            with open(value, encoding="utf-8") as f:
                value = f.read()
        except OSError as exc:
            raise ValueError(f"{flag}: cannot read {value}: {exc.strerror}") from None
    field = {"--json-schema": "json", "--json-object": "json_object", "--regex": "regex", "--grammar": "grammar",
             "--choice": "choice"}[flag]
    try:
        return StructuredOutputs(**{field: value})
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{flag}: {exc}") from None


@dataclass
class TimedRun:
    """One timed run of ``--compare``: every request decoded speculatively, then plainly (request order)."""

    speculative: list
    plain: list

    def speedup(self, index: int | None = None) -> float | None:
        """Speculative over plain tokens/s: of request ``index``, or of all requests together (None)."""
        from dspark.evaluation import merge_stats, speedup

        sides = [results if index is None else [results[index]] for results in (self.speculative, self.plain)]
        return speedup(*(merge_stats([r.stats for r in side]) for side in sides))

    def identical(self, index: int) -> bool:
        return self.speculative[index].token_ids == self.plain[index].token_ids


def run(args: argparse.Namespace) -> int:
    from dspark.engine import GenerationInterrupted, generate_texts

    try:
        decoder, tokenizer, requests, dtype = _prepare(args)
        printer = None if args.json or len(requests) > 1 else _Printer(tokenizer, requests[0].prompt_ids)
    except (ValueError, TypeError, OSError) as exc:
        print(f"dspark generate: {exc}", file=sys.stderr)
        return 2
    stream = {} if printer is None else {"on_text": printer.text} if tokenizer is not None else {"on_tokens": printer.ids}
    try:
        results = generate_texts(decoder, requests, tokenizer, stop=args.stop or (), **stream)
    except GenerationInterrupted as exc:
        return _interrupted(exc.results)
    try:
        runs = _timed_runs(decoder, requests, tokenizer, args.stop, args.compare_runs) if args.compare else []
    except GenerationInterrupted:
        return _interrupted(results)
    reports = [_report(i, request, result, runs) for i, (request, result) in enumerate(zip(requests, results))]
    if args.json:
        for report in reports:
            print(json.dumps(report))
    else:
        if printer is None:
            for i, (request, result) in enumerate(zip(requests, results)):
                _print_result(i, tokenizer, request, result)
        print()
        _print_summary(_summary(results, runs, [r.sampling.greedy for r in requests]))
    differ = [i for i, report in enumerate(reports) if report.get("identical") is False]
    if not differ:
        return 0
    return mismatch_status(dtype, "this prompt" if len(reports) == 1 else f"request(s) {differ}", "generate")


def _prepare(args: argparse.Namespace):
    """``(engine, tokenizer, requests, dtype)``: options checked, models loaded (``LLM``), every
    request built and checked against the target (an over-long prompt is refused before anything runs)."""
    from dataclasses import replace

    from dspark.engine import check_target_directory, load_tokenizer
    from dspark.engine.api import LLM

    sampling = replace(sampling_params(args, "generate"), structured_outputs=structured_outputs(args))
    device, dtype = runtime(args)
    check_scheduler_arguments(args)
    if args.no_draft and args.compare:
        raise ValueError("--compare runs plain decoding beside speculative decoding: not with --no-draft")
    if args.compare_runs is not None and (not args.compare or args.compare_runs < 1):
        raise ValueError(f"--compare-runs must be >= 1 and goes with --compare, got {args.compare_runs}"
                         f"{'' if args.compare else ' without --compare'}")
    if args.max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, got {args.max_batch}")
    _use_demo_pair_by_default(args)
    check_target_directory(args.target)
    tokenizer = load_tokenizer(args.target)
    if args.stop and tokenizer is None:
        raise ValueError(f"--stop needs the target's tokenizer, but {args.target_name} has none")
    sampling = replace(sampling, **penalty_settings(args, tokenizer))
    records = _prompt_records(args)
    requests = [_request(args, tokenizer, sampling, where, record) for where, record in records]
    llm = LLM(args.target, args.draft, no_draft=args.no_draft, tokenizer=tokenizer, engine=args.engine,
              max_batch=min(args.max_batch, len(requests)), max_model_len=args.max_model_len,
              scheduler=args.scheduler, threshold=args.threshold, cost_table=args.cost_table,
              min_predicted_gain=args.min_predicted_gain, allow_pickle=args.allow_pickle, device=device, dtype=dtype,
              draft_top_k=args.draft_top_k, tree_budget=args.tree_budget, enforce_eager=args.enforce_eager,
              draft_candidates=args.draft_candidates, draft_successors=args.draft_successors,
              schedule_signal=args.schedule_signal, tensor_parallel_size=args.tensor_parallel_size,
              **kv_cache_options(args))
    for (where, _), request in zip(records, requests):
        _named(where, llm.decoder.check_request, request)
    return llm.decoder, tokenizer, requests, dtype


# The demo pair's default prompt: the held-out file whose τ (3.63) is nearest the whole held-out set's
# (3.62, docs/demo-pair.md) -- a representative prompt; per-file τ ranges from 2.0 to 7.9.
DEMO_PROMPT_FILE = "test/support/_hypothesis_stubs/strategies.py"


def _use_demo_pair_by_default(args: argparse.Namespace) -> None:
    """--target / --draft resolved to directories (``resolve_pair``: Hub names, the demo pair when
    neither is given); the demo pair is prompted (unless a prompt is given) with the start of the
    held-out file ``DEMO_PROMPT_FILE``."""
    demo = args.target is None and args.draft is None
    resolve_pair(args, no_draft=args.no_draft)
    no_prompt = args.prompt is None and args.prompt_ids is None and args.prompt_file is None
    if demo:
        from dspark.training.data import demo_pair, read_prompts

        if no_prompt:
            records = read_prompts(str(demo_pair().prompts))
            args.prompt = next((r for r in records if r.get("file") == DEMO_PROMPT_FILE), records[0])["text"]
    elif no_prompt:
        raise ValueError("give a prompt: --prompt TEXT, --prompt-ids 1,2,3 or --prompt-file FILE")


def _prompt_records(args: argparse.Namespace) -> list[tuple[str, dict]]:
    """``(where, record)`` per request (see ``_prompts.read_prompt_file``)."""
    if args.prompt_file is not None:
        return read_prompt_file(args.prompt_file)
    if args.prompt_ids is not None:
        try:
            return [("--prompt-ids", {"prompt_ids": [int(t) for t in args.prompt_ids.split(",") if t.strip()]})]
        except ValueError:
            raise ValueError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from None
    return [("--prompt", {"prompt": args.prompt})]


def _request(args: argparse.Namespace, tokenizer, sampling, where: str, record: dict):
    """The ``Request`` of one prompt record, its overrides applied; errors name ``where``."""
    from dspark.engine import Request, encode_bad_words, encode_prompts

    if "prompt" in record and tokenizer is None:
        raise ValueError(f"{where}: a text prompt needs the target's tokenizer, but {args.target_name} has none; "
                         f"give token ids instead (--prompt-ids, or prompt_ids in a .jsonl file)")
    ids = _named(where, encode_prompts, record["prompt"], tokenizer, name=where)[0][0] if "prompt" in record else \
        record["prompt_ids"]
    overrides = {k: record[k] for k in ("temperature", "top_k", "top_p", "min_p", "logit_bias", "presence_penalty",
                                        "frequency_penalty", "repetition_penalty", "min_tokens", "seed") if k in record}
    if "bad_words" in record:
        overrides["bad_words"] = _named(where, encode_bad_words, record["bad_words"], tokenizer, name=where)
    return _named(where, lambda: Request(ids, record.get("max_new_tokens", args.max_new_tokens),
                                         replace(sampling, **overrides), ignore_eos=args.ignore_eos))


def _named(where: str, function, *args, **kwargs):
    """``function(*args, **kwargs)``, its ValueError / TypeError prefixed with ``where`` (a file and line)."""
    try:
        return function(*args, **kwargs)
    except (ValueError, TypeError) as exc:
        message = str(exc)
        raise type(exc)(message if message.startswith(where) else f"{where}: {message}") from None


def _timed_runs(engine, requests, tokenizer, stop, runs: int | None) -> list[TimedRun]:
    """``--compare``: one untimed plain run (the printed speculative run warmed that side up: the
    process's one-off costs -- kernels, graphs, caches -- would otherwise land on the first side
    timed), then ``runs`` timed runs of each side, alternating, so that a load that comes and goes
    on the machine lands on both."""
    from dspark.engine import generate_texts

    for request in requests:
        _baseline(engine, request, tokenizer, stop)
    return [TimedRun(generate_texts(engine, requests, tokenizer, stop=stop or ()),
                     [_baseline(engine, request, tokenizer, stop) for request in requests])
            for _ in range(COMPARE_RUNS if runs is None else runs)]


def _median_run(runs: list[TimedRun]) -> TimedRun:
    """The run of the median speedup of all requests together (the lower middle one of an even
    count; runs without a speedup -- no drafting round -- last)."""
    ranked = sorted(runs, key=lambda r: (r.speedup() is None, r.speedup() or 0.0))
    measured = sum(r.speedup() is not None for r in runs)
    return ranked[(max(measured, 1) - 1) // 2]


def _speedups(runs: list[TimedRun], index: int | None = None) -> dict:
    """The median speedup over ``runs`` (of request ``index``, or of all requests), its range and
    how many runs it is over; speedup None without a measured one."""
    values = [v for v in (r.speedup(index) for r in runs) if v is not None]
    if not values:
        return {"speedup": None, "compare_runs": len(runs)}
    return {"speedup": _rounded(statistics.median(values)), "speedup_range": [_rounded(min(values)),
            _rounded(max(values))], "compare_runs": len(runs)}


def _baseline(engine, request, tokenizer, stop):
    """Plain target decoding of ``request`` on ``engine``'s target under the same stopping rules
    (stop strings included)."""
    from dspark.engine import TextStream

    text = None
    if tokenizer is not None and stop:
        text = TextStream(tokenizer, request.prompt_ids, stop, request.sampling.min_tokens, request.stop_ids)
    stream = None if text is None else (lambda _i, tokens: text.add(tokens))
    result = engine.plain().generate_requests([request], on_tokens=stream)[0]
    if text is not None:
        text.finish(result)
    return result


def _report(index: int, request, result, runs: list[TimedRun]) -> dict:
    """Request ``index``'s JSON object; with ``--compare`` the statistics of the median run (of
    all requests' speedup), the request's own median speedup over the runs and its range."""
    report = {"prompt_ids": list(request.prompt_ids), "generated_ids": result.token_ids, "text": result.text,
              "finish_reason": result.finish_reason, "stats": result.stats.as_dict()}
    if runs:
        median = _median_run(runs)
        baseline = median.plain[index]
        report["stats"] = median.speculative[index].stats.as_dict()
        report["baseline"] = {"generated_ids": baseline.token_ids, "finish_reason": baseline.finish_reason,
                              "stats": baseline.stats.as_dict()}
        report.update(_speedups(runs, index))
        if request.sampling.greedy:
            report["identical"] = all(r.identical(index) and r.speculative[index].token_ids == result.token_ids
                                      for r in runs)
    return report


def _summary(results, runs: list[TimedRun], greedy: list[bool]) -> dict:
    """The statistics of all requests together; with ``--compare`` those of the median run and the
    speedup over plain decoding (``_speedups``)."""
    from dspark.evaluation import merge_stats

    summary = {"requests": len(results), "stats": merge_stats([r.stats for r in results]).as_dict()}
    if runs:
        median = _median_run(runs)
        summary.update(stats=merge_stats([r.stats for r in median.speculative]).as_dict(),
                       baseline={"stats": merge_stats([r.stats for r in median.plain]).as_dict()}, **_speedups(runs))
        if all(greedy):
            summary["identical"] = all(r.identical(i) and r.speculative[i].token_ids == results[i].token_ids
                                       for r in runs for i in range(len(results)))
    return summary


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _interrupted(results) -> int:
    """Ctrl-C: the statistics of what was generated, on stderr; exit status 130."""
    print(f"\ndspark generate: interrupted; statistics so far ({len(results)} request(s)):", file=sys.stderr)
    _print_summary(_summary(results, None, []), file=sys.stderr)
    return 130


class _Printer:
    """Prints the prompt, then streams the continuation: text as it becomes final, or the ids
    (the prompt's in brackets) when there is no tokenizer."""

    def __init__(self, tokenizer, prompt_ids):
        if tokenizer is None:
            print(f"[{' '.join(map(str, prompt_ids))}]", end=" ", flush=True)
            return
        prompt = tokenizer.decode(list(prompt_ids), skip_special_tokens=True)
        dim = sys.stdout.isatty()  # the prompt dimmed on a terminal, so the continuation stands out
        print(f"\x1b[2m{prompt}\x1b[0m" if dim else prompt, end="", flush=True)

    def text(self, _index: int, text: str) -> None:
        print(text, end="", flush=True)

    def ids(self, _index: int, tokens: list[int]) -> None:
        print(" ".join(map(str, tokens)), end=" ", flush=True)


def _print_result(index: int, tokenizer, request, result) -> None:
    print(f"--- request {index}: {len(result.token_ids)} tokens, finish reason {result.finish_reason}")
    if tokenizer is None:
        print(f"[{' '.join(map(str, request.prompt_ids))}] {' '.join(map(str, result.token_ids))}")
    else:
        print(tokenizer.decode(list(request.prompt_ids), skip_special_tokens=True) + result.text)


def _print_summary(summary: dict, file=None) -> None:
    file = sys.stdout if file is None else file
    stats = summary["stats"]
    if stats["rounds"]:
        per_position = " ".join("-" if a is None else f"{a:.2f}" for a in stats["acceptance_per_position"])
        print(f"generated {stats['generated_tokens']} tokens in {stats['rounds']} rounds, "
              f"tau = {stats['mean_accepted_length']:.2f} tokens per round (accepted drafts + 1 bonus token), "
              f"mean verified drafts {stats['mean_scheduled_length']:.2f}", file=file)
        print(f"acceptance per position: {per_position}", file=file)
    else:
        print(f"generated {stats['generated_tokens']} tokens, all from the prefill: no drafting round, "
              f"so no tau or acceptance", file=file)
    parts = "" if stats["draft_time_s"] is None else \
        f"draft {stats['draft_time_s']:.3f} s, verify {stats['verify_time_s']:.3f} s, "  # batched: one step for both
    print(f"time: prefill {stats['prefill_time_s']:.3f} s, {parts}total {stats['total_time_s']:.3f} s, "
          f"{stats['tokens_per_second']:.1f} tokens/s", file=file)
    if "baseline" in summary:
        base = summary["baseline"]["stats"]
        ratio = "-" if summary["speedup"] is None else f"{summary['speedup']:.2f}x"
        if summary["speedup"] is not None:
            low, high = summary["speedup_range"]
            ratio += f" (median of {summary['compare_runs']}; range {low:.2f}-{high:.2f})"
        line = f"plain target decoding: {base['tokens_per_second']:.1f} tokens/s, speedup {ratio}, ratio of tokens/s"
        if "identical" in summary:
            line += ", outputs identical" if summary["identical"] else ", OUTPUTS DIFFER"
        print(line, file=file)
