#!/usr/bin/env bash
# `moeserve bench` against moeserve's own CPU server on the default model:
# a concurrency sweep (JSON, table, PNG), the count-to-50 scenario and ShareGPT prompts.
# Usage: benchmarks/cpu_serving.sh [OUT_DIR] [extra `moeserve serve` flags...]
set -euo pipefail
out=${1:-benchmarks/results/bench_cpu}
shift || true
port=${PORT:-8321}
base="http://127.0.0.1:$port"
mkdir -p "$out"
moeserve serve --port "$port" "$@" > "$out/server.log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null; wait "$server" 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do curl -sf "$base/health" > /dev/null && break; sleep 1; done
common=(--base-url "$base" --no-progress)
moeserve bench "${common[@]}" --sweep concurrency=1,2,4,8 --input-len 128 --output-len 64 \
  --num-prompts 16 --warmup 1 --ignore-eos --save-result "$out/sweep.json" \
  --plot "$out/sweep.png" | tee "$out/sweep.txt"
moeserve bench "${common[@]}" --scenario count-to-50 --save-result "$out/count_to_50.json" \
  | tee "$out/count_to_50.txt"
moeserve bench "${common[@]}" --dataset sharegpt --num-prompts 16 --output-len 64 \
  --max-concurrency 4 --save-result "$out/sharegpt.json" | tee "$out/sharegpt.txt"
curl -s "$base/metrics" | grep -E '^moeserve_(generation|prompt)_tokens_total' \
  | tee "$out/server_counters_end.txt"
