#!/usr/bin/env bash
# Build the demo pair shipped as dspark/data/demo: a small Qwen3 target trained from scratch on this
# Python's standard library (its own BPE tokenizer), a DSpark drafter for it (block 7), the DFlash
# ablation trained the same way (Markov rank 0), STS calibration on held-out files, and evaluation.
#
#   scripts/build_demo_pair.sh OUT_DIR          # one H200: about 9 minutes end to end
#   scripts/build_demo_pair.sh OUT_DIR --tiny   # CPU smoke run of every stage (a few minutes)
#
# OUT_DIR receives what ships: target/ (Hugging Face model + tokenizer), draft/ (speculators DSpark
# checkpoint with its STS temperatures), prompts.jsonl (the starts of the held-out stdlib:test files),
# eval.json / eval_ci.json / calibration.json (measurements), build.log and a copy of this script.
# The DFlash ablation goes to $WORK_DIR (default out/demo_work in the repository, git-ignored).
# Every stage saves its artifacts before the next starts, so a late failure leaves the earlier ones;
# the optional stages (ablation, calibration, evaluations) do not stop the others.
# Training time budgets (seconds) can be overridden: TARGET_SECONDS, DRAFT_SECONDS; ROWS: regenerated rows.
set -uo pipefail

if [ $# -lt 1 ] || [ "${1#-}" != "$1" ]; then
  echo "usage: $0 OUT_DIR [--tiny]" >&2
  exit 2
fi
OUT=$(mkdir -p "$1" && cd "$1" && pwd)
TINY=0
[ "${2:-}" = "--tiny" ] && TINY=1
REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK="${WORK_DIR:-$REPO/out/demo_work}"
export PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$WORK"
LOG="$OUT/build.log"
: > "$LOG"
cp "$0" "$OUT/build_demo_pair.sh"

if [ "$TINY" = 1 ]; then
  TARGET_ARGS=(--preset tiny --max-docs 40 --seq-len 128 --batch-size 8 --steps 40 --save-every 0)
  DRAFT_ARGS=(--layers 1 --markov-rank 16 --max-docs 40 --seq-len 128 --corpus-rows 64 --regenerate 16
              --confidence-target greedy --batch-size 4 --anchors 16 --steps 30 --save-every 0)
  CALIBRATE_ARGS=(--num-prompts 8 --prompt-tokens 32 --new-tokens 48)
  EVAL_ARGS=(--num-prompts 3 --max-new-tokens 32)
  DEVICE=(--device cpu)
else
  TARGET_ARGS=(--preset demo --seq-len 512 --batch-size 64 --lr 2e-3 --time-budget "${TARGET_SECONDS:-150}"
               --save-every 1000)
  # half corpus rows, half the target's own greedy continuations (what greedy decoding drafts for)
  DRAFT_ARGS=(--layers 2 --markov-rank 64 --capture-layers 2,8,15 --seq-len 512 --corpus-rows "${ROWS:-8192}"
              --regenerate "${ROWS:-8192}" --regenerate-batch 1024 --confidence-target greedy --batch-size 32
              --anchors 64 --lr 6e-4 --time-budget "${DRAFT_SECONDS:-150}" --steps 100000 --save-every 1000)
  CALIBRATE_ARGS=(--num-prompts 512 --prompt-tokens 64 --new-tokens 96 --batch-size 128)
  EVAL_ARGS=(--num-prompts 16 --max-new-tokens 128)
  DEVICE=()
fi

log() { echo "[$(date '+%H:%M:%S')] $*" | tee -a "$LOG"; }
dspark() { python -c 'import sys; from dspark.cli import main; sys.exit(main())' "$@"; }
FAILED=()
# stage NAME required|optional COMMAND...: run, log with timestamps; a required failure ends the build
stage() {
  local name=$1 kind=$2 start=$SECONDS
  shift 2
  log "start $name: $*"
  "$@" 2>&1 | tee -a "$LOG"
  local status=${PIPESTATUS[0]}
  if [ "$status" -ne 0 ]; then
    log "FAILED $name (exit $status) after $((SECONDS - start)) s"
    FAILED+=("$name")
    if [ "$kind" = required ]; then
      log "stopping: later stages need $name; artifacts so far are in $OUT and $WORK"
      exit 1
    fi
  else
    log "done $name in $((SECONDS - start)) s"
  fi
}

log "building the demo pair in $OUT (tiny=$TINY), work files in $WORK"
stage prompts required python -m dspark.training.data --split test --output "$OUT/prompts.jsonl"
stage target required python -m dspark.training.target_lm --corpus stdlib:train --output "$OUT/target" \
  "${TARGET_ARGS[@]}" "${DEVICE[@]}"
# the DFlash ablation trains beside the DSpark drafter (same budget, same GPU share: a fair comparison,
# and small models leave most of an H200 idle); its log goes to $WORK/dflash.log
stage dflash optional dspark train --target "$OUT/target" --data stdlib:train --output "$WORK/dflash" --block-size 7 \
  "${DRAFT_ARGS[@]}" --markov-rank 0 "${DEVICE[@]}" > "$WORK/dflash.log" 2>&1 &
DFLASH_PID=$!
stage draft required dspark train --target "$OUT/target" --data stdlib:train --output "$OUT/draft" --block-size 7 \
  "${DRAFT_ARGS[@]}" "${DEVICE[@]}"
wait "$DFLASH_PID" || FAILED+=(dflash)
# what ships is the checkpoint alone: the resumable training state and the log stay in $WORK
rm -rf "$WORK/draft_training" && mkdir -p "$WORK/draft_training" \
  && mv "$OUT/draft/training_state" "$OUT/draft/training_log.json" "$WORK/draft_training/" 2>/dev/null
stage calibrate optional dspark calibrate --target "$OUT/target" --draft "$OUT/draft" --data stdlib:valid \
  "${CALIBRATE_ARGS[@]}" --json "$OUT/calibration.json" "${DEVICE[@]}"
DRAFTS=("$OUT/draft")
[ -f "$WORK/dflash/config.json" ] && DRAFTS+=("$WORK/dflash")
stage eval optional dspark eval --target "$OUT/target" --draft "${DRAFTS[@]}" --prompts "$OUT/prompts.jsonl" --dtype float32 \
  "${EVAL_ARGS[@]}" --json "$OUT/eval.json" "${DEVICE[@]}"
# the configuration tests/test_eval.py checks in CI (CPU, float32): its floor comes from this measurement
stage eval_ci optional dspark eval --target "$OUT/target" --draft "$OUT/draft" --prompts "$OUT/prompts.jsonl" \
  --num-prompts 4 --max-new-tokens 64 --device cpu --dtype float32 --json "$OUT/eval_ci.json"

SIZE=$(du -cb "$OUT/target" "$OUT/draft" "$OUT/prompts.jsonl" | tail -1 | cut -f1)
log "shipped pair (target + draft + prompts): $SIZE bytes (limit 25000000)"
[ "$SIZE" -le 25000000 ] || { log "FAILED size: the pair exceeds 25 MB"; FAILED+=(size); }
python - "$OUT" <<'PY' 2>&1 | tee -a "$LOG"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
if (out / "eval.json").is_file():
    drafts = json.loads((out / "eval.json").read_text())["drafts"]
    for d in drafts:
        print(f"tau {d['tau']:.3f} speedup {d['speedup']:.2f}x identical {d['identical']}  {d['name']}")
    if len(drafts) > 1:
        print(f"DSpark tau / DFlash tau = {drafts[0]['tau'] / drafts[1]['tau']:.3f} (target >= 1.10)")
if (out / "calibration.json").is_file():
    report = json.loads((out / "calibration.json").read_text())["report"]
    print("ECE after STS per position: " + " ".join(f"{100 * r['ece_after']:.2f}%" for r in report))
PY
if [ ${#FAILED[@]} -gt 0 ]; then
  log "finished with failures: ${FAILED[*]}"
  exit 1
fi
log "finished: the pair is in $OUT"
