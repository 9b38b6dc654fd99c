#!/usr/bin/env bash
set -u
mkdir -p /usr/share/datasets/fashion-mnist && cp .gpu/fashion-mnist/*.gz /usr/share/datasets/fashion-mnist/
H=.gpu/bin/host
pids=()
for r in fm-nopool5 fm-nopool5-drop3; do
  ( timeout 545 $H train .gpu/cfg/$r.json --device cuda --out /tmp/runs --quiet > $OUT/$r.log 2>&1; echo "exit $?" >> $OUT/$r.log ) &
  pids+=($!)
done
wait "${pids[@]}"
for r in fm-nopool5 fm-nopool5-drop3; do
  ck=$(ls -t /tmp/runs/$r/checkpoints/*.safetensors 2>/dev/null | head -1)
  echo "== $r final ckpt $ck" >> $OUT/summary.log
  [ -n "$ck" ] && timeout 20 $H test "$ck" --device cuda >> $OUT/summary.log 2>&1
  cp /tmp/runs/$r/metrics.jsonl $OUT/$r-metrics.jsonl 2>/dev/null
done
