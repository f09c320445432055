#!/usr/bin/env bash
# Build the demo pair shipped as dspark/data/demo: a Qwen3 target trained from scratch on all the Python
# source of the build machine (its standard library's train split and every installed package; its own
# BPE tokenizer), a DSpark drafter for it (block 7) trained twice -- with and without the confidence
# loss's gradient reaching the backbone (--confidence-backprop), the better by greedy tau ships -- the
# DFlash ablation trained the same way (Markov rank 0), STS calibration on held-out files, evaluation,
# and the acceptance-replay traces of the serving benchmark.
#
#   scripts/build_demo_pair.sh OUT_DIR          # one H200, in groups of stages (below)
#   scripts/build_demo_pair.sh OUT_DIR --tiny   # CPU smoke run of every stage (a few minutes)
#
# STAGES (environment; default all, in order) picks groups, so that the build runs in device calls of
# under 10 minutes that resume from each other's saved artifacts:
#   target   the held-out prompts and the target (TARGET_SECONDS of training, default 420)
#   drafts   three drafters at once on the one GPU (DRAFT_SECONDS each, default 330): draft (confidence
#            loss on the heads only), draft_bp (--confidence-backprop), dflash (the ablation); DRAFTERS
#            (a subset of those names) trains fewer, each with a larger share of the GPU; DRAFT_INIT (a
#            pair directory, e.g. src/dspark/data/demo) starts draft / draft_bp from its draft/ and
#            dflash from its dflash/ (--init-from: a longer training over several device calls)
#   finish   greedy tau of draft and draft_bp, the better becomes OUT_DIR/draft; STS calibration;
#            evaluation against the ablation; replay traces; the CPU evaluation CI checks; the size limit
# A group needs the artifacts of the ones before it in OUT_DIR (and WORK_DIR for finish).
#
# OUT_DIR receives what ships: target/ (Hugging Face model + tokenizer), draft/ (speculators DSpark
# checkpoint with its STS temperatures), dflash/, prompts.jsonl (the starts of the held-out stdlib:test
# files), replay_traces.json, eval.json / eval_ci.json / calibration.json / choice.json (measurements),
# build.log and a copy of this script. The other drafter and the training states go to $WORK_DIR
# (default out/demo_work in the repository, git-ignored). ROWS: regenerated rows per drafter; DRAFT_SEED
# (default 0) picks the corpus rows, their regenerations and the data order (a continued training with
# DRAFT_INIT and a new seed sees rows it has not seen).
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
STAGES="${STAGES:-target drafts finish}"
for name in $STAGES; do
  case $name in target|drafts|finish) ;; *) echo "STAGES: expected target, drafts or finish, got '$name'" >&2; exit 2 ;; esac
done
DRAFTERS="${DRAFTERS:-draft draft_bp dflash}"
for name in $DRAFTERS; do
  case $name in draft|draft_bp|dflash) ;; *) echo "DRAFTERS: expected draft, draft_bp or dflash, got '$name'" >&2; exit 2 ;; esac
done
export PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$WORK"
LOG="$OUT/build.log"
touch "$LOG"
cp "$0" "$OUT/build_demo_pair.sh"

if [ "$TINY" = 1 ]; then
  TARGET_ARGS=(--preset tiny --corpus stdlib:train --max-docs 40 --seq-len 128 --batch-size 8 --steps 40 --save-every 0)
  DRAFT_ARGS=(--layers 1 --markov-rank 16 --max-docs 40 --seq-len 128 --corpus-rows 64 --regenerate 16
              --confidence-target greedy --batch-size 4 --anchors 16 --steps 30 --save-every 0)
  CALIBRATE_ARGS=(--num-prompts 8 --prompt-tokens 32 --new-tokens 48)
  EVAL_ARGS=(--num-prompts 3 --max-new-tokens 32)
  TRACE_TOKENS=32
  DEVICE=(--device cpu)
