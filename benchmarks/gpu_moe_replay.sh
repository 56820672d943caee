#!/usr/bin/env bash
# On nvidia-h200 (one GPU, after the GPU stage is installed), ~5-6 minutes: rollout routing replay
# (issue 32). 1. the GPU test: vLLM's routed experts per token have the rows rlcore.batch.routing
# documents and the replayed trainer forward uses exactly them (prints the engine-vs-trainer
# logprob gap with and without replay); 2. a Qwen3-MoE shape (model=qwen3_moe_char: 8 layers, 64
# experts, top-8) trains through `python -m rlcore.run` colocated with vLLM, synchronous schedule
# (algo.max_off_policy_steps=0: mismatch_kl then compares the same weights on both sides), replay
# off and on; prints per run the means of mismatch_kl, mismatch_ratio_max/min, the canary gaps
# and moe_replay_agreement. Files under OUT: test.log, replay_{off,on}.{log,jsonl}.
# Usage: bash benchmarks/gpu_moe_replay.sh OUT_DIR [PARTS]   PARTS: any of test, cli (default both)
# STEPS (default 3), TOKENS (max_new_tokens, default 96) and BATCH_GROUPS (algo.batch_groups, default 8)
# size the CLI runs; the limits (180 s test, 200 s per run) keep the whole under one 10-minute call.
set -uo pipefail
OUT=${1:?output dir}; PARTS=${2:-"test cli"}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TOKENIZERS_PARALLELISM=false
G="model=qwen3_moe_char rollout.engine=vllm trainer.gpus_per_rank=1 rollout.gpus_per_actor=1 cluster.num_gpus=1
   trainer.cpus_per_rank=4 rollout.cpus_per_actor=4 +rollout.vllm.engine_kwargs.enforce_eager=${EAGER:-true}
   +rollout.vllm.engine_kwargs.max_model_len=1024 trainer.lr=1e-4 checkpoint.save_final=false sft.warmup_steps=0
   algo.max_off_policy_steps=0 algo.batch_groups=${BATCH_GROUPS:-8} logger.console=false"
W=/tmp/rlcore-moe-replay; rm -rf $W; mkdir -p $W
start=$SECONDS
stamp() { echo "[gpu_moe_replay +$((SECONDS - start))s] $*"; }
if [[ $PARTS == *test* ]]; then
  stamp "GPU test"
  timeout -k 10 180 python -m pytest -m gpu tests/gpu/test_routing_replay_gpu.py -x -v -s \
    -p no:cacheprovider --basetemp=$W/pytest > "$OUT/test.log" 2>&1
  echo "test exit: $?" >> "$OUT/test.log"
  grep -E "routing replay:|passed|failed|Error" "$OUT/test.log" | tail -n 5
fi
if [[ $PARTS == *cli* ]]; then
  for mode in off on; do
    flag=false; [[ $mode == on ]] && flag=true
    stamp "CLI run, routing replay $mode"
    # shellcheck disable=SC2086
    timeout -k 10 200 python -m rlcore.run steps=${STEPS:-3} output_dir=$W/$mode $G \
      rollout.sampling.max_new_tokens=${TOKENS:-96} rollout.vllm.routing_replay=$flag > "$OUT/replay_$mode.log" 2>&1
    echo "exit code: $?" >> "$OUT/replay_$mode.log"
    cp $W/$mode/metrics.jsonl "$OUT/replay_$mode.jsonl" 2>/dev/null
    tail -n 3 "$OUT/replay_$mode.log"
  done
  stamp "summary"
  python - "$OUT" <<'PY'
import json, statistics, sys
from pathlib import Path
keys = ("mismatch_kl", "mismatch_ratio_max", "mismatch_ratio_min", "canary_mean_gap", "canary_max_gap",
        "moe_replay_agreement", "step_time_s")
print("replay  steps  " + "  ".join(f"{k:>20}" for k in keys))
for mode in ("off", "on"):
    f = Path(sys.argv[1]) / f"replay_{mode}.jsonl"
    rows = [json.loads(line) for line in f.read_text().splitlines()] if f.exists() else []
    cells = []
    for k in keys:
        vals = [r[k] for r in rows if isinstance(r.get(k), (int, float))]
        cells.append(f"{statistics.mean(vals):20.3e}" if vals else f"{'-':>20}")
    print(f"{mode:>6}  {len(rows):5d}  " + "  ".join(cells))
PY
fi
stamp "done"
