#!/usr/bin/env bash
set -u
B=.gpu/bin
timeout 20 $B/gpu_ops staged_writes train_steps > $OUT/tests.log 2>&1; echo "gpu_ops exit $?" >> $OUT/tests.log
timeout 20 compute-sanitizer --tool memcheck --error-exitcode 1 $B/gpu_ops staged_writes > /tmp/s.log 2>&1; echo "memcheck exit $?" >> $OUT/tests.log; tail -2 /tmp/s.log >> $OUT/tests.log
timeout 40 $B/host train configs/alexnet.json --precision tf32 --max-steps 100 --log-every 10 --device cuda --out /tmp/runs --quiet > $OUT/alexnet.log 2>&1; echo "alexnet exit $?" >> $OUT/alexnet.log
cp /tmp/runs/alexnet/metrics.jsonl $OUT/alexnet-metrics.jsonl 2>/dev/null