else
  TARGET_ARGS=(--preset demo --corpus python:train --seq-len 512 --batch-size 128 --lr 2e-3
               --time-budget "${TARGET_SECONDS:-420}" --save-every 2000)
  # half corpus rows, half the target's own greedy continuations (what greedy decoding drafts for)
  DRAFT_ARGS=(--layers 2 --markov-rank 64 --capture-layers 1,5,9 --seq-len 512 --corpus-rows "${ROWS:-16384}"
              --regenerate "${ROWS:-16384}" --regenerate-batch 1024 --confidence-target greedy --batch-size 32
              --anchors 64 --lr 6e-4 --time-budget "${DRAFT_SECONDS:-330}" --steps 1000000 --save-every 2000
              --seed "${DRAFT_SEED:-0}")
  CALIBRATE_ARGS=(--num-prompts 512 --prompt-tokens 64 --new-tokens 96 --batch-size 128)
  EVAL_ARGS=(--num-prompts 0 --max-new-tokens 128)
  TRACE_TOKENS=320
  DEVICE=()
fi
# the traces record on the GPU where there is one (the finish group also runs on a CPU, only slower)
TRACE_DEVICE=$([ "$TINY" = 0 ] && python -c 'import torch; print(torch.cuda.is_available())' | grep -q True \
               && echo cuda || echo cpu)

log() { echo "[$(date '+%H:%M:%S')] $*" | tee -a "$LOG"; }
dspark() { python -c 'import sys; from dspark.cli import main; sys.exit(main())' "$@"; }
want() { [[ " $STAGES " == *" $1 "* ]]; }
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
# drafter_dir NAME: where a drafter is written (the ablation ships; the DSpark candidates wait in $WORK)
drafter_dir() { if [ "$1" = dflash ]; then echo "$OUT/dflash"; else echo "$WORK/$1"; fi; }
# train_draft NAME DIR EXTRA...: one drafter in the background, its log in $WORK/NAME.log
train_draft() {
  local name=$1 dir=$2
  shift 2
  if [ -n "${DRAFT_INIT:-}" ]; then
    set -- "$@" --init-from "$DRAFT_INIT/$([ "$name" = dflash ] && echo dflash || echo draft)"
  fi
  log "start $name in the background (log $WORK/$name.log)${DRAFT_INIT:+, from the weights in $DRAFT_INIT}"
  dspark train --target "$OUT/target" --data stdlib:train --output "$dir" --block-size 7 --overwrite \
    "${DRAFT_ARGS[@]}" "$@" "${DEVICE[@]}" > "$WORK/$name.log" 2>&1 &
}

log "building the demo pair in $OUT (tiny=$TINY, stages: $STAGES), work files in $WORK"
if want target; then
  stage prompts required python -m dspark.training.data --split test --output "$OUT/prompts.jsonl"
  stage target required python -m dspark.training.target_lm --output "$OUT/target" "${TARGET_ARGS[@]}" "${DEVICE[@]}"
fi

if want drafts; then
  [ -f "$OUT/target/config.json" ] || { log "FAILED drafts: no target in $OUT (run STAGES=target first)"; exit 1; }
  # small trainings leave an H200 mostly idle one at a time: they share it, same budget each
  JOBS=()
  for name in $DRAFTERS; do
    case $name in
      draft) train_draft draft "$(drafter_dir draft)" ;;
      draft_bp) train_draft draft_bp "$(drafter_dir draft_bp)" --confidence-backprop ;;
      dflash) train_draft dflash "$(drafter_dir dflash)" --markov-rank 0 ;;
    esac
    JOBS+=("$name:$!")
  done
  for job in "${JOBS[@]}"; do
    if wait "${job#*:}"; then log "done ${job%%:*}"; else log "FAILED ${job%%:*}"; FAILED+=("${job%%:*}"); fi
    tail -3 "$WORK/${job%%:*}.log" | tee -a "$LOG"
  done
  # what ships is the checkpoint alone: the resumable training state and the log stay in $WORK
  for name in $DRAFTERS; do
    dir=$(drafter_dir "$name")
    mkdir -p "$WORK/$name.training" && mv "$dir/training_state" "$dir/training_log.json" "$WORK/$name.training/" 2>/dev/null
  done
