#!/usr/bin/env bash
# fc products: TF32 on rounded operand copies (default) against fp32 operands
# converted in the inner loop (ALEXNET_OPERAND_COPIES=0), tile shapes
# (ALEXNET_FC_TILE) and split-K targets (ALEXNET_FC_SPLIT_BLOCKS), timed by the
# kernels bench at batch 128 and 256 and by host bench; the fc, copy and SGD
# tests first (also on forced big tiles).
# Build first: bash scripts/gpu-bundle.sh .gpu, run with carry [".gpu"].
set -uo pipefail
(cd .gpu; for f in bin/*.gz; do gunzip -f $f; done)
L=$OUT/logs; mkdir -p $L; t0=$(date +%s)
pack() { (cd $OUT && tar czf logs.tgz logs); }
r() { local n=$1 t=$2; shift 2; timeout $t "$@" > $L/$n.log 2>&1; echo "$n rc=$? $(( $(date +%s)-t0 ))s" | tee -a $L/summary.log; pack; }
r gpu_ops 240 .gpu/bin/gpu_ops fc_ convert_ sgd_update_all train_steps
r gpu_ops-fc-big 120 env ALEXNET_FC_TILE=big .gpu/bin/gpu_ops fc_
r memcheck 200 env ALEXNET_TEST_SMALL=1 compute-sanitizer --tool memcheck --error-exitcode 1 .gpu/bin/gpu_ops fc_ convert_tf32 sgd_update_all
for B in 128 256; do
  for v in "base" "old ALEXNET_OPERAND_COPIES=0" "big ALEXNET_FC_TILE=big" "wide ALEXNET_FC_TILE=wide" "narrow ALEXNET_FC_TILE=narrow" \
           "bigs4 ALEXNET_FC_TILE=big ALEXNET_FC_SPLIT_BLOCKS=4"; do
    set -- $v; n=$1; shift
    r fc-$B-$n 60 env ALEXNET_BENCH_BATCH=$B "$@" .gpu/bin/kernels fc_ convert_
  done
done
for f in $L/fc-*.log; do echo "== $(basename $f .log)"; grep -E "tf32|bf16" $f | grep -v bias; done > $L/fc-table.log
r bench-tf32-copies 150 .gpu/bin/host bench configs/alexnet.json --batch-size 128,256 --profile --precision tf32 --device cuda
r bench-tf32-old 150 env ALEXNET_OPERAND_COPIES=0 .gpu/bin/host bench configs/alexnet.json --batch-size 128,256 --precision tf32 --device cuda
grep -h "images/s" $L/bench-*.log >> $L/summary.log
grep -h "fail\|passed\|FAIL\|ERROR SUMMARY" $L/gpu_ops*.log $L/memcheck.log | tail -n 8 >> $L/summary.log
cat $L/summary.log; pack
