"""The filter's and the sampled Markov step's Triton kernels compile for the H200 (sm_90) on a machine
without a GPU, in every per-row mode: the CPU interpreter runs kernels the GPU compiler refuses (a
loop-carried name whose type changes, say), so the kernels with run-time branches on per-row settings
are compiled here too. On a CUDA machine the other tests compile them for real."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

# Runs in a process of its own: under TRITON_INTERPRET=1 (this suite's CPU setting) @triton.jit gives
# interpreted functions, which do not compile.
SCRIPT = textwrap.dedent('''
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dspark.kernels.triton import filter as F, markov as M, search as S

    TYPES = {"x_ptr": "*fp32", "group_ptr": "*i64", "kappa_ptr": "*i64", "state_ptr": "*i32", "kept_ptr": "*i32",
             "bounds_ptr": "*i32", "fill_ptr": "*i32", "scratch_ptr": "*i64", "tok_ptr": "*i32", "bucket_ptr": "*i64",
             "inv_temp": "fp32", "top_p": "fp32", "w1_ptr": "*bf16", "w2_ptr": "*bf16", "scales_ptr": "*bf16",
             "prev_ptr": "*i32", "key_ptr": "*i64"}

    def compile_for_h200(fn, constants):
        names = fn.arg_names
        signature = {n: "constexpr" if n in constants else TYPES.get(n, "*fp32" if n.endswith("_ptr") else "i32")
                     for n in names}
        constexprs = {(names.index(k),): v for k, v in constants.items()}
        triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32))

    for per_row in (0, 1, 2):
        compile_for_h200(F._stats_kernel, dict(CHUNK=4096, GROUP_SIZE=32, CANDIDATES=True, PER_ROW=per_row))
        compile_for_h200(F._select_kernel, dict(NC_PAD=64, NG_PAD=8192, KT=256, GROUP_SIZE=32, NPROBE_=16,
                                                SAMPLE=True, PER_ROW=per_row))
        compile_for_h200(F._write_kernel, dict(CHUNK=4096, SC=4096, NS_PAD=1, KT=256, FILTERED=True, SAMPLE=False,
                                               PER_ROW=per_row))
        compile_for_h200(S._probe_kernel, dict(CHUNK=4096, TILE=256, BUCKET=1024, NPROBE_=16, PER_ROW=per_row))
        compile_for_h200(S._narrow_kernel, dict(NC_PAD=64, BUCKET=1024, NPROBE_=16, PER_ROW=per_row))
        compile_for_h200(S._gather_kernel, dict(CHUNK=4096, TILE=256, BUCKET=1024, PER_ROW=per_row))
        compile_for_h200(S._search_kernel, dict(TILE=256, BUCKET=1024, NPROBE_=16, PER_ROW=per_row))
    for row_temp in (False, True):
        compile_for_h200(M._markov_kernel, dict(R=256, BLOCK_R=256, TILES_PER_PROGRAM=4, PREV_IS_KEY=False, FP8=False,
                                                ARGMAX=False, WRITE_ROWS=True, STATS=True, GROUPS=True, GROUP_SIZE=32,
                                                BLOCK_V=128, BLOCK_B=16, NUM_STAGES=3, INTERPRET_=False,
                                                ROW_TEMP=row_temp))
    print("compiled")
''')


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine compiles them in the other tests")
def test_the_per_row_filter_and_markov_kernels_compile_for_the_h200():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-4000:]
