#!/usr/bin/env bash
# The upload stream (branch wip/upload-stream): staged-write and training-step tests, then host train
# with the batch uploads on the upload stream and on the compute stream (ALEXNET_UPLOAD_STREAM=0).
# Build first: bash scripts/gpu-bundle.sh .gpu (drop unneeded executables), run with carry [".gpu"].
set -uo pipefail
(cd .gpu; for f in bin/*.gz; do gunzip -f $f; done)
L=$OUT/logs; mkdir -p $L; t0=$(date +%s)
pack() { (cd $OUT && tar czf logs.tgz logs); }
r() { local n=$1 t=$2; shift 2; timeout $t "$@" > $L/$n.log 2>&1; echo "$n rc=$? $(( $(date +%s)-t0 ))s" | tee -a $L/summary.log; pack; }
r gpu_ops-staged 120 .gpu/bin/gpu_ops staged_writes train_steps
r memcheck 200 env ALEXNET_TEST_SMALL=1 compute-sanitizer --tool memcheck --error-exitcode 1 .gpu/bin/gpu_ops staged_writes
for u in 1 0; do
  r train-bf16-upload$u 150 env ALEXNET_UPLOAD_STREAM=$u .gpu/bin/host train configs/alexnet.json --precision bf16 --max-steps 800 --quiet --out /tmp/runs$u
  cp /tmp/runs$u/alexnet/metrics.jsonl $L/train-metrics-upload$u.jsonl 2>/dev/null
done
r bench-bf16 100 .gpu/bin/host bench configs/alexnet.json --batch-size 128 --precision bf16 --device cuda
tail -n 1 $L/gpu_ops-staged.log $L/memcheck.log >> $L/summary.log
for u in 1 0; do echo "upload stream $u:"; grep '"train"' $L/train-metrics-upload$u.jsonl | tail -5; done >> $L/summary.log 2>&1
grep -h "images/s" $L/bench-bf16.log >> $L/summary.log
cat $L/summary.log; pack
