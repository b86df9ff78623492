#!/usr/bin/env bash
# What a dead trace collector costs in latency: the same traffic against
# Sluice exporting traces to a port where nothing listens, and against Sluice
# with tracing off, side by side (sluice-bench --compare). The integration
# test (integration-tests/test_observability.py) checks that serving goes on
# and that the failure is logged once per process; how much slower it serves,
# if at all, is a measurement, made here on a quiet machine.
#
#   bash benchmarks/tracing_overhead.sh [--model-id M] [more sluice-bench flags]
#
# Writes benchmarks/results/tracing-overhead.json.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=()
if [[ "${1:-}" == "--model-id" ]]; then MODEL=(--model-id "$2"); shift 2; fi

free_port() { python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
TMP=$(mktemp -d)
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  wait
  rm -rf "$TMP"
}
trap cleanup EXIT

start() {  # start NAME PORT [launcher flags]
  local name=$1 port=$2; shift 2
  sluice-launcher --hostname 127.0.0.1 --port "$port" --shard-uds-path "$TMP/$name" \
    --master-port "$(free_port)" "${MODEL[@]}" "$@" >"$TMP/$name.log" 2>&1 &
  PIDS+=($!)
}
wait_ready() {  # wait_ready NAME PORT
  until curl -sf "http://127.0.0.1:$2/ready" >/dev/null; do
    kill -0 "${PIDS[-1]}" 2>/dev/null || { cat "$TMP/$1.log"; exit 1; }
    sleep 1
  done
}

DOWN=$(free_port); OFF=$(free_port); CLOSED=$(free_port)
start collector-down "$DOWN" --otlp-endpoint "http://127.0.0.1:$CLOSED"
wait_ready collector-down "$DOWN"
start tracing-off "$OFF"
wait_ready tracing-off "$OFF"

mkdir -p benchmarks/results
sluice-bench --compare "http://127.0.0.1:$OFF" "http://127.0.0.1:$DOWN" --labels tracing-off collector-down \
  --workload random --input-len 64 --output-len 32 --num-prompts 16 --concurrency 1,4 --warmup 2 --seed 7 \
  --no-progress --out benchmarks/results/tracing-overhead.json "$@"
grep -c "cannot export traces" "$TMP/collector-down.log" | sed 's/^/router export warnings: /'
grep -c "trace export problem" "$TMP/collector-down.log" | sed 's/^/shard export warnings: /'
