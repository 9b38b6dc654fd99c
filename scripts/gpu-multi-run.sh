#!/usr/bin/env bash
# Issue 6 in one call on a machine with 2 or 4 GPUs (run from the repository
# root after scripts/gpu-bundle.sh, with .gpu/ carried over):
#   bash scripts/gpu-multi-run.sh [quick|all]
# quick: the multi-GPU tests and the scaling benchmark; all: also a
# Fashion-MNIST run on every GPU. Logs go to $OUT (or ./gpu-logs); the
# machine keeps NVLink multicast off (NCCL_NVLS_ENABLE=0): leave it so.
set -uo pipefail
logs=${OUT:-gpu-logs}
mkdir -p "$logs"
what=${1:-all}
B=.gpu/bin
if NL=$(python3 -c 'import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],"lib"))' 2>/dev/null); then
  mkdir -p /tmp/nccl && ln -sf "$NL/libnccl.so.2" /tmp/nccl/libnccl.so
  export LD_LIBRARY_PATH=/tmp/nccl:$NL:${LD_LIBRARY_PATH:-}
fi
n=$(nvidia-smi -L | wc -l)
t0=$(date +%s)
note() { echo "--- $* ($(( $(date +%s) - t0 )) s)" | tee -a "$logs/summary.log"; }
note "$n GPUs; NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-unset}"
note gpu_multi
$B/gpu_multi > "$logs/gpu_multi.log" 2>&1; note "gpu_multi exit $?"; tail -3 "$logs/gpu_multi.log" >> "$logs/summary.log"
# Scaling: N = 1, 2, 4 (as many as exist) at per-GPU batch 128 and 256, in
# TF32 and bf16, data-parallel and hybrid.
for p in tf32 bf16; do
  for mode in data hybrid; do
    for g in 1 2 4; do
      [ "$g" -le "$n" ] || continue
      note "bench --gpus $g --precision $p --parallel $mode"
      $B/host bench configs/alexnet.json --gpus "$g" --batch-size 128,256 --precision "$p" --parallel "$mode" \
        --json "$logs/bench-$p-$mode-$g.json" >> "$logs/bench.log" 2>&1 || echo "exit $?" >> "$logs/bench.log"
    done
  done
done
grep -E "images/s|efficiency|wait" "$logs/bench.log" >> "$logs/summary.log"
if [ "$what" = all ]; then
  mkdir -p /usr/share/datasets/fashion-mnist && cp .gpu/fashion-mnist/*.gz /usr/share/datasets/fashion-mnist/ 2>/dev/null
  note "fashion-mnist on $n GPUs"
  $B/host train configs/fashion-mnist.json --gpus "$n" --device cuda --out /tmp/runs --quiet > "$logs/fashion-$n.log" 2>&1
  note "fashion exit $?"
  tail -12 "$logs/fashion-$n.log" >> "$logs/summary.log"
  cp /tmp/runs/fashion-mnist/metrics.jsonl "$logs/fashion-$n-metrics.jsonl" 2>/dev/null
fi
note done
