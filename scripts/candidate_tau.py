"""tau of the demo pair, sampled, drafting over the vocabulary (C = 0) or over candidate sets (the
backbone's top-C + the previous token's M bigram successors), on the CPU: fp32 target, bf16 draft (so
that the vanilla-head kernels -- and candidate drafting -- run). Every configuration sees the same
prompts and seeds (paired), T = 1 and T = 0.7 / top-p 0.9.

usage: PYTHONPATH=src python scripts/candidate_tau.py NUM_PROMPTS NEW_TOKENS C/M,C/M,... OUT.json SEEDS [SETTINGS]
(SEEDS: comma-separated seed bases, request i of a batch taking seed i + base; SETTINGS: T1 and / or
T0.7-p0.9, comma-separated, default both)
"""
import json, sys, time
import torch
from transformers import AutoTokenizer
from dspark.engine import SamplingParams
from dspark.engine.llm_engine import EngineConfig, LLMEngine
from dspark.engine.request import Request
from dspark.model import load_draft
from dspark.training.data import demo_pair, prompt_token_ids, read_prompts

torch.set_num_threads(1)
num_prompts, new_tokens = int(sys.argv[1]), int(sys.argv[2])
configs = [tuple(int(x) for x in cm.split("/")) for cm in sys.argv[3].split(",")]
seed_bases = [int(x) for x in sys.argv[5].split(",")]
settings = {"T1": dict(temperature=1.0), "T0.7-p0.9": dict(temperature=0.7, top_p=0.9)}
settings = {name: settings[name] for name in (sys.argv[6].split(",") if len(sys.argv) > 6 else settings)}
pair = demo_pair()
tokenizer = AutoTokenizer.from_pretrained(str(pair.target))
draft = load_draft(str(pair.draft), dtype=torch.float32).to(torch.bfloat16)
prompts = [prompt_token_ids(tokenizer, r) for r in read_prompts(str(pair.prompts))[:num_prompts]]
results = {}
for name, s in settings.items():
    for c, m in configs:
        t0, accepted, rounds = time.time(), 0, 0
        engine = LLMEngine(str(pair.target), draft, EngineConfig(max_batch=len(prompts), draft_candidates=c,
                                                                 draft_successors=m, max_model_len=1024))
        for base in seed_bases:
            out = engine.generate([Request(p, new_tokens, SamplingParams(**s, seed=i + base), ignore_eos=True)
                                   for i, p in enumerate(prompts)])
            accepted += sum(sum(r.stats.accept_lengths) for r in out)
            rounds += sum(len(r.stats.accept_lengths) for r in out)
        results[f"{name} C={c} M={m}"] = dict(tau=accepted / rounds, rounds=rounds)
        print(f"{name:10s} C={c:4d} M={m:3d} tau={accepted / rounds:.3f} rounds={rounds} ({time.time() - t0:.0f}s)",
              flush=True)
json.dump(results, open(sys.argv[4], "w"), indent=1)
