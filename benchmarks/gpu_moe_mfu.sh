#!/usr/bin/env bash
# On nvidia-h200 (one GPU, after the GPU stage is installed: torch 2.11, transformers on the path),
# ~2-3 minutes: trainer MFU of the qwen3-moe-small shape (Qwen3-30B-A3B's layer at half width, 64
# experts, top-8; torch._grouped_mm experts, EP=1) through benchmarks/trainer_mfu.py, eager and
# compile, K = 1 and 4 micro-batches of 8k packed tokens per optimizer step, with one profiled step
# per variant summarised (kernel classes, top CUDA kernels, GPU idle gaps, top CPU ops: where the
# router, the permutation and the experts' time goes). Files under OUT: mfu_moe.{log,json}
# (TRACES=1 also writes a chrome trace per variant under OUT/traces). Usage: bash benchmarks/gpu_moe_mfu.sh OUT_DIR
set -uo pipefail
OUT=${1:?output dir}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/rlcore-inductor-cache}
start=$SECONDS
echo "[gpu_moe_mfu +0s] qwen3-moe-small, one GPU"
CUDA_VISIBLE_DEVICES=0 timeout -k 10 240 python benchmarks/trainer_mfu.py --shape qwen3-moe-small --tokens 8192 \
  --variants "${VARIANTS:-eager,compile}" --micro-batches 1,4 --steps 5 --warmup 2 --profile --profile-top 16 \
  ${TRACES:+--trace-dir "$OUT/traces"} --out "$OUT/mfu_moe.json" > "$OUT/mfu_moe.log" 2>&1
echo "exit code: $?" >> "$OUT/mfu_moe.log"
echo "[gpu_moe_mfu +$((SECONDS - start))s] done"
# the profile summaries, then the final table (and the exit code)
sed -n '/^-- profile/,/^$/p' "$OUT/mfu_moe.log" | head -n 120
grep -E "Error|error:" "$OUT/mfu_moe.log" | grep -v -i warning | tail -n 5
sed -n '/^variant  *K  *step_s/,$p' "$OUT/mfu_moe.log"
tail -n 1 "$OUT/mfu_moe.log"
