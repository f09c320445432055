#!/usr/bin/env bash
# guidellm's time-bounded sweep against `dspark serve`, as a user runs it (docs/serving.md, "Clients"):
#
#   scripts/guidellm_sweep.sh OUT_DIR [dspark serve arguments]   # default: the demo pair, on the CPU here
#
# guidellm's sweep profile runs synchronous, throughput and SWEEP_SIZE - 2 constant rates in between, each
# stopped at SECONDS_PER_STRATEGY: guidellm then cancels the requests still in flight (their connections
# close), so the server sees aborts mid-prefill, mid-stream and waiting. The server must count them as
# "abort", never "error", stay healthy through every strategy and answer a request after the sweep.
# Environment: GUIDELLM (default guidellm), SECONDS_PER_STRATEGY (15), SWEEP_SIZE (4), MAX_CONCURRENCY (32:
# guidellm's default 512 is past `dspark serve`'s --max-batch + --max-waiting, and the excess gets 429s),
# PROMPT_TOKENS / OUTPUT_TOKENS (32 / 32), REQUEST_FORMAT (/v1/chat/completions or /v1/completions).
#
# OUT_DIR receives command.txt, console.txt (guidellm's tables), guidellm.json (guidellm's record: every
# request's timings, ~1 MB), summary.json (per strategy: guidellm's counts, rates, TTFT / ITL medians; the
# server's finished requests), server.log, metrics.txt (/metrics after the sweep) and checks.txt; exit
# status 1 if guidellm failed or counted errors, the server counted an error, or it did not answer after.
set -uo pipefail

if [ $# -lt 1 ] || [ "${1#-}" != "$1" ]; then
  echo "usage: $0 OUT_DIR [dspark serve arguments]" >&2
  exit 2
fi
OUT=$(mkdir -p "$1" && cd "$1" && pwd)
shift
REPO=$(cd "$(dirname "$0")/.." && pwd)
GUIDELLM=${GUIDELLM:-guidellm}
PYTHON=${PYTHON:-python}

PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m dspark.cli serve --port 0 "$@" > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null' EXIT
URL=""
for _ in $(seq 600); do  # start-up: at most 5 minutes
  URL=$(grep -o 'http://[0-9.]*:[0-9]*' "$OUT/server.log" | head -1)
  [ -n "$URL" ] || ! kill -0 "$SERVER" 2>/dev/null && break
  sleep 0.5
done
if [ -z "$URL" ]; then
  echo "dspark serve did not start (see $OUT/server.log)" >&2
  exit 1
fi
MODEL=$(curl -sf "$URL/v1/models" | "$PYTHON" -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')
TOKENIZER=$(PYTHONPATH="$REPO/src" "$PYTHON" -c 'from dspark.training.data import demo_pair; print(demo_pair().target)')
TOKENIZER=${TOKENIZER_DIR:-$TOKENIZER}  # a served target other than the demo pair's: its tokenizer

COMMAND=("$GUIDELLM" run
  --backend "kind=openai_http,target=$URL,model=$MODEL,request_format=${REQUEST_FORMAT:-/v1/chat/completions}"
  --profile "kind=sweep,sweep_size=${SWEEP_SIZE:-4},max_concurrency=${MAX_CONCURRENCY:-32}"
  --constraint "kind=max_duration,seconds=${SECONDS_PER_STRATEGY:-15}"
  --tokenizer "kind=hf_auto,model=$TOKENIZER"
  --data "kind=synthetic_text,prompt_tokens=${PROMPT_TOKENS:-32},output_tokens=${OUTPUT_TOKENS:-32}"
  --metrics "kind=generative,sample_size=0"
  --output "kind=json,path=$OUT/guidellm.json" --output kind=console
  --disable-progress)
echo "${COMMAND[*]}" > "$OUT/command.txt"
HF_HUB_OFFLINE=1 "${COMMAND[@]}" > "$OUT/console.txt" 2>&1
GUIDELLM_STATUS=$?

{
  echo "guidellm exit status: $GUIDELLM_STATUS"
  echo "after the sweep: /health $(curl -s -o /dev/null -w '%{http_code}' "$URL/health"), a completion:"
  BODY="{\"model\": \"$MODEL\", \"prompt\": \"import os\\n\", \"max_tokens\": 8, \"temperature\": 0}"
  curl -sf "$URL/v1/completions" -d "$BODY"
  echo
} > "$OUT/checks.txt"
curl -sf "$URL/metrics" > "$OUT/metrics.txt"
"$PYTHON" - "$OUT" "$GUIDELLM_STATUS" <<'EOF' >> "$OUT/checks.txt"
import json, sys
from pathlib import Path

out, status = Path(sys.argv[1]), int(sys.argv[2])
finished = {line.split('finished_reason="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in (out / "metrics.txt").read_text().splitlines()
            if line.startswith("dspark:request_success_total{")}
strategies = []
for benchmark in json.loads((out / "guidellm.json").read_text())["benchmarks"]:
    metrics, state = benchmark["metrics"], benchmark["scheduler_state"]
    strategies.append({
        "strategy": benchmark["config"]["strategy"], "duration_s": round(benchmark["duration"], 2),
        **metrics["request_totals"],  # incomplete: sent, then cut off at the time bound
        # guidellm's other cancellations: still queued, or cut off as they were being sent
        "cancelled_not_started": state["cancelled_requests"] - metrics["request_totals"]["incomplete"],
        "requests_per_s": metrics["requests_per_second"]["successful"]["mean"],
        "output_tokens_per_s": metrics["output_tokens_per_second"]["total"]["mean"],
        "ttft_ms_p50": metrics["time_to_first_token_ms"]["successful"]["median"],
        "itl_ms_p50": metrics["inter_token_latency_ms"]["successful"]["median"]})
summary = {"server_requests_by_finished_reason": finished, "strategies": strategies}
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
for s in strategies:
    print(f"guidellm {s['strategy']['type_']:<12} successful {s['successful']:>4}, errored {s['errored']}, "
          f"cut off {s['incomplete']:>3}, cancelled not started {s['cancelled_not_started']:>3}")
print("server dspark:request_success_total by finished_reason:", finished)
errors = sum(s["errored"] for s in strategies)
cut_off = sum(s["incomplete"] for s in strategies)
answered = '"finish_reason"' in (out / "checks.txt").read_text()
ok = status == 0 and errors == 0 and finished.get("error", 0) == 0 and answered
print(f"{'PASS' if ok else 'FAIL'}: guidellm exit {status}, {errors} guidellm errors, "
      f"{finished.get('error', 0):g} server errors, {cut_off} requests cut off by guidellm against "
      f"{finished.get('abort', 0):g} server aborts, the server {'answered' if answered else 'did NOT answer'} after")
sys.exit(0 if ok else 1)
EOF
