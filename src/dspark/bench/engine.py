"""End-to-end engine benchmark on a GPU: ``python -m dspark.bench.engine --out DIR``.

Random-weight Qwen3-shaped targets (bf16), prompts of ``--prompt`` tokens, ``--new`` new tokens per
request, batch sizes ``--batches``. Per shape and batch size, side by side:

* the weight-read floor (parameter bytes / measured copy ceiling);
* Hugging Face eager + ``DynamicCache`` and Hugging Face ``StaticCache`` + ``torch.compile(mode=
  "reduce-overhead")``: one decode step (median ms of the steps, CUDA-synchronised);
* dspark's runner, plain decoding (``LLMEngine`` without a draft, CUDA graphs);
* DSpark on the same runner with a random DSpark drafter (block 7, Markov rank 256) whose drafts are
  replaced by the target's own greedy continuation (``bench.oracle.OracleEngine``, acceptance 1:
  tau = P + 1) or kept per position with probability ``--acceptance`` (else a token the target
  rejects);
* at B = 1 and the largest B, a per-round breakdown: each piece of the round captured alone in a CUDA
  graph (draft context + block forward, Markov chain, confidence + schedule, target verify forward,
  accept) and the host's share of the step.

Writes ``engine.json``, ``engine.md`` (tables) and ``engine.png`` (tok/s against batch size).

``--backends fused,hf`` runs instead the target backends side by side (``run_backends``): one random
model per shape, wrapped as ``TargetLM`` (fused) and as ``HFTarget`` (transformers' own modeling
code) on the same weights, each through ``LLMEngine`` with CUDA graphs: the median step of plain
decoding and of DSpark rounds (a random drafter, every row verifying its whole block) per batch
size, into ``backends.json``. ``--device cpu --shapes tiny`` runs the same on the CPU (fp32).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from .. import kernels as K
from .common import median_us, measure_copy_ceiling_gbps

SHAPES = {  # Qwen3 model shapes (config.json of the public models)
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, capture=[1, 13, 25]),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=False, capture=[1, 9, 17, 25, 33]),
    # Llama-3-70B's dimensions as a Qwen3 config (per-head q/k norms besides): ~141 GB of bf16 weights, more
    # than one H200 holds -- the tensor-parallel benchmark's (bench.tensor_parallel)
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, head_dim=128, tie_word_embeddings=False, capture=[1, 20, 40, 60, 78]),
}
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, tie_word_embeddings=False, capture=[0, 1], vocab=1024)  # --backends on the CPU: the plumbing
BACKENDS = ("fused", "hf")  # TargetLM, HFTarget
VOCAB = 151936


def qwen3_config(shape: dict, vocab: int = VOCAB):
    """The ``Qwen3Config`` of a benchmark shape (``SHAPES``)."""
    from transformers import Qwen3Config

    settings = {k: v for k, v in shape.items() if k not in ("capture", "vocab")}
    return Qwen3Config(vocab_size=vocab, max_position_embeddings=40960, rms_norm_eps=1e-6,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                       bos_token_id=None, eos_token_id=None, pad_token_id=None, **settings)


def random_target(shape: dict, seed: int = 0, *, vocab: int = VOCAB, device="cuda", dtype=torch.bfloat16):
    """A random-weight Qwen3ForCausalLM (std 0.02, as HF initialises; bf16 on the GPU by default)."""
    from transformers import Qwen3ForCausalLM

    config = qwen3_config(shape, vocab)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(dtype)
    return model.eval().requires_grad_(False)


def random_drafter(target, shape: dict, layers: int = 1, rank: int = 256, block: int = 7):
    """A random DSpark drafter for ``target`` (its device and dtype): the real draft's cost,
    meaningless drafts."""
    return drafter_for(target.config, target.get_input_embeddings().weight, target.get_output_embeddings().weight,
                       shape, layers, rank, block)


@torch.no_grad()
def drafter_for(t, embed: torch.Tensor, head: torch.Tensor, shape: dict, layers: int = 1, rank: int = 256,
                block: int = 7):
    """``random_drafter`` of a target of config ``t`` whose embedding and head are ``embed`` / ``head``
    ``[V, H]`` (the drafter's device and dtype)."""
    from ..model import DSparkConfig, DSparkDraftModel

    vocab, dtype, device = t.vocab_size, embed.dtype, embed.device
    config = DSparkConfig(
        hidden_size=t.hidden_size, num_hidden_layers=layers, num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads, head_dim=t.head_dim, intermediate_size=t.intermediate_size,
        vocab_size=vocab, capture_layer_ids=shape["capture"], num_target_layers=t.num_hidden_layers,
        mask_token_id=vocab - 1, block_size=block, sample_from_anchor=True, markov_rank=rank,
        markov_head_type="vanilla", enable_confidence_head=True, confidence_head_with_markov=True,
        layer_types=["full_attention"] * layers, rms_norm_eps=1e-6, rope_theta=1000000.0,
        dtype=str(dtype).replace("torch.", ""))
    with torch.device(device):
        model = DSparkDraftModel(config).to(dtype)
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.02)
        model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.copy_(head)
    return model.eval().requires_grad_(False)


