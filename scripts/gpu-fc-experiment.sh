#!/usr/bin/env bash
# fc products: TF32 on rounded operand copies (default) against fp32 operands
# converted in the inner loop (ALEXNET_OPERAND_COPIES=0), tile shapes
# (ALEXNET_FC_TILE) and split-K targets (ALEXNET_FC_SPLIT_BLOCKS): the new
# tests and memcheck first, then host bench A/B, the kernels bench sweep, and
# the whole gpu_ops while time is left (steps that would pass $DEADLINE s, default 570, are skipped).
# Build first: bash scripts/gpu-bundle.sh .gpu, run with carry [".gpu"].
set -uo pipefail
(cd .gpu; for f in bin/*.gz; do gunzip -f $f; done)
L=$OUT/logs; mkdir -p $L; t0=$(date +%s)
pack() { (cd $OUT && tar czf logs.tgz logs); }
r() { local n=$1 t=$2; shift 2
  local left=$(( ${DEADLINE:-570} - ($(date +%s)-t0) )); [ $left -lt 20 ] && { echo "$n SKIPPED (time)" | tee -a $L/summary.log; return; }
  [ $t -gt $left ] && t=$left
  timeout $t "$@" > $L/$n.log 2>&1; echo "$n rc=$? $(( $(date +%s)-t0 ))s" | tee -a $L/summary.log; pack; }
r gpu_ops 150 .gpu/bin/gpu_ops fc_ convert_ sgd_update_all train_steps
r memcheck 90 env ALEXNET_TEST_SMALL=1 compute-sanitizer --tool memcheck --error-exitcode 1 .gpu/bin/gpu_ops fc_forward fc_kept convert_tf32 sgd_update_all
r bench-tf32-copies 90 .gpu/bin/host bench configs/alexnet.json --batch-size 128,256 --profile --precision tf32 --device cuda
r bench-tf32-old 70 env ALEXNET_OPERAND_COPIES=0 .gpu/bin/host bench configs/alexnet.json --batch-size 128,256 --precision tf32 --device cuda
for B in 128 256; do
  for v in "base" "old ALEXNET_OPERAND_COPIES=0" "big ALEXNET_FC_TILE=big" "wide ALEXNET_FC_TILE=wide" "bigs4 ALEXNET_FC_TILE=big ALEXNET_FC_SPLIT_BLOCKS=4"; do
    set -- $v; n=$1; shift
    r fc-$B-$n 30 env ALEXNET_BENCH_BATCH=$B "$@" .gpu/bin/kernels fc_ convert_
  done
done
for f in $L/fc-*.log; do echo "== $(basename $f .log)"; grep -E "tf32|bf16" $f | grep -v bias; done > $L/fc-table.log
grep -h "images/s" $L/bench-*.log >> $L/summary.log
r gpu_ops-all 300 .gpu/bin/gpu_ops
grep -h "fail\|passed\|FAIL\|ERROR SUMMARY" $L/gpu_ops*.log $L/memcheck.log | tail -n 8 >> $L/summary.log
cat $L/summary.log; pack
