#!/usr/bin/env bash
# Runs the GPU test bundle made by scripts/gpu-bundle.sh, on a machine with an
# NVIDIA GPU (no Rust needed). Usage: bash run.sh [tests|sanitize|bench|compare|all]
# `compare` is issue 4's table in one go: our step (TF32, bf16) and per-conv
# kernel times, then PyTorch's on the same GPU (needs python3 with torch).
# Logs go to $OUT (or ./gpu-logs). Exit status is non-zero if anything failed.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
logs=${OUT:-$here/gpu-logs}
mkdir -p "$logs"
what=${1:-all}
status=0
# gpu-bundle.sh ships the executables gzipped.
for f in "$here"/bin/*.gz; do
  [ -e "$f" ] && gunzip -f "$f"
done
# NCCL ships only as libnccl.so.2 inside Python packages on some machines;
# cudarc opens libnccl.so.
if NL=$(python3 -c 'import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],"lib"))' 2>/dev/null); then
  mkdir -p /tmp/nccl && ln -sf "$NL/libnccl.so.2" /tmp/nccl/libnccl.so
  export LD_LIBRARY_PATH=/tmp/nccl:$NL:${LD_LIBRARY_PATH:-}
fi
run() { # name, command...
  local name=$1; shift
  echo "=== $name: $*"
  "$@" >"$logs/$name.log" 2>&1
  local rc=$?
  tail -n 40 "$logs/$name.log"
  echo "=== $name: exit $rc"
  [ $rc -eq 0 ] || status=1
}
if [ "$what" = tests ] || [ "$what" = all ]; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  run devices "$here/bin/host" devices
  run gpu_ops "$here/bin/gpu_ops"
  run gpu_multi "$here/bin/gpu_multi"
  # A short GPU training run (needs configs/ from the repository root).
  if [ -f configs/tiny.json ]; then
    run train-tiny "$here/bin/host" train configs/tiny.json --device cuda --out "$logs/runs" --quiet
  fi
fi
if [ "$what" = sanitize ] || [ "$what" = all ]; then
  # Small shapes only: the sanitizers slow kernels down by orders of magnitude.
  for tool in memcheck racecheck; do
    run "sanitizer-$tool" env ALEXNET_TEST_SMALL=1 compute-sanitizer --tool $tool --error-exitcode 1 "$here/bin/gpu_ops"
  done
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  run kernels env ALEXNET_BENCH_JSON="$logs/kernel-bench.json" "$here/bin/kernels"
  if [ -f configs/alexnet.json ]; then
    for p in fp32 tf32 bf16; do
      run bench-alexnet-$p "$here/bin/host" bench configs/alexnet.json --batch-size 128,256 --profile --precision $p --device cuda --json "$logs/bench-alexnet-$p.json"
    done
    # The same step without the CUDA graph, to compare.
    for p in tf32 bf16; do
      run bench-alexnet-$p-eager "$here/bin/host" bench configs/alexnet.json --batch-size 128,256 --precision $p --device cuda --no-graph --json "$logs/bench-alexnet-$p-eager.json"
    done
  fi
fi
if [ "$what" = compare ]; then
  # The files benches/compare_table.py reads, in $logs/table/.
  t=$logs/table
  mkdir -p "$t"
  for p in tf32 bf16; do
    run compare-ours-$p "$here/bin/host" bench configs/alexnet.json --batch-size 128,256 --profile --precision $p --device cuda --json "$t/bench-$p.json"
    run compare-kernels-$p env ALEXNET_BENCH_JSON="$t/kernels-$p.json" "$here/bin/kernels" $p
  done
  if python3 -c 'import torch' 2>/dev/null; then
    run compare-pytorch python3 benches/pytorch_reference.py --batch-size 128 256 --precision tf32 bf16 --layers
    cp "$logs/compare-pytorch.log" "$t/pytorch.log"
    run compare-table python3 benches/compare_table.py "$t"
  else
    echo "=== compare-pytorch: SKIPPED (python3 cannot import torch)"
  fi
fi
exit $status
