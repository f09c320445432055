"""The merged Markov GEMM (``kernels/triton/markov.py``) against a former one, side by side on a GPU.

    git show 9ebe95e:src/dspark/kernels/triton/greedy.py > old_greedy.py
    OUT=DIR python scripts/compare_markov_kernels.py old_greedy.py

Per shape (B, R in (64, 256), (64, 64), (8, 256), fp16): registers, spills and shared memory of both
compiled kernels (their TTGIR and PTX into $OUT), the fused step (step 0 and a key-fed step) and the
CUDA-graph round, three times each, and at B = 64, R = 256 every candidate greedy configuration
(``bench.greedy._markov_configs``) for both kernels. Times: ``bench.common.graph_us`` medians.
"""
import importlib.util, os, sys, json
import torch, triton
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
import dspark.kernels as K
from dspark.kernels.triton import markov as new
from dspark.bench.common import compiled_kernel, graph_us
from dspark.bench import greedy as bg
spec = importlib.util.spec_from_file_location("old_greedy", sys.argv[1])
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
OUT = os.environ.get("OUT", "/tmp")
print("triton", triton.__version__, "torch", torch.__version__)

results = {}
for (batch, rank) in ((64, 256), (64, 64), (8, 256)):
    s = bg._Step(batch, rank, torch.float16)
    base = s.backbone[:, 0]
    calls = {
        "old step0": lambda: old._launch_markov(base, 7, s.w1, s.w2, None, s.first, False, keys_out=s.slots[:, 0]),
        "new step0": lambda: new.launch_markov(base, 7, s.w1, s.w2, None, s.first, keys_out=s.slots[:, 0]),
        "old key": lambda: old._launch_markov(base, 7, s.w1, s.w2, None, s.slots[:, 0], True, keys_out=s.slots[:, 1]),
        "new key": lambda: new.launch_markov(base, 7, s.w1, s.w2, None, s.slots[:, 0], True, keys_out=s.slots[:, 1]),
    }
    for name, fn in calls.items():
        kern = old._markov_kernel if name.startswith("old") else new._markov_kernel
        try:
            k = compiled_kernel(kern, fn)
            tag = f"B{batch}_R{rank}_{name.replace(' ', '_')}"
            print(tag, "regs", k.n_regs, "spills", k.n_spills, "shared", k.metadata.shared, "warps", k.metadata.num_warps, "stages", k.metadata.num_stages, flush=True)
            for ext in ("ttgir", "ptx"):
                open(f"{OUT}/{tag}.{ext}", "w").write(k.asm[ext])
        except Exception as exc:
            print("metadata failed", type(exc).__name__, exc, flush=True)
    for rep in range(3):
        line = []
        for name, fn in calls.items():
            us = graph_us(fn); results.setdefault(f"B{batch} R{rank} {name}", []).append(us); line.append(f"{name} {us:.2f}")
        print(f"B={batch} R={rank} rep{rep}: " + "  ".join(line), flush=True)
    flat = s.backbone.view(-1, s.backbone.shape[-1])
    rnd_new = lambda: K.markov_greedy_round(s.backbone, s.w1, s.w2, s.first, proposal_len=7, greedy_slots=s.slots,
                                            draft_token_ids=s.tokens)
    rnd_old = lambda: old.markov_greedy_round(flat, s.w1, s.w2, s.first, 7, None, 7, 0, s.slots, s.tokens, None)
    for rep in range(2):
        print(f"B={batch} R={rank} round old {graph_us(rnd_old):.2f} new {graph_us(rnd_new):.2f}", flush=True)
    if (batch, rank) == (64, 256):
        for cfg in bg._markov_configs(64, 256, False, False):
            try:
                us = graph_us(lambda: new.launch_markov(base, 7, s.w1, s.w2, None, s.first, keys_out=s.slots[:, 0], config=cfg))
                us_old = graph_us(lambda: old._launch_markov(base, 7, s.w1, s.w2, None, s.first, False, keys_out=s.slots[:, 0], config={k: v for k, v in cfg.items() if k != "BLOCK_R"}))
                print(f"  sweep new {us:7.2f} old {us_old:7.2f}  {cfg}", flush=True)
            except Exception as exc:
                print(f"  sweep {cfg}: {type(exc).__name__} {exc}"[:200], flush=True)
    del s
json.dump(results, open(f"{OUT}/diag15.json", "w"), indent=1)
