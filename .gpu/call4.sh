#!/usr/bin/env bash
set -u
mkdir -p /usr/share/datasets/fashion-mnist && cp .gpu/fashion-mnist/*.gz /usr/share/datasets/fashion-mnist/
B=.gpu/bin
t0=$(date +%s)
el() { echo $(( $(date +%s) - t0 )); }
st() { echo "--- $1 at $(el) s" >> $OUT/summary.log; }
st gpu_ops; timeout 60 $B/gpu_ops > $OUT/tests.log 2>&1; rc=$?; echo "gpu_ops exit $rc" >> $OUT/summary.log; tail -2 $OUT/tests.log >> $OUT/summary.log
st sanitize; for tool in memcheck racecheck; do ALEXNET_TEST_SMALL=1 timeout 60 compute-sanitizer --tool $tool --error-exitcode 1 $B/gpu_ops > /tmp/s.log 2>&1; echo "sanitizer $tool exit $?" >> $OUT/summary.log; tail -3 /tmp/s.log >> $OUT/sanitize.log; grep -m5 "FAIL\|=====.*\(Invalid\|Race\|hazard\)" /tmp/s.log >> $OUT/sanitize.log; done
st kernels; ALEXNET_BENCH_JSON=$OUT/kernel-bench.json timeout 60 $B/kernels > $OUT/bench.log 2>&1; echo "kernels exit $?" >> $OUT/summary.log
for p in bf16 tf32 fp32; do st bench-$p; timeout 30 $B/host bench configs/alexnet.json --batch-size 128,256 --profile --precision $p --device cuda >> $OUT/bench.log 2>&1; echo "bench $p exit $?" >> $OUT/summary.log; done
grep "images/s" $OUT/bench.log >> $OUT/summary.log
if [ $rc -eq 0 ]; then
  left=$(( 275 - $(el) )); st "fashion-bf16 (timeout $left)"
  timeout $left $B/host train configs/fashion-mnist.json --precision bf16 --device cuda --out /tmp/runs --quiet > $OUT/fashion-bf16.log 2>&1; echo "fashion exit $?" >> $OUT/summary.log
  cp /tmp/runs/fashion-mnist/metrics.jsonl $OUT/fashion-bf16-metrics.jsonl
fi
st done
