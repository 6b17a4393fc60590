#!/usr/bin/env bash
# GPU serving suite (dummy Llama-3.1-8B, bf16, one H200): the offline engine with no flags and tuned,
# and `specserve serve` with no tuning flags over WebSockets and SSE at 1/16/64/256 users, with the
# offline engine on the same workload as the reference. Results and logs go to $OUT (default ./out).
#
#   bash bench/gpu_serving.sh offline   # gpu_e2e: LLM() defaults, tuned 8192 and 16384 token budgets
#   bash bench/gpu_serving.sh noflags   # gpu_e2e with LLM()'s defaults only
#   bash bench/gpu_serving.sh ws        # serving over WebSockets (+ the offline reference at 256 users)
#   bash bench/gpu_serving.sh sse       # serving over OpenAI SSE (+ the offline reference at 256 users)
#   bash bench/gpu_serving.sh multi     # 256 users with --api-server-count 2, ws and sse
#   VLLM_SITE=/tmp/vsite bash bench/gpu_serving.sh vllm   # vLLM's LLM (offline) and `vllm serve` over SSE
#
# Workload everywhere: 128 random prompt tokens, 256 new tokens (ignore_eos), greedy; served runs:
# each user sends 2 requests one after the other; 4 client processes.
set -uo pipefail
OUT=${OUT:-out}
PY=${PY:-python3}
mkdir -p "$OUT"
M=llama-3.1-8b
SERVE="$M --load-format dummy"  # no tuning flags: what a user gets
LOAD="--prompt-tokens 128 --vocab-size 128256 --max-tokens 256 --requests-per-user 2 --client-procs 4"
serving() {  # protocol, tag, extra server flags
  # 64 users first, with no warm-up request: the first wave after /health said ready vs the second
  $PY bench/serving.py --model "" --server-args "$SERVE $3" --protocol "$1" $LOAD --no-warmup-request \
    --concurrency 64 1 16 --out "$OUT/serving_$2_small.json" > "$OUT/serving_$2_small.log" 2>&1
  $PY bench/serving.py --model "" --server-args "$SERVE $3" --protocol "$1" $LOAD \
    --concurrency 256 --offline --out "$OUT/serving_$2_256.json" > "$OUT/serving_$2_256.log" 2>&1
}
case "${1:-}" in
  offline)
    $PY bench/gpu_e2e.py specserve --no-flags --repeats 2 --out "$OUT/e2e_noflags.json" > "$OUT/e2e_noflags.log" 2>&1
    $PY bench/gpu_e2e.py specserve --repeats 2 --out "$OUT/e2e_8192.json" > "$OUT/e2e_8192.log" 2>&1
    $PY bench/gpu_e2e.py specserve --repeats 2 --max-num-batched-tokens 16384 \
      --out "$OUT/e2e_16384.json" > "$OUT/e2e_16384.log" 2>&1 ;;
  noflags)
    $PY bench/gpu_e2e.py specserve --no-flags --repeats 2 --out "$OUT/e2e_noflags.json" > "$OUT/e2e_noflags.log" 2>&1 ;;
  ws) serving ws ws "" ;;
  ws256)  # 256 users over WebSockets only (no offline reference)
    $PY bench/serving.py --model "" --server-args "$SERVE" --protocol ws $LOAD --concurrency 256 \
      --out "$OUT/serving_ws_256b.json" > "$OUT/serving_ws_256b.log" 2>&1 ;;
  diag)  # which of the no-flag settings makes the first batches after start-up slow
    $PY bench/gpu_e2e.py specserve --repeats 1 --max-model-len 131072 --gpu-memory-utilization 0.9 \
      --out "$OUT/diag_len.json" > "$OUT/diag_len.log" 2>&1
    $PY bench/gpu_e2e.py specserve --repeats 1 --enable-prefix-caching --out "$OUT/diag_prefix.json" \
      > "$OUT/diag_prefix.log" 2>&1 ;;
  sse) serving sse sse "" ;;
  multi)
    for proto in ws sse; do
      $PY bench/serving.py --model "" --server-args "$SERVE --api-server-count 2" --protocol $proto $LOAD \
        --concurrency 256 --out "$OUT/serving_${proto}_api2.json" > "$OUT/serving_${proto}_api2.log" 2>&1
    done ;;
  vllm)
    PYTHONPATH=$VLLM_SITE:${PYTHONPATH:-} $PY bench/gpu_e2e.py vllm --repeats 2 --out "$OUT/vllm_offline.json" \
      > "$OUT/vllm_offline.log" 2>&1
    dir=$(mktemp -d) && cp "configs/models/$M.json" "$dir/config.json"
    PYTHONPATH=$VLLM_SITE:${PYTHONPATH:-} $PY -m vllm.entrypoints.openai.api_server --model "$dir" \
      --served-model-name "$M" --load-format dummy --skip-tokenizer-init --dtype bfloat16 --port 8100 \
      --gpu-memory-utilization 0.85 > "$OUT/vllm_serve.log" 2>&1 &
    pid=$!
    # ready, or gone (not running and not a zombie the shell has yet to reap): no waiting on a dead server
    VLLM_PID=$pid $PY -c "import os, sys; from specserve.client import wait_until_ready
def alive():
    try:
        return open('/proc/%s/stat' % os.environ['VLLM_PID']).read().split(')')[-1].split()[0] != 'Z'
    except OSError:
        return False
sys.exit(0 if wait_until_ready('http://127.0.0.1:8100', 400, alive=alive) else 'vllm serve exited')" \
      && $PY bench/serving.py --url http://127.0.0.1:8100 --protocol sse $LOAD \
        --concurrency 256 --out "$OUT/vllm_serve_sse.json" > "$OUT/vllm_serve_sse.log" 2>&1
    kill -INT $pid
    for _ in $(seq 30); do kill -0 $pid 2>/dev/null || break; sleep 1; done
    pkill -9 -f vllm.entrypoints; wait ;;
  *) echo "usage: $0 offline|ws|sse|multi|vllm" >&2; exit 2 ;;
esac
