#!/usr/bin/env bash
# On a GPU machine: serve a tiny Kimi-K2.5 NVFP4 checkpoint (published 512+64 MLA layout, so
# the Triton MLA, fused-MoE and cache kernels run) over HTTP and measure it with moeserve bench.
# Usage: benchmarks/gpu_serve_smoke.sh OUT_DIR [TAG [SERVE_ARGS...]]
#   e.g. benchmarks/gpu_serve_smoke.sh out eager --enforce-eager   (files get the TAG suffix)
set -euo pipefail
out=${1:?OUT_DIR}
tag=${2:+_$2}
shift $(( $# < 2 ? $# : 2 ))
port=${PORT:-8500}
base="http://127.0.0.1:$port"
ckpt=$(mktemp -d)/kimi
python3 - "$ckpt" <<'PY'
import sys
from moeserve.testing.checkpoints import KERNEL_SHAPE, write_checkpoint
write_checkpoint(sys.argv[1], "kimi-k2.5", "nvfp4-modelopt", shape=KERNEL_SHAPE, seed=1)
PY
python3 -m moeserve.cli serve "$ckpt" --port "$port" --max-model-len 2048 \
  --reasoning-parser kimi_k2 --tool-call-parser kimi_k2 "$@" > "$out/gpu_serve$tag.log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null; wait "$server" 2>/dev/null || true' EXIT
python3 - "$base" <<'PY'
import sys, time, httpx
for _ in range(240):
    try:
        if httpx.get(sys.argv[1] + "/health", timeout=1).status_code == 200:
            break
    except httpx.HTTPError:
        pass
    time.sleep(0.5)
r = httpx.post(sys.argv[1] + "/v1/chat/completions", timeout=60, json={
    "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16, "temperature": 0})
print(r.status_code, r.json()["usage"], r.json()["choices"][0]["finish_reason"])
PY
bench=(python3 -m moeserve.cli bench --base-url "$base" --no-progress)
"${bench[@]}" --scenario count-to-50 --save-result "$out/gpu_count_to_50$tag.json" | tee "$out/gpu_count_to_50$tag.txt"
"${bench[@]}" --sweep concurrency=1,4,16 --input-len 64 --output-len 64 --num-prompts 16 \
  --ignore-eos --save-result "$out/gpu_sweep$tag.json" | tee "$out/gpu_sweep$tag.txt"
