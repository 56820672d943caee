#!/usr/bin/env bash
# On nvidia-h200-x2 (after the GPU stage is installed): async RL end to end through
# `python -m rlcore.run` with the trainer on GPU 0 and a vLLM engine on GPU 1 (random-weight
# Qwen3-0.6B-shaped model, character vocabulary), then async vs sync on the same setup.
# Usage: bash benchmarks/gpu_e2e.sh OUT_DIR
set -uo pipefail
OUT=${1:?output dir}
mkdir -p "$OUT"
M="model=qwen3_06b_char"
G="trainer.gpus_per_rank=1 trainer.cpus_per_rank=4 rollout.engine=vllm rollout.gpus_per_actor=1
   rollout.cpus_per_actor=4 +rollout.vllm.engine_kwargs.enforce_eager=true
   +rollout.vllm.engine_kwargs.gpu_memory_utilization=0.6 +rollout.vllm.engine_kwargs.max_model_len=1024
   trainer.lr=1e-4 checkpoint.save_final=false sft.warmup_steps=0"
W=/tmp/rlcore-gpu
python -m rlcore.run steps=8 algo.max_off_policy_steps=1 output_dir=$W/e2e $M $G logger.console=false \
  2>&1 | grep -v -e FutureWarning -e forward_call > "$OUT/e2e.log"
echo "e2e exit: $?" >> "$OUT/e2e.log"
cp $W/e2e/metrics.jsonl "$OUT/e2e_metrics.jsonl" 2>/dev/null
python benchmarks/async_vs_sync.py --steps 12 --warmup 3 --off-policy 0 2 --out $W/avs -- $M $G \
  rollout.sampling.max_new_tokens=256 2>&1 | tee "$OUT/async_vs_sync.log"
for k in 0 2; do cp $W/avs/off$k/metrics.jsonl "$OUT/avs_off${k}_metrics.jsonl" 2>/dev/null; done
