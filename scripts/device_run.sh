#!/usr/bin/env bash
# One device run (the H200 sessions of issues 22-24): the carried wheels (FastAPI stack for `dspark serve`), then the
# steps named on the command line, each with its own time limit, logs under $OUT.
# The wheels (.whl, not in git; python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 ... -d .whl: fastapi
# starlette pydantic pydantic-core annotated-types typing-inspection typing-extensions uvicorn sniffio opentelemetry-api
# importlib-metadata zipp annotated-doc h11 click anyio idna httpx httpcore certifi prometheus-client xgrammar
# apache-tvm-ffi; fla-core for hybrid targets)
#   scripts/device_run.sh STEP...   steps: tests, gputests, engine, firstcall, prefixchat, capacity, backends, breakdown,
#   mixed, frontier, load, mixedload, memory, demo, hybrid, structured
# gputests: every gpu-marked test; engine: plain and DSpark step times of the 8B shape at B = 1 and 64;
# firstcall: a user's first LLM.generate call against a later one; prefixchat: shared-prefix chat on the
# 8B shape (64 clients, 2,048-token system prompt, 3 turns), prefix caching on against off; capacity: concurrent
# 4,096-token requests in the KV blocks beside the 8B shape, against a per-slot cache.
# hybrid: a random Qwen3.5-9B-shaped target (gated DeltaNet, bf16) at B = 1 and 64: dspark's plain step and DSpark
# rounds (random drafts; acceptance 1) against transformers' compiled step (bench.hybrid; HYBRID_ARGS adds options).
# structured: the 8B shape at B = 1, 16, 64 with every row free and every row constrained to a JSON schema: ms per
# step of plain decoding and DSpark (oracle drafts at acceptance 1 and 0.8, random drafts), their ratio and tokens/s
# (bench.structured; STRUCTURED_ARGS adds options).
# load: the frontier's configurations without a server at B = 128, 256 (bench.load, each configuration in a
# process of its own; LOAD_ARGS adds options); mixedload: its mixed-settings workload at B = 1, 16, 64, in one
# process (small engines; MIXEDLOAD_ARGS adds options).
# memory: the 8B shape's engine at B = 256 capturing every graph, its memory against its estimate (bench.memory).
# breakdown: bench.breakdown's cases named in BREAKDOWN_CASES, separated by ';' (none: every case).
# demo: scripts/build_demo_pair.sh out/demo with STAGES=$DEMO_STAGES (default target); out/demo and the
# candidate drafters (out/demo_work/draft, draft_bp; not their training states) sent back as
# demo.tgz.part-* (15 MiB pieces; here: cat demo.tgz.part-* | tar xzf - -C out); a later call that runs
# the next stages carries out/demo (and out/demo_work for finish). One group per call: target (~8.5 min),
# drafts (~7), finish (~3).
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 || exit 1
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/steps.txt"
for step in "$@"; do
  start=$SECONDS
  case $step in
    tests) timeout "${TESTS_LIMIT:-300}" python -m pytest -v -n 8 --dist load -p no:cacheprovider --timeout 150 \
             ${TESTS:-tests/test_row_filters.py tests/test_sampling.py tests/test_markov.py tests/test_verify.py \
             tests/test_llm_engine.py tests/test_tree_engine.py tests/test_hf_target.py tests/test_lossless_sampling.py \
             tests/test_kernel_workspace.py tests/test_engine_limits.py tests/test_replay.py tests/test_schedulers.py} \
             > "$OUT/pytest.log" 2>&1; rc=$?; grep -E "FAILED|ERROR" "$OUT/pytest.log" | head -40; (exit $rc) ;;
    gputests) timeout "${TESTS_LIMIT:-420}" python -m pytest -q -m gpu -n 8 --dist load -p no:cacheprovider --timeout 240 ${GPU_TESTS:-tests/} \
             > "$OUT/pytest.log" 2>&1; rc=$?; grep -E "FAILED|ERROR" "$OUT/pytest.log" | head -40; (exit $rc) ;;
    engine) timeout "${ENGINE_LIMIT:-300}" python -m dspark.bench.engine --shapes qwen3-8b --batches 1,64 --hf none \
             --out "$OUT/engine" > "$OUT/engine.log" 2>&1 ;;
    firstcall) timeout 240 python -m dspark.bench.first_call --shape qwen3-8b --batch 64 --prompt 512 --new 256 \
             > "$OUT/firstcall.log" 2>&1 ;;
    prefixchat) timeout "${PREFIX_LIMIT:-540}" env DSPARK_REPLAY='{"shape": "qwen3-8b"}' python -m dspark.bench.prefix_chat \
             --out "$OUT/prefixchat" -- --engine-factory dspark.bench.replay:random_engine --max-batch 64 \
             --max-model-len 4096 > "$OUT/prefixchat.log" 2>&1 ;;
    capacity) timeout "${CAPACITY_LIMIT:-400}" python -m dspark.bench.capacity --shape qwen3-8b --request-tokens 4096 \
             --new 64 --enforce-eager > "$OUT/capacity.json" 2> "$OUT/capacity.log" ;;
    backends) timeout 175 python -m dspark.bench.engine --backends fused,hf --shapes qwen3-8b --batches 1,8,64 \
             --prompt 128 --new 64 --out "$OUT/backends" > "$OUT/backends.log" 2>&1 ;;
    hybrid) timeout "${HYBRID_LIMIT:-560}" python -m dspark.bench.hybrid --shape qwen3.5-9b --batches 1,64 \
             --out "$OUT/hybrid" ${HYBRID_ARGS:-} > "$OUT/hybrid.log" 2>&1 ;;
    structured) timeout "${STRUCTURED_LIMIT:-560}" python -m dspark.bench.structured --shape qwen3-8b --batches 1,16,64 \
             --out "$OUT/structured" ${STRUCTURED_ARGS:-} > "$OUT/structured.log" 2>&1 ;;
    breakdown) cases=(); IFS=';' read -ra named <<< "${BREAKDOWN_CASES:-}"
             for c in "${named[@]}"; do cases+=(--case "$c"); done
             timeout "${BREAKDOWN_LIMIT:-90}" python -m dspark.bench.breakdown "${cases[@]}" > "$OUT/breakdown.txt" 2>&1 ;;
    mixed) timeout "${MIXED_LIMIT:-300}" python -m dspark.bench.frontier --out "$OUT/mixed" --workload mixed \
             --prompt-tokens-max 2048 ${MIXED_ARGS:-} > "$OUT/mixed.log" 2>&1 ;;
    demo) timeout "${DEMO_LIMIT:-560}" env STAGES="${DEMO_STAGES:-target}" bash scripts/build_demo_pair.sh out/demo \
             > "$OUT/demo.log" 2>&1; tar czf - -C out demo $(cd out && ls -d demo_work/draft demo_work/draft_bp 2>/dev/null) \
             | split -b 15m - "$OUT/demo.tgz.part-" ;;
    load) timeout "${LOAD_LIMIT:-560}" python -m dspark.bench.load --out "$OUT/load" ${LOAD_ARGS:-} > "$OUT/load.log" 2>&1 ;;
    mixedload) timeout "${MIXEDLOAD_LIMIT:-300}" python -m dspark.bench.load --out "$OUT/mixedload" --workload mixed \
             --batches 1,16,64 --no-isolate ${MIXEDLOAD_ARGS:-} > "$OUT/mixedload.log" 2>&1 ;;
    memory) timeout "${MEMORY_LIMIT:-240}" python -m dspark.bench.memory --out "$OUT/memory" ${MEMORY_ARGS:-} \
             > "$OUT/memory.log" 2>&1 ;;
    frontier) timeout "${FRONTIER_LIMIT:-420}" python -m dspark.bench.frontier --out "$OUT/frontier" \
             ${FRONTIER_ARGS:-} > "$OUT/frontier.log" 2>&1 ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
  echo "$step: exit $? in $((SECONDS - start)) s" | tee -a "$OUT/steps.txt"
  # at most 8 files come back: each step's folder as one archive, made as soon as the step ends
  [ -d "$OUT/$step" ] && tar czf "$OUT/$step.tgz" -C "$OUT" "$step" && rm -rf "$OUT/$step"
done
tail -3 "$OUT/pytest.log" 2>/dev/null