# ------------------------------------------------------------------------------ Hugging Face baselines


def hf_step_ms(model, batch: int, prompt: int, steps: int, *, compiled: bool, fullgraph: bool = True) -> float:
    """Median ms of one decode step of ``batch`` rows after a ``prompt``-token prefill, on the model's
    device (synchronised after each step on CUDA). ``compiled``: transformers' ``generate`` recipe,
    ``StaticCache`` + ``torch.compile(mode="reduce-overhead")`` of the forward (``fullgraph`` as
    given); else eager with a ``DynamicCache``."""
    from transformers import DynamicCache, StaticCache

    device = model.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    ids = torch.randint(0, model.config.vocab_size - 1, (batch, prompt), device=device)
    with torch.inference_mode():
        if compiled:
            cache = StaticCache(config=model.config, max_cache_len=prompt + steps + 8)
            forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=fullgraph)
        else:
            cache, forward = DynamicCache(config=model.config), model.forward
        out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1,  # not [B, prompt, V] logits
                    position_ids=torch.arange(prompt, device=device).expand(batch, prompt))
        token = out.logits[:, -1:].argmax(-1)
        times = []
        for i in range(steps):
            position = torch.full((batch, 1), prompt + i, device=device)
            sync()
            start = time.perf_counter()
            out = forward(input_ids=token, cache=cache, use_cache=True, position_ids=position)
            token = out.logits[:, -1:].argmax(-1)
            sync()
            times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[steps // 2:])  # the first steps compile / warm up


def weight_floor(model, ceiling_gbps: float) -> tuple[int, float]:
    """``model``'s parameter bytes and the ms one step takes to read them all once at the measured
    copy ceiling (``measure_copy_ceiling_gbps``): no decode step of one weight pass beats it."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return params, round(params / (ceiling_gbps * 1e9) * 1e3, 3)


# ------------------------------------------------------------------------------ dspark's engine


def steady_config(max_batch: int, prompt: int, new: int, draft=None) -> "EngineConfig":
    """The ``EngineConfig`` of a benchmark engine: room for ``prompt + new`` tokens per request and a
    step budget (``max_num_batched_tokens``) that admits ``MAX_CHUNKS`` whole prompts per step
    beside every running row's verify, so that B requests are all running after ceil(B / 8) steps.
    With the engine's default budget (2048 tokens) 64 prompts of 512 tokens take ~19 steps to admit
    while the first rows, 8 tokens a round at acceptance 1, finish 256 new tokens in 32: ~13 steady
    steps, and none with fewer new tokens or longer prompts (``engine_run`` then has nothing to time).
    Prefix caching off: the timed run repeats the warm-up's prompts, which would all be cached. KV
    blocks for ``max_batch`` whole requests (``gpu_memory_utilization`` None): the benchmark's
    engines live side by side in one process."""
    from ..engine import EngineConfig
    from ..engine.config import DEFAULT_BATCHED_TOKENS
    from ..engine.chunks import MAX_CHUNKS

    verify_len = 1 if draft is None else draft.config.num_draft_tokens + 1
    budget = max(DEFAULT_BATCHED_TOKENS, MAX_CHUNKS * prompt + max_batch * verify_len)
    return EngineConfig(max_batch=max_batch, max_model_len=prompt + new + 16, max_num_batched_tokens=budget,
                        enable_prefix_caching=False, gpu_memory_utilization=None)


def engine_run(engine, prompts, new_tokens: int, oracle=None, sampling=None) -> dict:
    """Generate once (warm-up: graphs, kernels), then again timed per step; returns the steady-state
    step time (steps with every request running and no prompt chunk), tokens per step, how many
    steps were steady and the outputs. ``sampling``: every request's ``SamplingParams`` (default:
    greedy, unconstrained; a constrained request also ends where its output is complete).
    ValueError when no step was steady (a request finished before the last was admitted:
    ``steady_config``), RuntimeError when the engine failed a request."""
    from ..engine import Request, SamplingParams

    def add_all() -> list[int]:  # with an OracleEngine, each request's known continuation too
        requests = [Request(p, new_tokens, sampling or SamplingParams(), stop_ids=[], ignore_eos=True)
                    for p in prompts]
        return [engine.add_request(r) if oracle is None else engine.add_request(r, oracle[i])
                for i, r in enumerate(requests)]

    warm_up = add_all()
    while engine.has_unfinished():
        engine.step()
    for i in warm_up:
        engine.sequences.pop(i, None)
    ids = add_all()
    outputs = {i: [] for i in ids}
    step_times, step_tokens, steps = [], [], 0
    while engine.has_unfinished():
        steady = not (engine.scheduler.waiting or engine.scheduler.prefilling) and len(engine.scheduler.running) == len(prompts)
        start = time.perf_counter()
        outs = engine.step()  # ends with the round's host synchronisation
        elapsed = time.perf_counter() - start
        steps += 1
        for o in outs:
            if o.finish_reason == "error":
                raise RuntimeError(f"engine_run: the engine failed request {o.request_id}: {o.error}")
            outputs[o.request_id] += o.new_token_ids
        if steady:  # every row, no prompt chunk (the step that ends the requests included)
            step_times.append(elapsed)
            step_tokens.append(sum(len(o.new_token_ids) for o in outs))
    for i in ids:
        engine.sequences.pop(i, None)
    if not step_times:
        raise ValueError(f"engine_run: no step ran all {len(prompts)} requests without prompt chunks ({steps} steps, "
                         f"{new_tokens} new tokens each): a request finished before the last prompt was admitted; "
                         f"give more new tokens or a larger max_num_batched_tokens (steady_config)")
    ms = 1000 * statistics.median(step_times)
    tokens = sum(step_tokens) / len(step_tokens)
    return dict(step_ms=round(ms, 3), tokens_per_step=round(tokens, 3), tok_per_s=round(1000 * tokens / ms, 1),
                steady_steps=len(step_times), outputs=[outputs[i] for i in ids])


def breakdown(engine, prompts, oracle) -> dict:
    """Device time of each piece of one DSpark round, each captured alone in a CUDA graph."""
    from ..engine import Request
    from ..engine.rows import LogitsPath

    runner = engine.runner
    for i, p in enumerate(prompts):
        engine.add_request(Request(p, 64, stop_ids=[], ignore_eos=True), oracle[i])
    engine.step()  # prefill + first round: rows hold a real state
    while engine.scheduler.waiting or engine.scheduler.prefilling:  # prompts run in chunks: admit every request
        engine.step()
    rows = len(engine.scheduler.running)
    b, s, t = runner.bucket(rows), runner.state, runner.verify_len
    drafter, draft = runner.drafter, runner.proposer.draft
    restore = runner._snapshot()
    hidden = draft.block(s.anchor[:b], s.anchor_pos[:b], s.slot_ids[:b])
    logits = drafter.model.backbone_logits(hidden)
    positions = (s.ctx_pos[:b, None] + runner.offsets[:t]).view(-1)

    def draft_forward():
        draft.context(s.capture[:b].reshape(b * t, -1), positions, s.slot_ids[:b].repeat_interleave(t))
        drafter.model.backbone_logits(draft.block(s.anchor[:b], s.anchor_pos[:b], s.slot_ids[:b]))

    def markov():
        return K.markov_greedy_round(logits, drafter.markov_w1, drafter.markov_w2, s.anchor[:b],
                                     proposal_len=drafter.num_draft_tokens, logits_stride=drafter.block_size,
                                     logits_offset=drafter.slot_offset)

    tokens = markov()
    verify_logits = torch.zeros(b * t, VOCAB, device="cuda")
    parts = {
        "draft forward": draft_forward,
        "markov": markov,
        "confidence + schedule": lambda: drafter._schedule(hidden, s.anchor[:b], tokens),
        "verify (target forward + accept + advance)": lambda: runner._verify_rows(b, b * t, LogitsPath.GREEDY),
        "accept alone": lambda: K.greedy_accept(verify_logits, s.draft_tokens[:b], s.proposal_lengths[:b], t - 1),
    }
    result = {}
    for name, fn in parts.items():
        graph = torch.cuda.CUDAGraph()
        fn()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, pool=runner.pool):
            fn()
        result[name] = round(median_us(graph.replay, warmup=3, reps=20) / 1000, 4)
        restore()
    for rid in list(engine.sequences):
        engine.abort(rid)
    return result


def run_shape(name: str, args, ceiling_gbps: float) -> dict:
    from ..engine import LLMEngine
    from .oracle import OracleEngine

    shape = SHAPES[name]
    target = random_target(shape)
    params, floor_ms = weight_floor(target, ceiling_gbps)
    report = dict(shape=name, parameter_bytes=params, floor_ms=floor_ms, rows=[])
    max_b = max(args.batches)
    for b in args.batches:
        row = dict(batch=b)
        if "eager" in args.hf:
            row["hf_eager_ms"] = round(hf_step_ms(target, b, args.prompt, 24, compiled=False), 3)
        if "compiled" in args.hf and b in args.hf_compiled_batches:
            torch._dynamo.reset()
            row["hf_compiled_ms"] = round(hf_step_ms(target, b, args.prompt, 48, compiled=True), 3)
        report["rows"].append(row)
        print(name, row, flush=True)
    drafter = random_drafter(target, shape)
    plain = LLMEngine(target, None, steady_config(max_b, args.prompt, args.new))
    report["kv_bytes_per_token"] = plain.target.kv_bytes_per_token
    config = steady_config(max_b, args.prompt, args.new, drafter)
    engines = {a: OracleEngine(target, drafter, config, acceptance=a) for a in (1.0, args.acceptance)}
    # what fits beside the weights of one target and one drafter (this benchmark holds the HF copy too),
    # keeping 10 % of the device for activations, logits and graphs
    _, total = torch.cuda.mem_get_info()
    draft_bytes = sum(p.numel() * p.element_size() for p in drafter.parameters())
    per_token = plain.target.kv_bytes_per_token + 2 * 2 * drafter.config.num_hidden_layers * \
        drafter.config.num_key_value_heads * drafter.config.head_dim
    room = int(0.9 * total) - params - draft_bytes
    report["kv_fit"] = dict(free_bytes_after_models=room, target_plus_draft_kv_bytes_per_token=per_token,
                            tokens_that_fit=room // per_token)
    for row in report["rows"]:
        b = row["batch"]
        prompts = [torch.randint(0, VOCAB - 1, (args.prompt,)).tolist() for _ in range(b)]
        base = engine_run(plain, prompts, args.new)
        plain_outputs = base.pop("outputs")
        row["dspark_plain"] = base
        # The oracle is the DSpark runner's own greedy continuation: in bf16 a verify over 8 tokens
        # and a one-token step round differently, so plain decoding's tokens can part from it at a
        # near-tie (greedy equality is proven in fp32 by the tests).
        first = engine_run(engines[1.0], prompts, args.new, [o + [0] * 16 for o in plain_outputs])["outputs"]
        oracle = [o + [0] * 16 for o in first]
        for a, engine in engines.items():
            res = engine_run(engine, prompts, args.new, oracle)
            outs = res.pop("outputs")
            res["self_consistent"] = all(o == ref[: len(o)] for o, ref in zip(outs, oracle))
            res["identical_to_plain_bf16"] = sum(o == p for o, p in zip(outs, plain_outputs))
            res["speedup_vs_plain"] = round(res["tok_per_s"] / base["tok_per_s"], 3)
            row[f"dspark_a{a:g}"] = res
        print(name, row, flush=True)
        if b in (1, max_b):
            row["breakdown_ms"] = breakdown(engines[1.0], prompts, oracle)
            print(name, b, row["breakdown_ms"], flush=True)
    del plain, engines, target, drafter
    torch.cuda.empty_cache()
    return report


def backend_target(backend: str, model):
    """``model`` (a Qwen3ForCausalLM) as the engine's target: ``TargetLM`` (fused) or ``HFTarget``
    (its transformers modeling code), sharing its weights."""
    from ..model.hf_target import HFTarget
    from ..model.llama import TargetLM

    return TargetLM.from_hf_model(model) if backend == "fused" else HFTarget(model)


def run_backends(name: str, args) -> dict:
    """The step times of each backend of ``args.backends`` on one random ``name``-shaped model
    (bf16 on CUDA, f32 on the CPU), through ``LLMEngine`` (CUDA graphs on a GPU): plain decoding steps and
    DSpark rounds (a random drafter, scheduler off: every row verifies its whole block, the drafts
    rejected) for each batch size on the same prompts; each backend's tokens compared with the
    first backend's."""
    from ..engine import LLMEngine

    shape, device = {**SHAPES, "tiny": TINY}[name], torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    vocab = shape.get("vocab", VOCAB)
    model = random_target(shape, vocab=vocab, device=device, dtype=dtype)
    drafter = random_drafter(model, shape)
    generator = torch.Generator().manual_seed(0)
    prompts = {b: [torch.randint(0, vocab - 1, (args.prompt,), generator=generator).tolist() for _ in range(b)]
               for b in args.batches}
    rows, first = [], {}
    for backend in args.backends:
        target = backend_target(backend, model)
        for mode, draft in (("plain", None), ("dspark", drafter)):
            engine = LLMEngine(target, draft, steady_config(max(args.batches), args.prompt, args.new, draft))
            for b in args.batches:
                result = engine_run(engine, prompts[b], args.new)
                outputs = result.pop("outputs")
                reference = first.setdefault((mode, b), outputs)
                rows.append(dict(backend=backend, mode=mode, batch=b, **result,
                                 same_tokens_as_first=sum(o == r for o, r in zip(outputs, reference)),
                                 cuda_graphs=engine.runner.use_graphs,
                                 uncapturable=sorted(str(k) for k in engine.runner.uncapturable)))
                print(name, rows[-1], flush=True)
            del engine  # its caches before the next engine's
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return dict(shape=name, dtype=str(dtype).replace("torch.", ""), rows=rows)


