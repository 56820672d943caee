#!/usr/bin/env bash
# On one GPU (after the GPU stage is installed): each model family's tiny random config
# (conf/model/tiny_*.yaml) trains a few RL steps through `python -m rlcore.run` with a vLLM engine
# colocated on the GPU: vLLM serves it, the weights sync (the canary calibrates on the first sync
# and holds after), and for the routed-expert families rollout routing replay is on
# (moe_replay_agreement: 1.0 = the trainer routed every replayed token where vLLM did).
# Synchronous schedule (algo.max_off_policy_steps=0), so engine_mismatch_kl compares equal weights.
# Prints one line per family: exit code, steps, canary, replay agreement, mismatch KL.
# Usage: bash benchmarks/gpu_families.sh OUT_DIR   (FAMILIES="a b" picks conf/model names; STEPS=3;
# EXTRA="key=value ..." adds overrides to every run)
set -uo pipefail
OUT=${1:?output dir}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TOKENIZERS_PARALLELISM=false
MOE="tiny_glm4_moe_char tiny_deepseek_v3_char tiny_gpt_oss_char tiny_mixtral_char tiny_moe_char"
HYBRID="tiny_qwen3_next tiny_nemotron_h"
VISION="tiny_qwen3_vl tiny_qwen3_vl_moe tiny_qwen3_5 tiny_qwen3_5_moe"
FAMILIES=${FAMILIES:-"$MOE $HYBRID $VISION"}
G="rollout.engine=vllm trainer.gpus_per_rank=1 rollout.gpus_per_actor=1 cluster.num_gpus=1
   trainer.cpus_per_rank=4 rollout.cpus_per_actor=4 +rollout.vllm.engine_kwargs.enforce_eager=true
   +rollout.vllm.engine_kwargs.max_model_len=256 trainer.lr=1e-4 checkpoint.save_final=false sft.warmup_steps=0
   algo.max_off_policy_steps=0 algo.batch_groups=4 logger.console=false"
W=/tmp/rlcore-families; mkdir -p $W
start=$SECONDS
report() {  # NAME RC METRICS LOG: one line
  python - "$@" <<'PY'
import json, sys
m, rc, path, log = sys.argv[1:]
rows = []
try:
    rows = [json.loads(line) for line in open(path)]
except OSError:
    pass
def mean(key):
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return f"{sum(vals) / len(vals):.4g}" if vals else "-"
err = ""
if rc != "0":
    lines = [ln.strip() for ln in open(log, errors="replace") if "error" in ln.lower()]
    err = (lines[-1] if lines else "")[:240]
print(f"{m}: exit {rc}, steps {len(rows)}, canary mean gap max {max([r.get('canary_mean_gap', 0) for r in rows] or [0]):.4f}"
      f" (limit {mean('canary_mean_limit')}), replay agreement {mean('moe_replay_agreement')}, "
      f"engine_mismatch_kl {mean('engine_mismatch_kl')} {err}")
PY
}
run() {  # MODEL NAME EXTRA...: one run of the family, its log in $OUT/NAME.log; returns its exit code
  local m=$1 name=$2; shift 2
  rm -rf "$W/$name"
  timeout -k 10 "${RUN_S:-150}" python -m rlcore.run model="$m" steps="${STEPS:-3}" output_dir="$W/$name" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  report "$name" "$rc" "$W/$name/metrics.jsonl" "$OUT/$name.log"
  return $rc
}
for m in $FAMILIES; do
  [ -f "conf/model/$m.yaml" ] || { echo "$m: no conf/model/$m.yaml"; continue; }
  replay=""
  case " $MOE tiny_qwen3_next tiny_qwen3_vl_moe tiny_qwen3_5_moe " in *" $m "*) replay="rollout.vllm.routing_replay=true";; esac
  vision=""
  # Qwen3-VL / Qwen3.5 patches are 16 px merged 2x2: images a multiple of 32, at least 64 x 64
  case " $VISION " in *" $m "*) vision="+recipe=shape_count env.args.image_size=64 env.args.cell=16";; esac
  # shellcheck disable=SC2086  # G, vision and EXTRA are word lists on purpose
  if ! run "$m" "$m" $G $vision $replay ${EXTRA:-} && [ -n "$replay" ]; then
    # say whether replay or the family failed
    run "$m" "$m-noreplay" $G $vision ${EXTRA:-}
  fi
  echo "[gpu_families +$((SECONDS - start))s] $m done"
done
