#!/usr/bin/env bash
# Data-parallel drafter training on this machine's GPUs, the same small run each time: the shipped demo
# target on stdlib:train, one plain process first, then torchrun with DDP and with FSDP2 (--fsdp) for
# each process count given. The global batch is the same in every run, so the loss curves must agree.
# OUT_DIR gets each run's log and checkpoint (with its training_log.json) and summary.json: tokens/s of
# each run, its ratio to the plain run's, the logged losses, and the largest weight difference from
# the plain run's checkpoint.
#
#   scripts/train_parallel.sh OUT_DIR 1       # one GPU: the NCCL and FSDP code paths at world size 1
#   scripts/train_parallel.sh OUT_DIR 1 2     # two GPUs: scaling 1 -> 2 (NVLink multicast kept off)
#
# Overrides: STEPS (200), BATCH (global rows per step, 64), EXTRA (more dspark train arguments, e.g.
# "--device cpu --seq-len 64" for a CPU smoke run), RUN_SECONDS (time limit of each run, 170).
set -uo pipefail
if [ $# -lt 2 ] || [ "${1#-}" != "$1" ]; then
  echo "usage: $0 OUT_DIR NPROC [NPROC ...]" >&2
  exit 2
fi
OUT=$(mkdir -p "$1" && cd "$1" && pwd)
shift
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
# shellcheck disable=SC2206
ARGS=(train --target src/dspark/data/demo/target --data stdlib:train --max-docs 200 --seq-len 512
      --batch-size "${BATCH:-64}" --anchors 64 --layers 2 --markov-rank 64 --steps "${STEPS:-200}" --save-every 0
      --save-dtype float32 --seed 0 ${EXTRA:-})
LIMIT=${RUN_SECONDS:-170}

run() {  # run NAME COMMAND...: one training run, its output in OUT_DIR/NAME.log
  local name=$1 start=$SECONDS
  shift
  timeout "$LIMIT" "$@" --output "$OUT/$name" > "$OUT/$name.log" 2>&1
  echo "$name: exit $? in $((SECONDS - start)) s" | tee -a "$OUT/runs.txt"
}

: > "$OUT/runs.txt"
python -c "import torch; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())" | tee -a "$OUT/runs.txt"
run plain python -m dspark "${ARGS[@]}"
for n in "$@"; do
  torchrun=(python -m torch.distributed.run --standalone --nproc-per-node "$n" -m dspark "${ARGS[@]}")
  run "ddp$n" "${torchrun[@]}"
  run "fsdp$n" "${torchrun[@]}" --fsdp
done

python - "$OUT" <<'PY' | tee "$OUT/summary.txt"
import json, sys
from pathlib import Path
from safetensors.torch import load_file

out = Path(sys.argv[1])
runs = [p.parent for p in sorted(out.glob("*/training_log.json"))]
plain = out / "plain"
base = json.loads((plain / "training_log.json").read_text()) if (plain / "training_log.json").is_file() else None
reference = load_file(str(plain / "model.safetensors")) if base else None
summary = []
for run in runs:
    log = json.loads((run / "training_log.json").read_text())
    weights = load_file(str(run / "model.safetensors"))
    entry = {"run": run.name, "world_size": log["world_size"], "parallel": log["parallel"], "steps": log["steps"],
             "tokens_per_second": log["tokens_per_second"],
             "vs_plain": log["tokens_per_second"] / base["tokens_per_second"] if base else None,
             "peak_gpu_memory_bytes": log["peak_gpu_memory_bytes"],
             "losses": [(e["step"], round(e["loss"], 5)) for e in log["log"]],
             "max_weight_diff_vs_plain": max(float((weights[k].float() - reference[k].float()).abs().max())
                                             for k in reference) if reference else None}
    summary.append(entry)
    ratio = f"{entry['vs_plain']:.2f}x plain" if base else "no plain run"
    diff = f"{entry['max_weight_diff_vs_plain']:.2e}" if reference else "?"
    memory = f"{log['peak_gpu_memory_bytes'] / 2**30:.2f} GiB" if log["peak_gpu_memory_bytes"] else "?"
    print(f"{run.name:>8}: {entry['tokens_per_second']:.0f} tokens/s ({ratio}), "
          f"final loss {log['log'][-1]['loss']:.4f}, max |w - w_plain| {diff}, peak GPU memory {memory}")
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
PY
