"""Where a full batch's round goes, offline (no server): the frontier benchmark's engines at B = 64.

    python scripts/profile_replay_rounds.py COST_TABLE.json off cost plain

Builds ``bench.replay``'s 8B-shaped peaked target (plain) or the replay engine (``off``: every draft
verified; ``cost``: Algorithm 1 with COST_TABLE), captures its graphs, decodes the benchmark's 64
prompts twice (256 new tokens each) and reports, over the steps with all 64 rows running: the step's
wall time, the round's wall time and GPU time (CUDA events around launch + readout), the host time
outside the round, tokens per step, verify tokens per round and tokens/s. Lines also go to
$OUT/prof14.txt.
"""
import builtins
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
spec = {"shape": "qwen3-8b", "vocab": 151936, "device": "cuda", "dtype": "bfloat16", "draft_rank": 256,
        "num_prompts": 64, "prompt_tokens": 128, "max_tokens": 256}
os.environ["DSPARK_REPLAY"] = json.dumps(spec)
from dspark.bench.replay import plain_engine, replay_engine  # noqa: E402
from dspark.bench.serve import random_prompts  # noqa: E402
from dspark.engine import EngineConfig, Request  # noqa: E402

_log = open(os.path.join(os.environ.get("OUT", "."), "prof14.txt"), "a")


def report(*args):
    builtins.print(*args, flush=True)
    builtins.print(*args, file=_log, flush=True)


def timed(runner, log):
    """Wrap the runner's launches so that each round's wall and GPU time (to its readout) is logged."""
    launch_round, launch_decode, read = runner.launch_round, runner.launch_decode, runner.read
    marks = {}

    def start(fn):
        def wrapper(rows, *a, **k):
            marks["t"], marks["s"] = time.perf_counter(), torch.cuda.Event(enable_timing=True)
            marks["s"].record()
            if a:
                log["vtok"].append(sum(a[0]))
            return fn(rows, *a, **k)
        return wrapper

    def finish(rows):
        out = read(rows)
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        torch.cuda.synchronize()
        log["round"].append(time.perf_counter() - marks["t"])
        log["gpu"].append(marks["s"].elapsed_time(end) / 1000)
        return out

    runner.launch_round, runner.launch_decode, runner.read = start(launch_round), start(launch_decode), finish


def main():
    cost_table, modes = sys.argv[1], sys.argv[2:]
    prompts = random_prompts(spec["num_prompts"], spec["prompt_tokens"], spec["vocab"])
    for mode in modes:
        config = EngineConfig(max_batch=64, max_model_len=448, scheduler="cost" if mode == "cost" else "off",
                              cost_table=cost_table if mode == "cost" else None)
        engine = plain_engine(config) if mode == "plain" else replay_engine(config)
        engine.capture_graphs()
        log = {"step": [], "round": [], "gpu": [], "tokens": [], "vtok": []}
        timed(engine.runner, log)
        for _ in range(2):  # the first pass warms up; both are measured alike
            ids = [engine.add_request(Request(p, spec["max_tokens"], ignore_eos=True)) for p in prompts]
            while engine.has_unfinished():
                steady = not engine.waiting and len(engine.running) == 64
                start = time.perf_counter()
                outs = engine.step()
                if steady:
                    log["step"].append(time.perf_counter() - start)
                    log["tokens"].append(sum(len(o.new_token_ids) for o in outs))
                else:  # keep the round logs aligned with the steps measured
                    for k in ("round", "gpu", "vtok"):
                        del log[k][len(log["step"]):]
            for i in ids:
                engine.sequences.pop(i, None)
        ms = {k: 1000 * statistics.median(log[k]) for k in ("step", "round", "gpu")}
        tokens = statistics.mean(log["tokens"])
        vtok = statistics.median(log["vtok"]) if log["vtok"] else None
        report(f"{mode} steady B=64: step {ms['step']:.2f} ms, round(wall) {ms['round']:.2f}, gpu {ms['gpu']:.2f}, "
               f"host outside round {ms['step'] - ms['round']:.2f}, tokens/step {tokens:.1f}, verify tokens {vtok}, "
               f"tok/s {1000 * tokens / ms['step']:.0f}")
        del engine
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
