"""The sampled step's kernels against a former version, side by side on a GPU (issue 15).

    git show 9ebe95e:src/dspark/kernels/triton/sampling.py > old_sampling.py
    OUT=DIR python scripts/compare_sampled_markov.py old_sampling.py

Per shape (B, R): registers/spills of both GEMMs, the GEMM launch alone (old kernel; the merged one
at its default configuration and, for the shapes in $SWEEP, swept over tilings), the probabilities +
draw launch alone and the 7-step CUDA-graph round (filters none and top-k 50), old against new. Times: ``bench.common.graph_us`` medians (cold L2).
"""
import importlib.util, itertools, json, os, sys
import torch, triton
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
import dspark.kernels as K
from dspark.kernels.triton import markov as tmarkov, filter as tfilter
from dspark.bench.common import compiled_kernel, graph_us
from dspark.bench.sampling import round_inputs, PROPOSAL_LEN, VOCAB

spec = importlib.util.spec_from_file_location("old_sampling", sys.argv[1])
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
OUT = os.environ.get("OUT", "/tmp")
SHAPES = [tuple(map(int, s.split("x"))) for s in os.environ.get("SHAPES", "64x64,8x256,1x256,64x256,1x64,8x64").split(",")]
SWEEP = {tuple(map(int, s.split("x"))) for s in os.environ.get("SWEEP", "").split(",") if s}
print("triton", triton.__version__, "torch", torch.__version__, flush=True)
results = {}


def kernel_meta(kern, fn, tag):
    k = compiled_kernel(kern, fn)
    print(f"  {tag}: regs {k.n_regs} spills {k.n_spills} shared {k.metadata.shared} warps {k.metadata.num_warps}",
          flush=True)


def timed(name, fn, reps=2):
    us = [graph_us(fn) for _ in range(reps)]
    results[name] = us
    print(f"  {name}: " + " / ".join(f"{u:.2f}" for u in us), flush=True)
    return min(us)


def old_gemm(backbone, w1, w2, first, tokens, probs, m, s, groups, filtered, batch, rank):
    block_b = min(64, max(16, triton.next_power_of_2(batch)))
    block_v = 256 if block_b <= 32 else 128
    n_stats = triton.cdiv(VOCAB, block_v)
    return lambda: old._markov_logits_kernel[(n_stats, triton.cdiv(batch, block_b))](
        backbone, w1, w2, first, tokens, PROPOSAL_LEN, 0, PROPOSAL_LEN, 0, probs[:, 0], PROPOSAL_LEN * VOCAB,
        m, s, n_stats, groups, triton.cdiv(VOCAB, old.GROUP), batch, VOCAB, 1.25, R=rank, BLOCK_B=block_b,
        BLOCK_V=block_v, BLOCK_R=min(64, max(16, triton.next_power_of_2(rank))), GROUPS=filtered,
        GROUP_SIZE=old.GROUP, UPCAST=False, num_warps=8 if block_b == 64 else 4, num_stages=3)


def new_gemm(backbone, w1, w2, first, probs, m, s, groups, cfg):
    return lambda: tmarkov.launch_markov(backbone[:, 0], PROPOSAL_LEN, w1, w2, None, first, rows_out=probs[:, 0],
                                         stats=(m, s), groups=groups, inv_temp=1.25, config=cfg)


for batch, rank in SHAPES:
    print(f"B={batch} R={rank}", flush=True)
    backbone, w1, w2, first, uniforms, tokens, probs = round_inputs(rank, batch)
    m = torch.empty(batch * 2048, device="cuda"); s = torch.empty_like(m)
    groups = torch.empty(batch * triton.cdiv(VOCAB, 32), dtype=torch.int64, device="cuda")
    default = tmarkov.markov_config(batch, rank, False, True)
    o = old_gemm(backbone, w1, w2, first, tokens, probs, m, s, groups, False, batch, rank)
    kernel_meta(old._markov_logits_kernel, o, "old gemm")
    kernel_meta(tmarkov._markov_kernel, new_gemm(backbone, w1, w2, first, probs, m, s, None, default), "new gemm")
    tag = f"B{batch} R{rank}"
    timed(f"{tag} gemm old", o)
    timed(f"{tag} gemm new", new_gemm(backbone, w1, w2, first, probs, m, s, None, default))
    timed(f"{tag} gemm+groups old", old_gemm(backbone, w1, w2, first, tokens, probs, m, s, groups, True, batch, rank))
    timed(f"{tag} gemm+groups new default", new_gemm(backbone, w1, w2, first, probs, m, s, groups, default))
    if (batch, rank) in SWEEP:
        full_r = max(16, triton.next_power_of_2(rank))
        for block_v, block_r, warps, stages in itertools.product((128, 256), sorted({64, full_r}), (4, 8), (2, 3)):
            cfg = dict(default, BLOCK_V=block_v, BLOCK_R=block_r, num_warps=warps, NUM_STAGES=stages)
            try:
                us = graph_us(new_gemm(backbone, w1, w2, first, probs, m, s, None, cfg))
            except Exception as exc:
                print(f"    sweep {cfg}: {type(exc).__name__}", flush=True); continue
            results.setdefault(f"{tag} sweep", []).append((us, cfg))
            print(f"    sweep {us:7.2f}  BV={block_v} BR={block_r} w={warps} st={stages}", flush=True)
    # the probabilities + draw launch alone (logits in probs[:, 1], written to probs[:, 2])
    ws = K.Workspace()
    stats = (m, s, tmarkov.markov_tiles(VOCAB, default), default["BLOCK_V"])
    sample = (uniforms[:, 0], PROPOSAL_LEN, tokens[:, 0], PROPOSAL_LEN)
    x, out, stride = probs[:, 1], probs[:, 2], PROPOSAL_LEN * VOCAB
    new_gemm(backbone, w1, w2, first, probs, m, s, None, default)()
    x.copy_(probs[:, 0])
    timed(f"{tag} probabilities+draw old",
          lambda: old._probabilities(x, stride, out, stride, batch, VOCAB, 1.0, 0, 1.0, stats=stats, sample=sample))
    timed(f"{tag} probabilities+draw new",
          lambda: tfilter.probabilities(x, stride, out, stride, batch, VOCAB, 1.0, 0, 1.0, ws, stats=stats,
                                        sample=sample))
    # rounds
    for k in (0, 50):
        def old_round(k=k):
            for step in range(PROPOSAL_LEN):
                old.markov_sample_step(backbone, w1, w2, first, uniforms, tokens, probs, step, 0.8, k, 1.0, PROPOSAL_LEN, 0)
        def new_round(k=k):
            for step in range(PROPOSAL_LEN):
                K.markov_sample_step(backbone, w1, w2, first, uniforms, tokens, probs, step, 0.8, k, 1.0)
        timed(f"{tag} top_k={k} round old", old_round)
        with K.use_backend("triton"):
            timed(f"{tag} top_k={k} round new", new_round)
    del backbone, w1, w2, probs
    torch.cuda.empty_cache()
json.dump(results, open(f"{OUT}/sampled_compare.json", "w"), indent=1)
