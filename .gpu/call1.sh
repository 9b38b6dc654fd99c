#!/usr/bin/env bash
# Call 1: gpu_ops re-check, fashion bench, two fashion trainings side by side.
set -u
mkdir -p /usr/share/datasets/fashion-mnist && cp .gpu/fashion-mnist/*.gz /usr/share/datasets/fashion-mnist/
H=.gpu/bin/host
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > $OUT/summary.log
( timeout 520 $H train .gpu/cfg/fm-erase.json --device cuda --out /tmp/runs --quiet > $OUT/fm-erase.log 2>&1; echo "exit $?" >> $OUT/fm-erase.log ) &
A=$!
( timeout 520 $H train .gpu/cfg/fm-wide-erase-tf32.json --device cuda --out /tmp/runs --quiet > $OUT/fm-wide.log 2>&1; echo "exit $?" >> $OUT/fm-wide.log ) &
B=$!
.gpu/bin/gpu_ops > $OUT/gpu_ops.log 2>&1; echo "gpu_ops exit $?" >> $OUT/summary.log
tail -5 $OUT/gpu_ops.log >> $OUT/summary.log
wait $A; wait $B
for r in fm-erase fm-wide-erase-tf32; do
  ck=$(ls -t /tmp/runs/$r/checkpoints/*.safetensors 2>/dev/null | head -1)
  echo "== $r final ckpt $ck" >> $OUT/summary.log
  [ -n "$ck" ] && $H test "$ck" --device cuda >> $OUT/summary.log 2>&1
  cp /tmp/runs/$r/metrics.jsonl $OUT/$r-metrics.jsonl 2>/dev/null
done
