#!/usr/bin/env bash
# The GPU run in one device call: kernel + engine GPU tests, kernel microbenchmarks, end-to-end
# benchmarks (specserve with and without CUDA graphs, HF generate peer, copy bandwidth) and the
# triton/torch agreement on the real default model. Logs and JSON go to ${OUT:-bench/results/gpu}.
# Usage (repository root, GPU machine): bash bench/gpu_suite.sh [path/to/SmolLM2-135M-Instruct.Q4_1.gguf]
set -uo pipefail
out=${OUT:-bench/results/gpu}
mkdir -p "$out"
[ -e specserve/kernels ] || ln -s ../kernels specserve/kernels   # what `pip install` maps, without installing
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
step() { local name=$1; shift; echo "== $name: $*"; local t0=$SECONDS
  timeout "${STEP_TIMEOUT:-300}" "$@" > "$out/$name.log" 2>&1; local rc=$?
  echo "   rc=$rc in $((SECONDS - t0))s"; tail -n 4 "$out/$name.log"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
step tests $py -m pytest tests/engine/test_gpu_backend.py tests/engine/test_async_scheduling.py tests/kernels -q -x \
  -p no:cacheprovider
step bandwidth $py bench/gpu_e2e.py bandwidth --out "$out/e2e_bandwidth.json"
step e2e_graphs $py bench/gpu_e2e.py specserve --out "$out/e2e_specserve.json"
step e2e_sync $py bench/gpu_e2e.py specserve --no-async-scheduling --repeats 1 --out "$out/e2e_specserve_sync.json"
step step_profile $py bench/step_profile.py --load-format dummy --requests 1 256 --out "$out/step_profile.json"
[ -n "${SKIP_EAGER:-}" ] || step e2e_eager $py bench/gpu_e2e.py specserve --enforce-eager --repeats 1 \
  --out "$out/e2e_specserve_eager.json"
step e2e_hf $py bench/gpu_e2e.py hf --hf-batches 256 1 --out "$out/e2e_hf.json"
if [ -n "${1:-}" ]; then
  step agreement $py bench/gpu_agreement.py --model "$1" --out "$out/agreement.json"
fi
step kernels $py bench/kernel_bench.py --out "$out/kernels_gpu.json"
