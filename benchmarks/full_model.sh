#!/usr/bin/env bash
# The full-size run: Kimi-K2.5 NVFP4 (published config, random weights) served over HTTP
# with tensor (and expert) parallelism, measured by moeserve bench. Made for 8 GPUs of one
# host (nvidia-h200-x8); TP/LAYERS/SWEEP shrink it to what a smaller machine holds.
#
# Usage (repository root, server wheels installed):
#   benchmarks/full_model.sh OUT_DIR
# Environment (defaults in brackets):
#   TP [8]  LAYERS [61]  SWEEP [1,8,32,128,512]  DATASET [sharegpt]  NUM_PROMPTS [256]
#   PORT [8600]
#   CONFIGS ["ep nccl-ep tp"]: ep = -tp N --enable-expert-parallel (fused all-reduce auto),
#     nccl-ep = the same with --all-reduce nccl, tp = -tp N without expert parallel.
#     With TP=1 only "tp" makes sense.
#   START_TIMEOUT [1800] seconds for a server to answer /health (load + graph capture).
# For each configuration OUT_DIR/<name>/ gets: serve.log (start-up plan table, kernel choices,
# load time, and the --profile-decode table of the first 64 decode steps, which are the
# count-to-50 request's: batch 1), count_to_50.{txt,json}, sweep.{txt,json,png}; for the
# first configuration a second server records the profile at batch 64 (profile_b64/).
# Every process gets NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and
# NVSHMEM_DISABLE_NVLS=1: NVLink multicast is never used.
set -euo pipefail
out=${1:?OUT_DIR}
tp=${TP:-8}
layers=${LAYERS:-61}
sweep=${SWEEP:-1,8,32,128,512}
dataset=${DATASET:-sharegpt}
num_prompts=${NUM_PROMPTS:-256}
port=${PORT:-8600}
configs=${CONFIGS:-"ep nccl-ep tp"}
start_timeout=${START_TIMEOUT:-1800}
model=$(cd "$(dirname "$0")" && pwd)/configs/kimi-k2.5-nvfp4
base="http://127.0.0.1:$port"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$out"

flags_for() {  # configuration name -> serve flags
  case $1 in
    ep) echo "-tp $tp --enable-expert-parallel" ;;
    nccl-ep) echo "-tp $tp --enable-expert-parallel --all-reduce nccl" ;;
    tp) echo "-tp $tp" ;;
    *) echo "unknown configuration $1" >&2; exit 2 ;;
  esac
}

server=
stop_server() {
  if [ -n "$server" ]; then
    kill "$server" 2>/dev/null || true
    timeout 120 tail --pid="$server" -f /dev/null || kill -9 "$server" 2>/dev/null || true
    server=
  fi
}
trap stop_server EXIT

start_server() {  # dir, extra flags...
  local dir=$1
  shift
  mkdir -p "$dir"
  # shellcheck disable=SC2068
  timeout $((start_timeout + 7200)) python3 -m moeserve.cli serve "$model" --load-format dummy \
    --num-layers "$layers" --port "$port" $@ > "$dir/serve.log" 2>&1 &
  server=$!
  python3 - "$base" "$start_timeout" "$server" <<'PY'
import os, sys, time, httpx
base, limit, pid = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
t0 = time.time()
while time.time() - t0 < limit:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("the server exited during start-up (see serve.log)")
    try:
        if httpx.get(base + "/health", timeout=2).status_code == 200:
            print(f"server up after {time.time() - t0:.0f} s", flush=True)
            sys.exit(0)
    except httpx.HTTPError:
        pass
    time.sleep(2)
sys.exit("the server did not answer /health in time")
PY
}

bench=(python3 -m moeserve.cli bench --base-url "$base" --no-progress)
first=1
for name in $configs; do
  dir=$out/$name
  # shellcheck disable=SC2046
  start_server "$dir" $(flags_for "$name") --profile-decode 64
  "${bench[@]}" --scenario count-to-50 --save-result "$dir/count_to_50.json" | tee "$dir/count_to_50.txt"
  "${bench[@]}" --dataset "$dataset" --sweep "concurrency=$sweep" --num-prompts "$num_prompts" \
    --save-result "$dir/sweep.json" --plot "$dir/sweep.png" | tee "$dir/sweep.txt"
  stop_server
  if [ "$first" = 1 ]; then  # the decode profile at batch 64 (first 64 decode steps)
    # shellcheck disable=SC2046
    start_server "$dir/profile_b64" $(flags_for "$name") --profile-decode 64
    "${bench[@]}" --input-len 256 --output-len 256 --ignore-eos --num-prompts 64 \
      --max-concurrency 64 --warmup 0 | tee "$dir/profile_b64/bench.txt"
    stop_server
    first=0
  fi
done
grep -h -A16 "decode profile" "$out"/*/serve.log "$out"/*/profile_b64/serve.log > "$out/profiles.txt" || true
echo "results in $out"