fi

if want finish; then
  # the confidence loss's gradient: the drafter with the higher greedy tau on held-out prompts ships
  CANDIDATES=()
  for dir in "$WORK/draft" "$WORK/draft_bp"; do [ -f "$dir/config.json" ] && CANDIDATES+=("$dir"); done
  [ ${#CANDIDATES[@]} -gt 0 ] || { log "FAILED finish: no drafter in $WORK (run STAGES=drafts first)"; exit 1; }
  stage choose required dspark eval --target "$OUT/target" --draft "${CANDIDATES[@]}" --prompts stdlib:valid \
    "${EVAL_ARGS[@]}" --json "$OUT/choice.json" "${DEVICE[@]}"
  BEST=$(python - "$OUT/choice.json" <<'PY'
import json, sys
drafts = json.load(open(sys.argv[1]))["drafts"]
print(max(drafts, key=lambda d: d["tau"])["name"])
PY
  )
  log "shipping $BEST (greedy tau on stdlib:valid: $OUT/choice.json)"
  rm -rf "$OUT/draft" && cp -r "$BEST" "$OUT/draft"
  stage calibrate optional dspark calibrate --target "$OUT/target" --draft "$OUT/draft" --data stdlib:valid \
    "${CALIBRATE_ARGS[@]}" --json "$OUT/calibration.json" "${DEVICE[@]}"
  DRAFTS=("$OUT/draft")
  [ -f "$OUT/dflash/config.json" ] && DRAFTS+=("$OUT/dflash")
  stage eval optional dspark eval --target "$OUT/target" --draft "${DRAFTS[@]}" --prompts "$OUT/prompts.jsonl" \
    --dtype float32 "${EVAL_ARGS[@]}" --json "$OUT/eval.json" "${DEVICE[@]}"
  stage traces optional python -m dspark.bench.replay --pair "$OUT" --out "$OUT/replay_traces.json" \
    --max-new-tokens "$TRACE_TOKENS" --device "$TRACE_DEVICE"
  # the configuration tests/test_eval.py checks in CI (CPU, float32): its floor comes from this measurement
  stage eval_ci optional dspark eval --target "$OUT/target" --draft "$OUT/draft" --prompts "$OUT/prompts.jsonl" \
    --num-prompts 4 --max-new-tokens 64 --device cpu --dtype float32 --json "$OUT/eval_ci.json"

  SIZE=$(du -cb "$OUT/target" "$OUT/draft" "$OUT/dflash" "$OUT/prompts.jsonl" "$OUT/replay_traces.json" 2>/dev/null \
         | tail -1 | cut -f1)
  log "shipped files (target, draft, dflash, prompts, traces): $SIZE bytes (limit 40000000)"
  [ "$SIZE" -le 40000000 ] || { log "FAILED size: the pair exceeds 40 MB"; FAILED+=(size); }
  python - "$OUT" <<'PY' 2>&1 | tee -a "$LOG"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
for name in ("choice.json", "eval.json"):
    if (out / name).is_file():
        drafts = json.loads((out / name).read_text())["drafts"]
        for d in drafts:
            print(f"{name}: tau {d['tau']:.3f} speedup {d['speedup']:.2f}x identical {d['identical']}  {d['name']}")
        if name == "eval.json" and len(drafts) > 1:
            print(f"DSpark tau / DFlash tau = {drafts[0]['tau'] / drafts[1]['tau']:.3f} (target >= 1.10)")
if (out / "calibration.json").is_file():
    report = json.loads((out / "calibration.json").read_text())["report"]
    print("ECE before / after STS per position: "
          + " ".join(f"{100 * r['ece_before']:.2f}/{100 * r['ece_after']:.2f}%" for r in report))
PY
fi
if [ ${#FAILED[@]} -gt 0 ]; then
  log "finished with failures: ${FAILED[*]}"
  exit 1
fi
log "finished stages: $STAGES; the pair is in $OUT"
