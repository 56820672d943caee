#!/usr/bin/env bash
# On a GPU machine with vLLM (nvidia-h200-x2: trainer on GPU 0, vLLM engine on GPU 1): the GPU
# VLM test, then a few RL steps of the shape_count recipe (random-weight Qwen2.5-VL-shaped policy,
# image prompts) through `python -m rlcore.run` with rollout.engine=vllm.
# The test needs one GPU (CUDA_VISIBLE_DEVICES picks it), the RL run two. Limits allow for a fresh
# machine's first vLLM start.
# Usage: bash benchmarks/gpu_vlm.sh OUT_DIR [test|rl|all]
set -uo pipefail
OUT=${1:?output dir}
PART=${2:-all}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-}
if [ "$PART" = test ] || [ "$PART" = all ]; then
  timeout 240 python -m pytest -m gpu tests/gpu/test_vllm_vlm.py -v -p no:cacheprovider > "$OUT/test_vlm.log" 2>&1
  echo "test_vlm exit: $?" >> "$OUT/test_vlm.log"
  tail -n 3 "$OUT/test_vlm.log"
fi
[ "$PART" = test ] && exit 0
M="model.arch.text_config.hidden_size=512 model.arch.text_config.intermediate_size=1024
   model.arch.text_config.num_hidden_layers=4 model.arch.text_config.num_attention_heads=8
   model.arch.text_config.num_key_value_heads=4 model.arch.text_config.rope_scaling.mrope_section=[8,12,12]
   model.arch.vision_config.out_hidden_size=512 model.arch.vision_config.hidden_size=256
   model.arch.vision_config.num_heads=4"
G="trainer.gpus_per_rank=1 trainer.cpus_per_rank=4 rollout.engine=vllm rollout.gpus_per_actor=1
   rollout.cpus_per_actor=4 +rollout.vllm.engine_kwargs.enforce_eager=true
   +rollout.vllm.engine_kwargs.gpu_memory_utilization=0.5 +rollout.vllm.engine_kwargs.max_model_len=512
   trainer.lr=1e-4 checkpoint.save_final=false"
W=/tmp/rlcore-gpu-vlm
rm -rf "$W"
# shellcheck disable=SC2086  # M and G are word lists on purpose
timeout 280 python -m rlcore.run +recipe=shape_count steps=6 sft.warmup_steps=5 output_dir=$W/rl $M $G \
  logger.console=false > "$OUT/rl.log" 2>&1
echo "rl exit: $?" >> "$OUT/rl.log"
cp "$W/rl/metrics.jsonl" "$OUT/rl_metrics.jsonl" 2>/dev/null
tail -n 3 "$OUT/rl.log"
