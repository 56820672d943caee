#!/usr/bin/env bash
# Issue 6 on nvidia-h200-x2 (after the GPU stage is installed: torch 2.11, transformers on the
# path), ~7-8 minutes: trainer MFU matrix of benchmarks/trainer_mfu.py.
#   1. GPU 0: Qwen3-0.6B shape, 8k packed tokens per micro-batch, variants eager / compile /
#      compile+bf16params, K = 1 and 4 micro-batches per optimizer step, profile summaries
#   2. GPU 1 (at the same time): Qwen3-4B shape, compile, K = 1 and 4
#   3. both GPUs: small Qwen3-MoE shape with EP=2 (torch._grouped_mm experts), eager / compile
#   4. both GPUs: one 32k-token sequence with CP=2 (Ulysses), eager / compile
# Each command runs under `timeout`; a failed one does not stop the next. Files under OUT (8):
# mfu_{0.6b,4b,moe_ep2,cp2}.{log,json}; stdout ends with every command's final table.
# Usage: bash benchmarks/gpu_mfu.sh OUT_DIR
set -uo pipefail
OUT=${1:?output dir}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/rlcore-inductor-cache}
B=benchmarks/trainer_mfu.py
start=$SECONDS
stamp() { echo "[gpu_mfu +$((SECONDS - start))s] $*"; }

stamp "0.6B matrix (GPU 0) and 4B row (GPU 1)"
CUDA_VISIBLE_DEVICES=0 timeout -k 10 270 python $B --shape qwen3-0.6b --tokens 8192 \
  --variants eager,compile,compile+bf16params --micro-batches 1,4 --steps 8 --warmup 2 --profile \
  --out "$OUT/mfu_0.6b.json" > "$OUT/mfu_0.6b.log" 2>&1 &
p1=$!
CUDA_VISIBLE_DEVICES=1 timeout -k 10 270 python $B --shape qwen3-4b --tokens 8192 \
  --variants compile --micro-batches 1,4 --steps 4 --warmup 2 --profile \
  --out "$OUT/mfu_4b.json" > "$OUT/mfu_4b.log" 2>&1 &
p2=$!
wait $p1; echo "exit code: $?" >> "$OUT/mfu_0.6b.log"
wait $p2; echo "exit code: $?" >> "$OUT/mfu_4b.log"

stamp "MoE EP=2"
timeout -k 10 110 torchrun --standalone --nproc_per_node 2 $B --shape qwen3-moe-small --ep 2 --tokens 8192 \
  --variants eager,compile --micro-batches 1,4 --steps 5 --warmup 2 --profile \
  --out "$OUT/mfu_moe_ep2.json" > "$OUT/mfu_moe_ep2.log" 2>&1
echo "exit code: $?" >> "$OUT/mfu_moe_ep2.log"

stamp "CP=2, one 32k-token sequence"
timeout -k 10 110 torchrun --standalone --nproc_per_node 2 $B --tokens 32768 --sample-len 32768 --cp 2 \
  --variants eager,compile --micro-batches 1,4 --steps 4 --warmup 2 \
  --out "$OUT/mfu_cp2.json" > "$OUT/mfu_cp2.log" 2>&1
echo "exit code: $?" >> "$OUT/mfu_cp2.log"

stamp "done"
for f in mfu_0.6b mfu_4b mfu_moe_ep2 mfu_cp2; do
  echo
  echo "=================== $f"
  # (full profile tables are in the log files; stdout keeps the headline of each)
  grep -E "^trainer_mfu:|^-- profile|kernel classes|Error|error:" "$OUT/$f.log" | grep -v -i -e warning | tail -n 30
  sed -n '/^variant  *K  *step_s/,$p' "$OUT/$f.log"  # the final table (and the exit code)
  tail -n 1 "$OUT/$f.log"
done
