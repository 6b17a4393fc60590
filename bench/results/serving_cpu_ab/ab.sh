#!/bin/bash
# CPU serving A/B: the engine before this change (A, /tmp/old) vs now (B), same client, interleaved
cd /work/main
for round in 1 2 3; do
  for side in A B; do
    port=$(python -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])")
    if [ $side = A ]; then dir=/tmp/old; pp=/tmp/old; else dir=/work/main; pp=/work/main; fi
    (cd $dir && OMP_NUM_THREADS=1 PYTHONPATH=$pp exec python -m specserve.cli serve --config configs/cpu-default.yaml --port $port > /tmp/ab_server_$side$round.log 2>&1) &
    spid=$!
    for i in $(seq 120); do curl -sf localhost:$port/health >/dev/null && break; sleep 1; done
    OMP_NUM_THREADS=1 python bench/serving.py --url ws://127.0.0.1:$port/v1/ws --concurrency 1 8 --num-prompts 8 32 --max-tokens 32 --out /tmp/ab_$side$round.json > /tmp/ab_$side$round.log 2>&1
    kill -INT $spid; wait $spid
  done
done
echo done
