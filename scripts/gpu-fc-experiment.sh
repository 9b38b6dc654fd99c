#!/usr/bin/env bash
# fc products, as whole training steps (`host bench`) and kernels
# (`kernels fc_`): the tile height (default: 128 rows where they add no
# padding, the split over K filling the GPU; ALEXNET_FC_TILE=narrow is the
# old choice at batch 128/256), TF32 operand copies (ALEXNET_TF32_COPIES=1),
# the bf16 weight gradient on bf16 copies (ALEXNET_FC_FILTER_COPIES=1), and,
# where a baseline bundle .gpu-a/ (kernels, host) is carried too, this
# build against it. Then issue 4's comparison table (run.sh compare).
# Steps that would pass $DEADLINE s (default 570) are skipped.
# Build first: bash scripts/gpu-bundle.sh .gpu, run with carry [".gpu"]
# (and ".gpu-a").
set -uo pipefail
for d in .gpu .gpu-a; do [ -d $d ] && (cd $d; for f in bin/*.gz; do [ -e $f ] && gunzip -f $f; done); done
L=$OUT/logs; mkdir -p $L; t0=$(date +%s)
pack() { (cd $OUT && tar czf logs.tgz logs); }
r() { local n=$1 t=$2; shift 2
  local left=$(( ${DEADLINE:-570} - ($(date +%s)-t0) )); [ $left -lt 20 ] && { echo "$n SKIPPED (time)" | tee -a $L/summary.log; return; }
  [ $t -gt $left ] && t=$left
  timeout $t "$@" > $L/$n.log 2>&1; echo "$n rc=$? $(( $(date +%s)-t0 ))s" | tee -a $L/summary.log; pack; }
r gpu_ops 150 .gpu/bin/gpu_ops fc_ convert_ sgd_update_all train_steps
B="bench configs/alexnet.json --batch-size 128,256 --device cuda"
builds=.gpu; [ -x .gpu-a/bin/host ] && builds=".gpu .gpu-a"
# A build's first CUDA run JIT-compiles its PTX (~40 s where the driver has
# not cached that module): once per build here, outside the timed runs.
for d in $builds; do r jit${d#.gpu} 120 $d/bin/host bench configs/tiny.json --batch-size 2 --steps 1 --device cuda; done
for p in tf32 bf16; do
  for d in $builds; do r bench-$p${d#.gpu} 40 $d/bin/host $B --precision $p; done
  r bench-$p-narrow 40 env ALEXNET_FC_TILE=narrow .gpu/bin/host $B --precision $p
done
r bench-tf32-copies 40 env ALEXNET_TF32_COPIES=1 .gpu/bin/host $B --precision tf32
r bench-bf16-filter-copies 40 env ALEXNET_FC_FILTER_COPIES=1 .gpu/bin/host $B --precision bf16
for b in 128 256; do
  for d in $builds; do r fc-$b${d#.gpu} 30 env ALEXNET_BENCH_BATCH=$b $d/bin/kernels fc_; done
done
grep -H "images/s" $L/bench-*.log | sed 's/.*logs.//' >> $L/summary.log
r compare 420 env OUT=$L/compare bash .gpu/run.sh compare
grep -h "fail\|passed\|FAIL" $L/gpu_ops*.log | tail -n 4 >> $L/summary.log
cat $L/summary.log; pack
