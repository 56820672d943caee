#!/usr/bin/env bash
# On nvidia-h200-x2 (after the GPU stage and torchao are installed): FP8 vs bf16.
#   bench: rollout output tok/s, VLLMEngine bf16 vs vLLM online FP8 (0.6B on GPU 0, 4B on GPU 1 at
#          once), then trainer tokens/s and MFU with trainer.fp8 none / tensorwise / rowwise
#          (0.6B on GPU 0, 4B on GPU 1 at once); about 6 min.
#   e2e:   a few synchronous RL steps through `python -m rlcore.run` (trainer GPU 0, vLLM GPU 1)
#          per run in RUNS (default "rollout_fp8 trainer_fp8"; "both_fp8" sets both switches);
#          mismatch_kl and canary gaps from metrics.jsonl; about 2 min per run.
# Usage: [RUNS="..."] bash benchmarks/gpu_fp8.sh OUT_DIR [bench|e2e|all]   (each part fits one 10-min device call)
# Files under OUT_DIR: rollout.log trainer.log e2e.log summary.json (+ the per-run JSON/metrics).
set -uo pipefail
OUT=${1:?output dir}
PART=${2:-all}
mkdir -p "$OUT"
W=/tmp/rlcore-fp8
mkdir -p $W
export PYTHONPATH=$PWD:${PYTHONPATH:-}
export NCCL_NVLS_ENABLE=0

bench() {
  # rollout: 256 prompts x 128 tokens in, 256 out, CUDA graphs on, 2 reps per engine
  for g in 0 1; do
    m=$([ $g = 0 ] && echo qwen3-0.6b || echo qwen3-4b)
    timeout 280 python benchmarks/rollout_throughput.py --model "$m" --quant-compare fp8 --gpu $g --reps 2 \
      --out "$W/rollout_$m.json" > "$W/rollout_$m.log" 2>&1 &
  done
  wait
  cat $W/rollout_qwen3-0.6b.log $W/rollout_qwen3-4b.log | grep -v -e FutureWarning -e "^\s*$" > "$OUT/rollout.log"
  # trainer: 0.6B with 8192 packed tokens, 4B with 4096 (one GPU each, no activation checkpointing)
  for g in 0 1; do
    (
      if [ $g = 0 ]; then m=qwen3-0.6b; t=8192; lim=90; else m=qwen3-4b; t=4096; lim=100; fi
      for f in none tensorwise rowwise; do
        CUDA_VISIBLE_DEVICES=$g timeout $lim python benchmarks/trainer_mfu.py --shape $m --tokens $t --steps 5 \
          --warmup 2 --fp8 $f --out $W/train_${m}_$f.json 2>&1 | tail -n 5
        echo "[$m fp8=$f exit ${PIPESTATUS[0]}]"
      done
    ) > $W/trainer_$g.log 2>&1 &
  done
  wait
  cat $W/trainer_0.log $W/trainer_1.log > "$OUT/trainer.log"
}

M="model=qwen3_06b_char"
G="trainer.gpus_per_rank=1 trainer.cpus_per_rank=4 rollout.engine=vllm rollout.gpus_per_actor=1
   rollout.cpus_per_actor=4 +rollout.vllm.engine_kwargs.enforce_eager=true
   +rollout.vllm.engine_kwargs.gpu_memory_utilization=0.6 +rollout.vllm.engine_kwargs.max_model_len=1024
   trainer.lr=1e-4 checkpoint.save_final=false sft.warmup_steps=0 logger.console=false"

e2e() {
  # max_off_policy_steps=0: behaviour policy == trained policy, so mismatch_kl is the FP8 numerics alone
  # (bf16 reference on this setup: 3-4e-5, docs/benchmarks.md)
  : > "$OUT/e2e.log"
  for run in ${RUNS:-rollout_fp8 trainer_fp8}; do
    case $run in
      rollout_fp8) X="rollout.vllm.quantization=fp8" ;;
      trainer_fp8) X="trainer.fp8=tensorwise" ;;
      both_fp8) X="rollout.vllm.quantization=fp8 trainer.fp8=tensorwise" ;;
      *) echo "unknown run $run (rollout_fp8, trainer_fp8, both_fp8)" >&2; exit 2 ;;
    esac
    # shellcheck disable=SC2086
    timeout 220 python -m rlcore.run steps=5 algo.max_off_policy_steps=0 output_dir=$W/$run $M $G $X \
      2>&1 | grep -v -e FutureWarning -e forward_call | tail -n 40 >> "$OUT/e2e.log"
    echo "[$run exit ${PIPESTATUS[0]}]" >> "$OUT/e2e.log"
    cp $W/$run/metrics.jsonl "$OUT/e2e_${run}_metrics.jsonl" 2>/dev/null
  done
}

case $PART in
  bench) bench ;;
  e2e) e2e ;;
  all) bench; e2e ;;
  *) echo "part must be bench, e2e or all" >&2; exit 2 ;;
esac

python - "$OUT" $W <<'EOF'
import glob, json, os, statistics, sys
out, w = sys.argv[1], sys.argv[2]
s = {"rollout": {}, "trainer": {}, "e2e": {}}
for f in glob.glob(f"{w}/rollout_*.json"):
    r = json.load(open(f))
    s["rollout"][r["args"]["model"]] = {k: statistics.median(v) for k, v in r["tok_s"].items()} | {"speedup": r["speedup"]}
for f in glob.glob(f"{w}/train_*.json"):
    r = json.load(open(f))
    s["trainer"][f"{r['shape']} fp8={r['fp8']}"] = {k: r[k] for k in ("tokens_per_s", "mfu", "mfu_attn", "step_s", "peak_mem_gib", "loss")}
for shape in {k.split()[0] for k in s["trainer"]}:
    base = s["trainer"].get(f"{shape} fp8=none")
    for f in ("tensorwise", "rowwise"):
        r = s["trainer"].get(f"{shape} fp8={f}")
        if base and r:
            r["speedup_vs_bf16"] = r["tokens_per_s"] / base["tokens_per_s"]
for run in ("rollout_fp8", "trainer_fp8", "both_fp8"):
    p = f"{w}/{run}/metrics.jsonl"
    if os.path.exists(p):
        rows = [json.loads(l) for l in open(p)]
        s["e2e"][run] = {"steps": len(rows), **{k: [r.get(k) for r in rows] for k in
                         ("mismatch_kl", "canary_max_gap", "canary_mean_gap", "reward_mean", "sync_time_s", "step_time_s")}}
json.dump(s, open(f"{out}/summary.json", "w"), indent=1)
print(json.dumps(s, indent=1))
EOF
