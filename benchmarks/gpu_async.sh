#!/usr/bin/env bash
# Async vs sync on nvidia-h200-x2 through `python -m rlcore.run`: trainer (FSDP2) on GPU 0, one
# vLLM engine (CUDA graphs on) on GPU 1, random-weight Qwen3-0.6B-shaped policy over the
# character vocabulary, reverse_text, GRPO 16 groups x 8 samples per step, 256 new tokens.
# LR sets trainer.lr (default 1e-5; a tiny one keeps the random policy's lengths steady).
# PAD=N prefixes every prompt with an N-character instruction: it adds N trained tokens per
# sample but only prefill work to generation, which balances trainer and rollout time (the two
# pools must be about equally loaded for overlap to pay off).
# RUN_TIMEOUT (s per run, default 420): a fresh machine spends ~125 s starting the engine alone
# (vLLM compile and CUDA graph capture), plus Ray and the trainer.
# Usage: [PAD=N] [LR=x] [STEPS=n] [WARMUP=n] [OFF='0 1'] [RUN_TIMEOUT=s] bash benchmarks/gpu_async.sh OUT_DIR [extra overrides for both runs]
set -uo pipefail
OUT=${1:?output dir}
shift
mkdir -p "$OUT"
M="model=qwen3_06b_char model.arch.max_position_embeddings=4096"
G="trainer.gpus_per_rank=1 trainer.cpus_per_rank=4 rollout.engine=vllm rollout.gpus_per_actor=1
   rollout.cpus_per_actor=4 +rollout.vllm.engine_kwargs.gpu_memory_utilization=0.6
   +rollout.vllm.engine_kwargs.max_model_len=2048 rollout.tasks_per_request=8 rollout.max_requests_per_actor=8
   algo.batch_groups=16 algo.group_size=8 trainer.micro_batch_tokens=16384 trainer.lr=${LR:-1e-5}
   checkpoint.save_final=false sft.warmup_steps=0 rollout.sampling.max_new_tokens=256"
PAD_ARG=()
if [ "${PAD:-0}" -gt 0 ]; then PAD_ARG=("+env.args.instruction=$(head -c "$PAD" /dev/zero | tr '\0' x)"); fi
# shellcheck disable=SC2086
python benchmarks/async_vs_sync.py --steps "${STEPS:-14}" --warmup "${WARMUP:-4}" --off-policy ${OFF:-0 1} \
  --timeout "${RUN_TIMEOUT:-420}" --out /tmp/rlcore-avs -- $M $G "${PAD_ARG[@]}" "$@" 2>&1 | tee "$OUT/async_vs_sync.log"
for d in /tmp/rlcore-avs/off*; do
  [ -f "$d/metrics.jsonl" ] && cat "$d/metrics.jsonl" > "$OUT/avs_$(basename "$d").jsonl"
done
