#!/usr/bin/env bash
# On nvidia-h200 / h100 (one GPU, after the GPU stage is installed: torch 2.11, transformers on the
# path): trainer MFU of MoE shapes through benchmarks/trainer_mfu.py (rlcore's product training step).
#
# Default (~2-3 minutes): the qwen3-moe-small shape (Qwen3-30B-A3B's layer at half width, 64
# experts, top-8; torch._grouped_mm experts, EP=1), eager and compile, K = 1 and 4 micro-batches of
# 8k packed tokens per optimizer step, with one profiled step per variant summarised (kernel
# classes, top CUDA kernels, GPU idle gaps, top CPU ops). Files under OUT: mfu_moe.{log,json}
# (TRACES=1 also writes a chrome trace per variant under OUT/traces).
#
# A/B (AB=1, ~6-8 minutes): the MoE path of another tree against this one, in one call, on the same
# GPU: for each shape of SHAPES (default "qwen3-moe-small glm-moe-small": the same size, the second
# with GLM-4.5-Air's router: sigmoid scores, correction bias, a shared expert, a dense first layer),
# the old tree then this one, compile, K=4 (VARIANTS / KS override), 5 timed steps, no profile. The
# old tree is a checkout carried with the working tree, prepared before the call, e.g.
#     git archive d5adaf0 --prefix=.ab/old/ | tar -x        # the tree before issue 55's MoE layer
# (OLD_TREE=.ab/old by default). The same driver (this tree's trainer_mfu.py) imports rlcore from
# each tree (--rlcore-tree). Note: the old tree's MoE block drops GLM's shared expert (the bug
# issue 55 fixed), so its glm-moe-small FLOPs are overstated by that expert's share (1 of 9 per token).
# Files: ab_<shape>_<tree>.{log,json}; the table at the end.
#
# REPS=2 runs each tree twice, interleaved (files ab_<shape>_<tree>-<rep>).
# Usage: bash benchmarks/gpu_moe_mfu.sh OUT_DIR        AB=1 bash benchmarks/gpu_moe_mfu.sh OUT_DIR
set -uo pipefail
OUT=${1:?output dir}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/rlcore-inductor-cache}
GPU=$(python -c "import torch; n = torch.cuda.get_device_name().lower(); print('h100' if 'h100' in n else 'h200')" 2>/dev/null || echo h200)
start=$SECONDS
if [ "${AB:-0}" = "1" ]; then
  OLD_TREE=${OLD_TREE:-.ab/old}
  [ -d "$OLD_TREE/rlcore" ] || { echo "AB=1: no old tree at $OLD_TREE (see the header: git archive ... | tar -x)"; exit 2; }
  # REPS > 1 interleaves the trees (old, new, old, new, ...): a machine's speed drifts within one
  # call (2026-12-07: every A/B row ran slower than a profiled run right after), so a pair run
  # back to back compares better than one tree's runs against the other's
  for shape in ${SHAPES:-qwen3-moe-small glm-moe-small}; do
    for rep in $(seq "${REPS:-1}"); do
      for tree in "$OLD_TREE" .; do
        tag=$([ "$tree" = . ] && echo new || echo old)$([ "${REPS:-1}" = 1 ] || echo "-$rep")
        run="$OUT/ab_${shape}_${tag}"
        echo "[gpu_moe_mfu +$((SECONDS - start))s] $shape, $tag tree ($tree)"
        CUDA_VISIBLE_DEVICES=0 timeout -k 10 280 python benchmarks/trainer_mfu.py --rlcore-tree "$tree" --shape "$shape" \
          --tokens 8192 --variants "${VARIANTS:-compile}" --micro-batches "${KS:-4}" --steps 5 --warmup 2 --gpu "$GPU" \
          --out "$run.json" > "$run.log" 2>&1
        echo "exit code: $?" >> "$run.log"
        grep -E "Error|error:" "$run.log" | grep -v -i warning | tail -n 3
        # each run's row on stdout as it ends: a call cut short, or files the device does not
        # bring back (2026-12-07: 4 of 11 left out by count), still show what ran
        sed -n '/^variant  *K  *step_s/,$p' "$run.log" | sed -n '3,$p' | sed "s/^/  $shape $tag: /"
      done
    done
  done
  echo "[gpu_moe_mfu +$((SECONDS - start))s] done"
  python - "$OUT" <<'PY'
import glob, json, os, sys
print(f"{'shape':<16} {'tree':<6} {'variant':<10} {'K':>2} {'step_s':>7} {'tok/s':>9} {'TFLOP/s':>8} {'mfu':>6} {'mem_GiB':>8}")
for path in sorted(glob.glob(os.path.join(sys.argv[1], "ab_*.json"))):
    tag = path.rsplit("_", 1)[1].removesuffix(".json")
    for r in json.load(open(path)):
        if "error" in r:
            print(f"{r.get('shape', '?'):<16} {tag:<6} FAILED {r['error'][:80]}")
            continue
        print(f"{r['shape']:<16} {tag:<6} {r['variant']:<10} {r['micro_batches']:>2} {r['step_s']:7.3f} "
              f"{r['tokens_per_s_per_gpu']:9,.0f} {r['tflops_per_gpu']:8.1f} {r['mfu']:6.3f} {r['peak_mem_gib'] or 0:8.1f}")
PY
  exit 0
fi
echo "[gpu_moe_mfu +0s] ${SHAPE:-qwen3-moe-small}, one GPU"
CUDA_VISIBLE_DEVICES=0 timeout -k 10 240 python benchmarks/trainer_mfu.py --shape "${SHAPE:-qwen3-moe-small}" --tokens 8192 \
  --variants "${VARIANTS:-eager,compile}" --micro-batches 1,4 --steps 5 --warmup 2 --profile --profile-top 16 --gpu "$GPU" \
  ${TRACES:+--trace-dir "$OUT/traces"} --out "$OUT/mfu_moe.json" > "$OUT/mfu_moe.log" 2>&1
echo "exit code: $?" >> "$OUT/mfu_moe.log"
echo "[gpu_moe_mfu +$((SECONDS - start))s] done"
# the profile summaries, then the final table (and the exit code)
sed -n '/^-- profile/,/^$/p' "$OUT/mfu_moe.log" | head -n 120
grep -E "Error|error:" "$OUT/mfu_moe.log" | grep -v -i warning | tail -n 5
sed -n '/^variant  *K  *step_s/,$p' "$OUT/mfu_moe.log"
tail -n 1 "$OUT/mfu_moe.log"
