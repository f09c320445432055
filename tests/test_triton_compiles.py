"""Every Triton kernel of the package compiles for the H200 (sm_90) on a machine without a GPU: the
CPU interpreter runs kernels the GPU compiler refuses (a loop-carried name whose type changes, say),
so each entry point is compiled here, at the constexprs its launcher picks on a GPU, in every
per-row / optional-input mode that changes its code. A kernel missing from ``KERNELS`` fails the
coverage test: a new kernel comes with its compile check."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

import dspark  # noqa: E402

SRC = Path(dspark.__file__).parent

# Argument types by name (the rest: "*fp32" for a pointer, "i32" for a scalar); per kernel below.
TYPES = {"inv_temp": "fp32", "top_p": "fp32", "eps": "fp32", "qk_scale": "fp32", "c_min": "fp32", "c_max": "fp32",
         "limit": "fp32", "seed": "i64", "offset": "i64", "purpose_mix": "i64", "first_lane": "i64"}
BF16 = {n: "*bf16" for n in ("x_ptr", "res_ptr", "w_ptr", "y_ptr", "sum_ptr", "q_ptr", "k_ptr", "v_ptr",
                             "k_cache_ptr", "v_cache_ptr", "q_out_ptr", "q_w_ptr", "k_w_ptr", "out_ptr")}
I32 = "*i32"
FILTER = {"group_ptr": "*i64", "kappa_ptr": "*i64", "state_ptr": I32, "kept_ptr": I32, "bounds_ptr": I32,
          "fill_ptr": I32, "scratch_ptr": "*i64", "tok_ptr": I32, "bucket_ptr": "*i64"}
PER_ROW = (0, 1, 2)  # none / per-row top-k, top-p / per-row temperatures too

# "module.kernel": (argument types, [constexprs of each compiled variant])
KERNELS = {
    "filter._stats_kernel": (FILTER, [dict(CHUNK=4096, GROUP_SIZE=32, CANDIDATES=c, PER_ROW=r)
                                      for r in PER_ROW for c in (True, False)]),
    "filter._select_kernel": (FILTER, [dict(NC_PAD=64, NG_PAD=8192, KT=256, GROUP_SIZE=32, NPROBE_=16, SAMPLE=s,
                                            PER_ROW=r) for r in PER_ROW for s in (True, False)]),
    "filter._write_kernel": (FILTER, [dict(CHUNK=4096, SC=4096, NS_PAD=1, KT=256, FILTERED=f, SAMPLE=s, PER_ROW=r)
                                      for r in PER_ROW for f, s in ((True, False), (True, True), (False, False))]),
    "search._probe_kernel": (FILTER, [dict(CHUNK=4096, TILE=256, BUCKET=1024, NPROBE_=16, PER_ROW=r) for r in PER_ROW]),
    "search._narrow_kernel": (FILTER, [dict(NC_PAD=64, BUCKET=1024, NPROBE_=16, PER_ROW=r) for r in PER_ROW]),
    "search._gather_kernel": (FILTER, [dict(CHUNK=4096, TILE=256, BUCKET=1024, PER_ROW=r) for r in PER_ROW]),
    "search._search_kernel": (FILTER, [dict(TILE=256, BUCKET=1024, NPROBE_=16, PER_ROW=r) for r in PER_ROW]),
    **{f"request.{kernel}": ({**FILTER, "top_k_ptr": I32, "best_ptr": "*i64"}, variants) for kernel, variants in {
        "_scale_kernel": [dict(CHUNK=4096, GROUP_SIZE=32, HAS_BIAS=b) for b in (True, False)],
        "_setup_kernel": [dict(NC_PAD=64)],
        "_candidates_kernel": [dict(TOP_K=t, NG_PAD=8192, KT=256, GROUP_SIZE=32, NPROBE_=16) for t in (True, False)],
        "_finish_kernel": [dict(TOP_K=t, TILE=256, BUCKET=1024, NPROBE_=16) for t in (True, False)],
        "_mass_kernel": [dict(CHUNK=4096)], "_nucleus_kernel": [dict(NC_PAD=64)],
        "_write_kernel": [dict(CHUNK=4096)]}.items()},
    "markov._markov_kernel": (
        {"w1_ptr": "*bf16", "w2_ptr": "*bf16", "scales_ptr": "*bf16", "prev_ptr": I32, "rows_ptr": "*fp32",
         "key_ptr": "*i64", "group_ptr": "*i64", "settings_ptr": I32},
        [dict(R=256, BLOCK_R=256, TILES_PER_PROGRAM=4, PREV_IS_KEY=key, FP8=False, ARGMAX=argmax, WRITE_ROWS=not argmax,
              STATS=not argmax, GROUPS=not argmax, GROUP_SIZE=32, BLOCK_V=128, BLOCK_B=16, NUM_STAGES=3, INTERPRET_=False,
              ROW_TEMP=temp) for key, argmax, temp in ((False, False, False), (False, False, True), (True, True, False))]),
    "candidates._candidate_step_kernel": (
        {"logits_ptr": "*bf16", "w1_ptr": "*bf16", "w2_ptr": "*bf16", "first_ptr": I32, "ids_ptr": I32,
         "succ_ptr": I32, "draft_ptr": I32, "top_k_ptr": I32},
        [dict(R=256, BLOCK_C=b, BLOCK_R=64, HAS_BIAS=bias) for b, bias in ((64, False), (128, True))]),
    "candidates._group_max_kernel": ({"group_ptr": "*i64"},
                                     [dict(CHUNK=4096, GROUP_SIZE=32, HAS_BIAS=b) for b in (True, False)]),
    "candidates._top_ids_kernel": ({"group_ptr": "*i64", "ids_ptr": I32, "scratch_ptr": "*i64"},
                                   [dict(NG_PAD=8192, KT=128, GROUP_SIZE=32, NPROBE_=16, HAS_BIAS=b)
                                    for b in (True, False)]),
    "markov._quantize_fp8_kernel": ({"w2_ptr": "*bf16", "codes_ptr": "*u8"}, [dict(R=256, BLOCK_ROWS=16, BLOCK_R=256)]),
    "markov._finalize_kernel": ({"keys_ptr": "*i64", "tokens_ptr": I32}, [dict(BLOCK=1024)]),
    "markov._store_column_kernel": ({"src_ptr": "*i64", "dst_ptr": I32}, [dict(BLOCK=1024)]),
    "confidence._confidence_kernel": (
        {"hidden_ptr": "*bf16", "w1_ptr": "*bf16", "weight_ptr": "*bf16", "bias_ptr": "*bf16", "first_prev_ptr": I32,
         "draft_ptr": I32, "lengths_ptr": I32},
        [dict(P=7, H=4096, R=256, WITH_MARKOV=m, SCHEDULER=s, BLOCK_P=8, BLOCK_H=512, BLOCK_R=256)
         for m in (True, False) for s in (0, 1, 2)]),
    "draw._fill_uniforms_kernel": ({}, [dict(BLOCK=1024)]),
    "draw._mass_kernel": ({"desc_ptr": I32, "state_ptr": I32},
                          [dict(ROWS=2, CHUNK=2048, DESC=d, SEARCHED=s) for d in (True, False) for s in (True, False)]),
    "draw._walk_kernel": ({"desc_ptr": I32, "state_ptr": I32, "draw_ptr": I32, "last_ptr": I32, "out_ptr": I32,
                           "len_ptr": I32},
                          [dict(ROWS=2, CHUNK=2048, NC_PAD=128, DESC=d, SEARCHED=s) for d in (True, False)
                           for s in (True, False)]),
    "draw._copy_rows_kernel": ({}, [dict(BLOCK=4096)]),
    "draw._top_k_rows_kernel": ({"ids_ptr": "*i64", "ids_out_ptr": I32, "tok_ptr": I32},
                                [dict(BLOCK=64, SAMPLE=s) for s in (True, False)]),
    "rng._request_uniforms_kernel": ({"seeds_ptr": "*i64", "positions_ptr": I32}, [dict(BLOCK=64)]),
    "tree._grow_kernel": ({"tok_in_ptr": I32, "limit_ptr": I32, "root_ptr": I32, "tok_ptr": I32, "par_ptr": I32,
                           "dep_ptr": I32, "bits_ptr": "*i64", "count_ptr": I32}, [dict(SP=16, CK=64)]),
    "verify._build_verify_kernel": ({"last_ptr": I32, "draft_ptr": I32, "out_ptr": I32}, [dict(BLOCK=1024)]),
    "verify._fill_kernel": ({"out_ptr": I32}, [dict(BLOCK=1024)]),
    "verify._row_argmax_partial_kernel": ({"partial_ptr": "*i64"}, [dict(BLOCK=2048)]),
    "verify._greedy_accept_kernel": ({"partial_ptr": "*i64", "draft_ptr": I32, "lengths_ptr": I32,
                                      "accepted_ptr": I32, "accept_length_ptr": I32}, [dict(BLOCK_L=8, BLOCK_S=128)]),
    "verify._accept_prefix_kernel": ({"draft_ids_ptr": I32, "lengths_ptr": I32, "accepted_ptr": I32,
                                      "desc_ptr": I32, "draw_ptr": I32}, [dict(ROWS=4, BLOCK=8)]),
    "layers._rms_norm_kernel": (BF16, [dict(HAS_RESIDUAL=r, BLOCK_H=4096) for r in (True, False)]),
    "layers._qk_norm_rope_store_kernel": (
        {**BF16, "pos_ptr": I32, "row_ptr": I32, "slot_ptr": I32, "cos_sin_ptr": "*fp32", "table_ptr": I32},
        [dict(D=128, HALF=64, BLOCK_HALF=64, BLOCK_QH=32, BLOCK_KH=8, HAS_Q=q, Q_NORM=q, K_NORM=k, PAGED=paged)
         for q, k, paged in ((True, True, True), (False, True, True), (True, False, False))]),
    "layers._attention_kernel": (
        {**BF16, "slot_ptr": I32, "ctx_ptr": I32, "cu_ptr": I32, "window_ptr": I32, "tree_ptr": "*i64",
         "table_ptr": I32},
        [dict(REP=4, D=128, BLOCK_D=128, BLOCK_T=t, BLOCK_M=max(16, 4 * t), BLOCK_N=64, SPLITS=s, CAUSAL=c,
              HAS_WINDOW=w, SLIDING=w, TREE=tree, PAGED=paged, INTERPRET=False)
         for t, s, c, w, tree, paged in ((8, 4, True, False, False, True), (32, 1, True, True, False, True),
                                         (8, 1, False, False, True, True), (8, 4, True, False, False, False))]),
    "layers._combine_kernel": ({"out_ptr": "*bf16"}, [dict(D=128, BLOCK_D=128, SPLITS=4, BLOCK_S=4)]),
    "layers._silu_and_mul_kernel": (BF16, [dict(BLOCK=1024)]),
    "recurrent._gated_delta_scan_kernel": (
        {**BF16, "beta_ptr": "*bf16", "read_lines_ptr": "*i64", "read_entries_ptr": "*i64", "first_ptr": "*i64",
         "count_ptr": "*i64", "write_lines_ptr": "*i64", "write_entries_ptr": "*i64", "scale": "fp32"},
        [dict(HV=32, DK=128, DV=128, BK=128, BV_=8)]),  # Qwen3.5-9B's gated DeltaNet heads
    "recurrent._gated_delta_replay_scan_kernel": (
        {**BF16, "beta_ptr": "*bf16", "kept_k_ptr": "*bf16", "kept_v_ptr": "*bf16", "kept_beta_ptr": "*bf16",
         **{f"{name}_ptr": "*i64" for name in ("lines", "read_entries", "replay_entries", "replay_counts",
                                                "write_entries", "keep_entries", "first", "count", "snapshot_counts",
                                                "snapshot_entries")}, "scale": "fp32"},
        [dict(HV=32, DK=128, DV=128, BK=128, BV_=8)]),
    "recurrent._selective_state_scan_kernel": (
        {"x_ptr": "*bf16", "dt_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "d_ptr": "*bf16", "out_ptr": "*bf16",
         "read_lines_ptr": "*i64", "read_entries_ptr": "*i64", "first_ptr": "*i64", "count_ptr": "*i64",
         "write_lines_ptr": "*i64", "write_entries_ptr": "*i64"},
        [dict(HEADS=128, GROUPS=1, HEAD_DIM=64, SIZE=128, BP_=16, BN=128)]),  # Bamba-9B's Mamba-2 heads
    "recurrent._causal_conv_window_kernel": (
        {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "out_ptr": "*bf16", "states_ptr": "*bf16",
         "read_lines_ptr": "*i64", "read_entries_ptr": "*i64", "first_ptr": "*i64", "count_ptr": "*i64",
         "write_lines_ptr": "*i64", "write_entries_ptr": "*i64"},
        [dict(K=4, HAS_BIAS=b, BT=t, BC_=128) for b, t in ((True, 8), (False, 32))]),  # a round; a prompt chunk
}

# Runs in a process of its own: under TRITON_INTERPRET=1 (this suite's CPU setting) @triton.jit gives
# interpreted functions, which do not compile.
SCRIPT = textwrap.dedent('''
    import importlib, json, multiprocessing, os, sys
    from concurrent.futures import ProcessPoolExecutor
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    TYPES = json.loads(sys.argv[1])

    def compile_kernel(item):
        """None, or what failed: each variant of one kernel compiled for sm_90."""
        name, (types, variants) = item
        module, kernel = name.split(".")
        fn = getattr(importlib.import_module(f"dspark.kernels.triton.{module}"), kernel)
        names = fn.arg_names
        for constants in variants:
            signature = {n: "constexpr" if n in constants else
                         types.get(n) or TYPES.get(n) or ("*fp32" if n.endswith("_ptr") else "i32") for n in names}
            constexprs = {(names.index(k),): v for k, v in constants.items()}
            try:
                triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                               target=GPUTarget("cuda", 90, 32))
            except Exception as exc:
                return f"{name} {constants}: {type(exc).__name__}: {exc}"
        return None

    kernels = json.loads(sys.argv[2])
    with ProcessPoolExecutor(os.cpu_count(), mp_context=multiprocessing.get_context("fork")) as pool:
        failures = [f for f in pool.map(compile_kernel, kernels.items()) if f]  # the compiles are CPU-bound
    if failures:
        sys.exit("\\n".join(failures))
    print(*kernels)
''')


def jit_entry_points() -> set[str]:
    """``module.name`` of every ``@triton.jit`` function in the package that no other one calls
    (the launched kernels; the helpers compile inside them)."""
    found, called = set(), set()
    for path in SRC.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
                found.add((path, node.name))
                called |= {c.func.id if isinstance(c.func, ast.Name) else c.func.attr
                           for c in ast.walk(node) if isinstance(c, ast.Call) and isinstance(c.func, (ast.Name, ast.Attribute))}
    assert all(path.parent == SRC / "kernels" / "triton" for path, _ in found), "a jit function outside kernels/triton"
    return {f"{path.stem}.{name}" for path, name in found if name not in called}


def test_every_kernel_has_a_compile_check():
    assert jit_entry_points() == set(KERNELS)


@pytest.mark.slow
def test_every_kernel_compiles_for_the_h200():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(TYPES), json.dumps(KERNELS)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stderr or done.stdout)[-4000:]
    assert done.stdout.split() == list(KERNELS)