def backends_markdown(report: dict) -> str:
    """One table per shape of ``run_backends``' rows: step ms of each backend per mode and batch
    size, and each backend's ratio to the first."""
    lines = []
    for shape in report["shapes"]:
        backends = list(dict.fromkeys(r["backend"] for r in shape["rows"]))
        ms = {(r["backend"], r["mode"], r["batch"]): r["step_ms"] for r in shape["rows"]}
        ratios = [f"{b} / {backends[0]}" for b in backends[1:]]
        lines += [f"### {shape['shape']} ({shape['dtype']}, {report['device']}): ms per engine step", "",
                  "| mode | B | " + " | ".join(backends + ratios) + " |", "|---" * (2 + len(backends + ratios)) + "|"]
        for mode, batch in dict.fromkeys((r["mode"], r["batch"]) for r in shape["rows"]):
            times = [ms[(b, mode, batch)] for b in backends]
            lines.append(f"| {mode} | {batch} | " + " | ".join(map(str, times)) + " | "
                         + " | ".join(f"{t / times[0]:.2f}" for t in times[1:]) + " |")
        lines.append("")
    return "\n".join(lines)


def backends_report(args, shapes: list[str], out: Path, command: str) -> None:
    """``run_backends`` for each shape into ``out / "backends.json"`` (rewritten after each shape),
    then the tables on stdout."""
    import transformers

    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    report = dict(device=device, torch=torch.__version__, transformers=transformers.__version__, prompt=args.prompt,
                  new=args.new, command=command, shapes=[])
    for name in shapes:
        report["shapes"].append(run_backends(name, args))
        (out / "backends.json").write_text(json.dumps(report, indent=1))
    print(backends_markdown(report))


