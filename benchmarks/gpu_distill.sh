#!/usr/bin/env bash
# On nvidia-h200 (one GPU, after the GPU stage is installed, see gpu/README.md): on-policy
# distillation through `python -m rlcore.run` with a vLLM teacher, everything on the one GPU:
# colocated placement (trainer rank + the student's vLLM engine, 0.4 of the GPU each in Ray's
# bookkeeping) and the vLLM teacher beside them (0.2, gpu_memory_utilization 0.15); the memory
# plan gives the student engine what is left. The lent machines have no hub access, so both models are
# random-weight Qwen3 shapes over the character vocabulary: student Qwen3-0.6B-shaped
# (model=qwen3_06b_char), teacher Qwen3-4B-shaped (vLLM dummy weights, never synced). The student
# then distils towards that fixed random teacher: teacher_kl should fall step by step; the figures
# to record are teacher_kl, teacher_latency_s, teacher_busy_frac, step_time_s, samples_failed.
# Usage: bash benchmarks/gpu_distill.sh OUT_DIR
set -uo pipefail
OUT=${1:?output dir}
mkdir -p "$OUT"
W=/tmp/rlcore-gpu
python -m rlcore.run steps=12 output_dir=$W/distill model=qwen3_06b_char sft.warmup_steps=0 \
  trainer.gpus_per_rank=1 trainer.cpus_per_rank=4 trainer.lr=1e-5 cluster.num_gpus=1 \
  rollout.engine=vllm rollout.gpus_per_actor=1 rollout.cpus_per_actor=4 \
  +rollout.vllm.engine_kwargs.max_model_len=1024 +rollout.vllm.engine_kwargs.enforce_eager=true \
  rollout.sampling.max_new_tokens=256 \
  teacher.enabled=true teacher.engine=vllm teacher.gpus_per_actor=0.2 teacher.cpus_per_actor=4 \
  teacher.dtype=bfloat16 +teacher.vllm.engine_kwargs.gpu_memory_utilization=0.15 \
  +teacher.vllm.engine_kwargs.max_model_len=1024 +teacher.vllm.engine_kwargs.enforce_eager=true \
  '+teacher.arch={model_type: qwen3, hidden_size: 2560, intermediate_size: 9728, num_hidden_layers: 36, num_attention_heads: 32, num_key_value_heads: 8, head_dim: 128, max_position_embeddings: 2048, tie_word_embeddings: true}' \
  teacher.kl_coef=1.0 teacher.reward_coef=0.0 \
  checkpoint.save_final=false logger.console=false 2>&1 | grep -v -e FutureWarning -e forward_call > "$OUT/distill.log"
echo "distill exit: ${PIPESTATUS[0]}" >> "$OUT/distill.log"
cp $W/distill/metrics.jsonl "$OUT/distill_metrics.jsonl" 2>/dev/null
python - "$OUT/distill_metrics.jsonl" <<'PY' | tee "$OUT/distill_summary.txt"
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(" ".join(f"{k}={r.get(k) if not isinstance(r.get(k), float) else round(r[k], 4)}" for k in
          ("step", "teacher_kl", "reward_mean", "teacher_latency_s", "teacher_busy_frac", "step_time_s",
           "samples_failed", "samples_at_teacher")))
PY
