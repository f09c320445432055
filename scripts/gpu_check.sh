#!/usr/bin/env bash
# The GPU half of the test suite and the kernel benchmarks, on one CUDA machine (the H200 runs of
# docs/bench-*.md). Each part has its own time limit and writes into OUT_DIR as it goes.
#
#   scripts/gpu_check.sh OUT_DIR [tests|gpu-tests] [greedy] [sampling] [tune]    # default: tests greedy
set -uo pipefail
OUT=$(mkdir -p "$1" && cd "$1" && pwd)
shift
[ $# -gt 0 ] || set -- tests greedy
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/parts.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/parts.txt"
for part in "$@"; do
  start=$SECONDS
  case $part in
    tests) timeout 420 python -m pytest -q -n 8 -p no:cacheprovider tests > "$OUT/pytest.log" 2>&1 ;;
    # only the tests that need CUDA (real sizes, CUDA graphs, models on the GPU): the slow ones
    gpu-tests) timeout 240 python -m pytest -q -n 6 -p no:cacheprovider --durations=12 tests \
                 -k "cuda or real_size or real_vocab or replays" > "$OUT/pytest.log" 2>&1 ;;
    greedy) timeout 180 python -m dspark.bench --family greedy --out "$OUT/greedy.json" > "$OUT/greedy.log" 2>&1 ;;
    sampling) timeout 300 python -m dspark.bench --family sampling --out "$OUT/sampling.json" > "$OUT/sampling.log" 2>&1 ;;
    tune) timeout 90 python -m dspark.bench.greedy --tune --budget 70 > "$OUT/tune.log" 2>&1 ;;
    *) echo "unknown part $part" >&2; exit 2 ;;
  esac
  echo "$part: exit $? in $((SECONDS - start)) s" | tee -a "$OUT/parts.txt"
done
tail -3 "$OUT/pytest.log" 2>/dev/null