def markdown(report: dict) -> str:
    lines = [f"Device: {report['device']}, copy ceiling {report['copy_ceiling_gbps']:.0f} GB/s; prompt "
             f"{report['prompt']}, {report['new']} new tokens, bf16, random weights.", ""]
    for shape in report["shapes"]:
        lines += [f"### {shape['shape']} (weight-read floor {shape['floor_ms']} ms/step, KV "
                  f"{shape['kv_bytes_per_token']} bytes/token)", "",
                  "| B | HF eager ms/step | HF compiled ms/step | dspark plain ms/step | plain tok/s | "
                  "DSpark a=1 round ms | τ | tok/s | × plain | DSpark a=" + f"{report['acceptance']:g}" +
                  " round ms | τ | tok/s | × plain | same as plain (bf16) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in shape["rows"]:
            full, part = r["dspark_a1"], r[f"dspark_a{report['acceptance']:g}"]
            lines.append(f"| {r['batch']} | {r.get('hf_eager_ms', '–')} | {r.get('hf_compiled_ms', '–')} | "
                         f"{r['dspark_plain']['step_ms']} | {r['dspark_plain']['tok_per_s']} | {full['step_ms']} | "
                         f"{full['tokens_per_step'] / r['batch']:.2f} | {full['tok_per_s']} | {full['speedup_vs_plain']} | "
                         f"{part['step_ms']} | {part['tokens_per_step'] / r['batch']:.2f} | {part['tok_per_s']} | "
                         f"{part['speedup_vs_plain']} | {full['identical_to_plain_bf16']}/{r['batch']} |")
        fit = shape["kv_fit"]
        lines += ["", f"KV cache: target {shape['kv_bytes_per_token']} + draft bytes per token = "
                  f"{fit['target_plus_draft_kv_bytes_per_token']}; the {fit['free_bytes_after_models'] / 2**30:.1f} GiB left "
                  f"beside the weights (90 % of the device) hold {fit['tokens_that_fit']} tokens (batch x context), e.g. "
                  f"{fit['tokens_that_fit'] // 4096} requests of 4096 tokens.", ""]
        for r in shape["rows"]:
            if "breakdown_ms" in r:
                parts = r["breakdown_ms"]
                device = sum(v for k, v in parts.items() if k != "accept alone")
                text = ", ".join(f"{k} {v}" for k, v in parts.items())
                lines.append(f"- B = {r['batch']} round breakdown (ms, each piece graphed alone): {text}; whole "
                             f"step {r['dspark_a1']['step_ms']}, of which host and sync "
                             f"{r['dspark_a1']['step_ms'] - device:.3f}")
        lines.append("")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(report["shapes"]), figsize=(6 * len(report["shapes"]), 4.5), squeeze=False)
    for ax, shape in zip(axes[0], report["shapes"]):
        rows = shape["rows"]
        batches = [r["batch"] for r in rows]
        series = {"dspark plain": [r["dspark_plain"]["tok_per_s"] for r in rows],
                  "DSpark τ=P+1": [r["dspark_a1"]["tok_per_s"] for r in rows],
                  f"DSpark a={report['acceptance']:g}": [r[f"dspark_a{report['acceptance']:g}"]["tok_per_s"] for r in rows]}
        for key, label in (("hf_eager_ms", "HF eager"), ("hf_compiled_ms", "HF compiled")):
            pts = [(r["batch"], 1000 * r["batch"] / r[key]) for r in rows if key in r]
            if pts:
                ax.plot(*zip(*pts), "--o", label=label)
        for label, values in series.items():
            ax.plot(batches, values, "-o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size")
        ax.set_ylabel("tokens / s")
        ax.set_title(f"{shape['shape']} (H200, bf16)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dspark.bench.engine", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", default="engine-bench",
                        help="directory for engine.json / .md / .png (backends.json with --backends)")
    parser.add_argument("--shapes", default="qwen3-0.6b,qwen3-8b",
                        help="comma-separated: " + ", ".join(SHAPES) + " (and tiny with --backends)")
    parser.add_argument("--batches", default="1,8,32,64", help="comma-separated batch sizes")
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens per request")
    parser.add_argument("--new", type=int, default=256, help="new tokens per request")
    parser.add_argument("--acceptance", type=float, default=0.8, help="per-position acceptance of the controlled drafter")
    parser.add_argument("--hf", default="eager,compiled", help="Hugging Face baselines to run (eager, compiled, none)")
    parser.add_argument("--hf-compiled-batches", default="1,8,32,64", help="batch sizes of the compiled baseline")
    parser.add_argument("--backends", default=None,
                        help="comma-separated target backends (fused: TargetLM, hf: HFTarget) to time side by side "
                             "instead of the full benchmark; writes backends.json")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu with --backends (e.g. --shapes tiny)")
    args = parser.parse_args(argv)
    shapes = args.shapes.split(",")
    if any(name not in SHAPES and (name != "tiny" or args.backends is None) for name in shapes):
        parser.error(f"--shapes takes {', '.join(SHAPES)} (and tiny with --backends), got {args.shapes!r}")
    if args.backends is not None:
        args.backends = args.backends.split(",")
        if not args.backends or any(b not in BACKENDS for b in args.backends):
            parser.error(f"--backends takes a comma-separated subset of {', '.join(BACKENDS)}, got {args.backends!r}")
    if args.device not in ("cuda", "cpu") or args.device == "cpu" and args.backends is None:
        parser.error(f"--device must be cuda, or cpu with --backends, got {args.device!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("python -m dspark.bench.engine: needs a CUDA device (--device cpu with --backends runs on the CPU)",
              file=sys.stderr)
        return 2
    args.batches = [int(b) for b in args.batches.split(",")]
    args.hf_compiled_batches = [int(b) for b in args.hf_compiled_batches.split(",")]
    args.hf = args.hf.split(",")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python -m dspark.bench.engine " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.backends is not None:
        backends_report(args, shapes, out, command)
        return 0
    ceiling = measure_copy_ceiling_gbps()
    report = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, copy_ceiling_gbps=round(ceiling, 1),
                  prompt=args.prompt, new=args.new, acceptance=args.acceptance, command=command, shapes=[])
    for name in shapes:
        report["shapes"].append(run_shape(name, args, ceiling))
        (out / "engine.json").write_text(json.dumps(report, indent=1))
    (out / "engine.md").write_text(markdown(report))
    plot(report, out / "engine.png")
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
