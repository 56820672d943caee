#!/usr/bin/env bash
# On nvidia-h200 (one GPU, after the GPU stage is installed): colocated placement through
# `python -m rlcore.run`: the GPU test, then samples/s of sync (resident, and asleep with
# sleep_level=2) against async (max_off_policy_steps 1, 2) for the Qwen3-0.6B shape, then IPC sync
# time and memory for the Qwen3-4B shape. Usage: bash benchmarks/gpu_colocated.sh OUT_DIR [PARTS]
# PARTS: any of test, avs, sleep, 4b (default: all four). TEST_K picks the GPU tests (default: the
# async one; the sleep part runs the sleep schedule through the CLI). AVS_OFF: the
# max_off_policy_steps values of the avs part (default "0 1 2"), one CLI run each. EAGER=false
# runs the engine with CUDA graphs (start-up compiles for a minute or two); AVS_TOKENS sets
# max_new_tokens of the avs and sleep parts (default 256). AVS_REPS: repetitions of the avs set,
# interleaved (default 1); AVS_EXTRA: more overrides for the avs runs; AVS_TAG: a name for this
# avs set's output folders (several sets in one call). MPS=1 runs every part under a CUDA MPS
# control daemon of this call's own (pipe and log directories under /tmp, stopped at exit; the
# GPU's compute mode is left as it is): the trainer's and the engine's kernels may then run at
# once instead of time-slicing the GPU (issue 43: overlapped, each ran 30-60% slower); with
# MPS_ENGINE_PCT=P the engine's processes may use at most P% of the SMs (rollout.env_vars:
# CUDA_MPS_ACTIVE_THREAD_PERCENTAGE), the trainer all. The avs and sleep parts generate every
# completion to max_new_tokens (ignore_eos: the same work in every run; AVS_FIXED=0: stop at EOS).
# PROFILE_STEPS="7,9" records those steps of every avs run (profile.steps): each run's timeline
# summary goes to OUT/timeline_TAG.txt, and the trainer's and engine's traces of the last
# max_off_policy_steps value to OUT (open them, or the merged timeline, in ui.perfetto.dev).
set -uo pipefail
OUT=${1:?output dir}; PARTS=${2:-"test avs sleep 4b"}
mkdir -p "$OUT"
if [[ ${MPS:-0} == 1 ]]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/rlcore-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/rlcore-mps/log
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  nvidia-cuda-mps-control -d || { echo "MPS: the control daemon did not start" | tee "$OUT/mps.log"; exit 1; }
  trap 'echo quit | nvidia-cuda-mps-control; cp $CUDA_MPS_LOG_DIRECTORY/*.log "$OUT/" 2>/dev/null' EXIT
  echo "MPS: control daemon started" | tee "$OUT/mps.log"
fi
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
G="model=qwen3_06b_char rollout.engine=vllm trainer.gpus_per_rank=1 rollout.gpus_per_actor=1 cluster.num_gpus=1
   trainer.cpus_per_rank=4 rollout.cpus_per_actor=4 +rollout.vllm.engine_kwargs.enforce_eager=${EAGER:-true}
   +rollout.vllm.engine_kwargs.max_model_len=1024 trainer.lr=1e-4 checkpoint.save_final=false sft.warmup_steps=0"
[[ ${AVS_FIXED:-1} == 1 ]] && G="$G +rollout.vllm.sampling_kwargs.ignore_eos=true"
[[ -n ${PROFILE_STEPS:-} ]] && G="$G profile.steps=[$PROFILE_STEPS]"
[[ -n ${MPS_ENGINE_PCT:-} ]] && G="$G +rollout.env_vars.CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$MPS_ENGINE_PCT"
W=/tmp/rlcore-colocated; mkdir -p $W
if [[ $PARTS == *test* ]]; then
  timeout 300 python -m pytest -m gpu tests/gpu/test_colocated.py -k "${TEST_K:-async}" -x -v -s \
    -p no:cacheprovider --basetemp=$W/pytest > "$OUT/test.log" 2>&1
  for f in $W/pytest/*/*/metrics.jsonl; do cp "$f" "$OUT/test_$(basename $(dirname $f)).jsonl" 2>/dev/null; done
  echo "test exit: $?" | tee -a "$OUT/test.log"
  grep -q " passed" "$OUT/test.log" || exit 1
fi
if [[ $PARTS == *avs* ]]; then
  A="--steps ${AVS_STEPS:-6} --warmup 2 --reps ${AVS_REPS:-1} --timeout ${AVS_TIMEOUT:-300} --out $W/avs${AVS_TAG:-}"
  # shellcheck disable=SC2086
  python benchmarks/async_vs_sync.py $A --off-policy ${AVS_OFF:-0 1 2} -- $G rollout.sampling.max_new_tokens=${AVS_TOKENS:-256} \
    ${AVS_EXTRA:-} 2>&1 | tee "$OUT/avs${AVS_TAG:-}.log"
  ( cd $W/avs${AVS_TAG:-} && find . -name metrics.jsonl | while read -r f; do
      d=$(dirname "${f#./}"); cp "$f" "$OUT/avs${AVS_TAG:-}_${d//\//_}.jsonl"; done )
  if [[ -n ${PROFILE_STEPS:-} ]]; then
    for d in $(find $W/avs${AVS_TAG:-} -name windows.jsonl | sort); do
      run=$(dirname "$(dirname "$d")"); echo "== ${run#$W/}" >> "$OUT/timeline${AVS_TAG:-}.txt"
      python -m rlcore.timeline "$run" >> "$OUT/timeline${AVS_TAG:-}.txt" 2>&1
      last=$run
    done
    for s in trainer0 engine0; do  # the last run's traces (largest first out if over the size limit)
      f=$(ls -S "$last/profile/$s"/*.json.gz 2>/dev/null | tail -1); [[ -n $f ]] && cp "$f" "$OUT/trace_$s.json.gz"
    done
  fi
fi
if [[ $PARTS == *sleep* ]]; then
  python benchmarks/async_vs_sync.py --steps "${AVS_STEPS:-6}" --warmup 2 --timeout "${AVS_TIMEOUT:-300}" --out $W/avs/sleep \
    --off-policy 0 -- $G rollout.sampling.max_new_tokens=${AVS_TOKENS:-256} rollout.vllm.sleep_level=2 2>&1 | tee "$OUT/avs_sleep.log"
  cp $W/avs/sleep/off0/metrics.jsonl "$OUT/avs_sleep_off0.jsonl" 2>/dev/null
fi
if [[ $PARTS == *4b* ]]; then
  S4="model.arch.hidden_size=2560 model.arch.intermediate_size=9728 model.arch.num_hidden_layers=36
      model.arch.num_attention_heads=32 model.arch.num_key_value_heads=8"
  timeout 200 python -m rlcore.run steps=4 algo.max_off_policy_steps=1 output_dir=$W/4b $G $S4 \
    logger.console=false rollout.sampling.max_new_tokens=64 > "$OUT/4b.log" 2>&1
  echo "4b exit: $?" >> "$OUT/4b.log"
  cp $W/4b/metrics.jsonl "$OUT/4b.jsonl" 2>/dev/null
fi
