#!/usr/bin/env bash
# A build's checks on a GPU machine without Rust, in one call that fits the
# device tool's 64 MiB carry (`kernels`, the benchmark, is packed too, for
# commands added after it): the whole `gpu_ops` (the given filters first),
# memcheck on small shapes, `host bench` of AlexNet in TF32 and bf16 at
# batch 128 and 256 (step times, device memory, the arena), the main job
# for a few steps, Fashion-MNIST trained in bf16 with its 10-view test, and
# the kernels cuDNN picks per conv product (PyTorch's profiler).
#   here:  bash scripts/gpu-verify.sh pack [BASE]  (xz: gpu_ops, host, the
#          dataset; BASE, a `host` of an earlier build, is benched beside
#          this one in the same call)
#   there: DEADLINE=570 bash scripts/gpu-verify.sh run [gpu_ops filters...]
#          with carry [".gpf"]; logs in $OUT/logs (and $OUT/logs.tgz).
# GPU_OPS_ALL=0 leaves out the whole gpu_ops run (~300 s), CUDNN_KERNELS=0
# the kernel listing, TRAIN=0 the main job and Fashion-MNIST; WG_BIG=1
# adds the 128×128 warpgroup kernels' checks (gpu_ops conv_wg_big, also
# under memcheck and racecheck on its small shape; conv_forward and
# conv_backward_data with every channels-last product on those tiles) and
# `kernels conv_forward` and host bench with ALEXNET_WG_BIG=0 (to compare
# with the default); TMA=1 the TMA-fed conv forwards' (gpu_ops conv_tma,
# under memcheck and racecheck too; `kernels conv_forward` as the step runs
# it and with 128×128 tiles forced, on and off TMA; host bench with
# ALEXNET_TMA=0, ALEXNET_TMA_DATA=0 and ALEXNET_TMA_EPILOGUE=direct; the
# TMA weight gradients (=wide by default: bf16's, and TF32's where a group
# has more than 128 filters), ALEXNET_TMA_FILTER=0 none, =bf16 bf16's
# only and =1 every TF32 one too; the stages and resident blocks,
# ALEXNET_TMA_STAGES and _PERSISTENT, over $STAGES and $RESIDENT);
# PHASES=1 the strided data gradients by phases and the swapped TMA data
# gradients (gpu_ops conv_data_phases conv_tma, then under memcheck and
# racecheck; every layer's data gradient beside kernels-base's, conv1's by
# columns; conv1's and conv2's on each of `_t_slim`, the swapped and the
# 128×128 TMA kernels, the autotune off; the pixel grid copies; ncu on
# conv2's bf16 data gradient on each of those and its TF32 weight
# gradient);
# COMPARE=1 issue 4's table (ours and PyTorch's, in $OUT/logs/table). Steps that
# would pass $DEADLINE s are skipped (and say so), as are those whose log
# name matches the regular expression $SKIP or, when $ONLY is set, does
# not match it (e.g. ONLY='jit|gpu_ops-first|tma-filter-.*|k-.*filter.*|bench-.*');
# after a step times out (a
# kernel that hangs, most likely) the rest are skipped unless
# STOP_AFTER_TIMEOUT=0.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = pack ]; then
  set -e
  exes() { grep -o '"executable":"[^"]*"' | sed 's/"executable":"//; s/"$//'; }
  gpu_ops=$(cargo test --release --no-run --test gpu_ops --message-format=json 2>/dev/null | exes | grep /gpu_ops-)
  kernels=$(cargo bench --no-run --bench kernels --message-format=json 2>/dev/null | exes | grep /kernels-)
  cargo build --release -p host
  rm -rf .gpf/bin
  mkdir -p .gpf/bin .gpf/fm
  for exe in "$gpu_ops" "$kernels" target/release/host; do
    strip -o .gpf/bin/$(basename "$exe" | sed 's/-[0-9a-f]\{16\}$//') "$exe"
  done
  [ -n "${2:-}" ] && strip -o .gpf/bin/host-base "$2"
  xz -9 -f -T0 .gpf/bin/*
  src=/usr/share/datasets/fashion-mnist
  for f in "$src"/*.gz; do
    [ -e "$f" ] || { echo "note: no Fashion-MNIST in $src; the run's Fashion step will fail"; break; }
    b=$(basename "$f" .gz)
    [ -f .gpf/fm/$b.xz ] || zcat "$f" | xz -9e -T0 > .gpf/fm/$b.xz
  done
  du -ab .gpf | sort -n | tail -n 8
  exit 0
fi
shift
L=$OUT/logs; mkdir -p $L; t0=$(date +%s)
python3 - <<'EOF'
import lzma, pathlib, shutil
for p in list(pathlib.Path(".gpf").rglob("*.xz")):
    with lzma.open(p) as src, open(p.with_suffix(""), "wb") as dst:
        shutil.copyfileobj(src, dst)
    p.unlink()
EOF
chmod +x .gpf/bin/*
if NL=$(python3 -c 'import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],"lib"))' 2>/dev/null); then
  mkdir -p /tmp/nccl && ln -sf "$NL/libnccl.so.2" /tmp/nccl/libnccl.so
  export LD_LIBRARY_PATH=/tmp/nccl:$NL:${LD_LIBRARY_PATH:-}
fi
pack() { (cd $OUT && tar czf logs.tgz logs); }
r() { local n=$1 t=$2; shift 2
  [[ -n "${SKIP:-}" && $n =~ ^($SKIP)$ ]] && { echo "$n SKIPPED (SKIP)" | tee -a $L/summary.log; return; }
  [[ -n "${ONLY:-}" && ! $n =~ ^($ONLY)$ ]] && { echo "$n SKIPPED (not in ONLY)" | tee -a $L/summary.log; return; }
  [ -n "$hung" ] && { echo "$n SKIPPED (after $hung timed out)" | tee -a $L/summary.log; return; }
  local left=$(( ${DEADLINE:-570} - ($(date +%s)-t0) )); [ $left -lt 20 ] && { echo "$n SKIPPED (time)" | tee -a $L/summary.log; return; }
  [ $t -gt $left ] && t=$left
  timeout $t "$@" > $L/$n.log 2>&1; local rc=$?
  echo "$n rc=$rc $(( $(date +%s)-t0 ))s" | tee -a $L/summary.log
  [ $rc = 124 ] && [ "${STOP_AFTER_TIMEOUT:-1}" = 1 ] && hung=$n
  pack; }
hung=
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > $L/nvidia-smi.log 2>&1
H=.gpf/bin/host
# The first CUDA run of a build JIT-compiles its PTX (~40 s).
r jit 120 $H bench configs/tiny.json --batch-size 2 --steps 1 --device cuda
[ $# -gt 0 ] && r gpu_ops-first 200 .gpf/bin/gpu_ops "$@"
# ALEXNET_ARENA=0: every buffer its own allocation, whose bounds memcheck knows.
r memcheck 120 env ALEXNET_TEST_SMALL=1 ALEXNET_ARENA=0 compute-sanitizer --tool memcheck --error-exitcode 1 .gpf/bin/gpu_ops arena_ train_steps
[ -x .gpf/bin/host-base ] && r jit-base 120 .gpf/bin/host-base bench configs/tiny.json --batch-size 2 --steps 1 --device cuda
for p in tf32 bf16; do
  r bench-$p 60 $H bench configs/alexnet.json --batch-size 128,256 --device cuda --precision $p --json $L/bench-$p.json
  if [ -x .gpf/bin/host-base ]; then
    r bench-$p-base 60 .gpf/bin/host-base bench configs/alexnet.json --batch-size 128,256 --device cuda --precision $p
    r bench-$p-again 60 $H bench configs/alexnet.json --batch-size 128,256 --device cuda --precision $p
  fi
done
if [ "${TMA:-0}" = 1 ]; then
  # The TMA-fed 128×128 conv forwards and stride-1 data gradients (on by
  # default): checks, sanitizers, then their speed against ALEXNET_TMA=0
  # and ALEXNET_TMA_DATA=0.
  r conv_tma 150 .gpf/bin/gpu_ops conv_tma
  for tool in memcheck racecheck; do
    r tma-$tool 120 env ALEXNET_TEST_SMALL=1 ALEXNET_ARENA=0 compute-sanitizer --tool $tool --error-exitcode 1 .gpf/bin/gpu_ops conv_tma
  done
  r k-default 90 .gpf/bin/kernels conv_forward conv_backward_data
  r k-tma 90 env ALEXNET_BIG_TILES=1 ALEXNET_TRANSPOSED=0 .gpf/bin/kernels conv_forward
  r k-no-tma 90 env ALEXNET_TMA=0 ALEXNET_BIG_TILES=1 ALEXNET_TRANSPOSED=0 .gpf/bin/kernels conv_forward
  r k-no-tma-data 90 env ALEXNET_TMA_DATA=0 .gpf/bin/kernels conv_backward_data
  for p in tf32 bf16; do
    r bench-$p-no-tma 60 env ALEXNET_TMA=0 $H bench configs/alexnet.json --batch-size 128,256 --device cuda --precision $p
    r bench-$p-no-tma-data 60 env ALEXNET_TMA_DATA=0 $H bench configs/alexnet.json --batch-size 128,256 --device cuda --precision $p
  done
  # The epilogue straight from the accumulators instead of staged in
  # shared memory (the default where a block has one tile).
  r k-direct 60 env ALEXNET_TMA_EPILOGUE=direct .gpf/bin/kernels conv_forward conv_backward_data
  for p in tf32 bf16; do
    r bench-$p-direct 60 env ALEXNET_TMA_EPILOGUE=direct $H bench configs/alexnet.json --batch-size 128,256 --device cuda --precision $p
  done
  # The TMA weight gradients (=wide by default; ALEXNET_TMA_FILTER=1 puts
  # every TF32 one on the padded pixel grid): their checks, then their speed
  # against the mma.sync kernels (=0) and the step with and without them.
  r conv_tma_filter 120 .gpf/bin/gpu_ops conv_tma_filter pixel_grid
  for tool in memcheck racecheck; do
    r tma-filter-$tool 120 env ALEXNET_TEST_SMALL=1 ALEXNET_ARENA=0 compute-sanitizer --tool $tool --error-exitcode 1 .gpf/bin/gpu_ops conv_tma_filter
  done
  # Per precision, so that a failing TF32 kernel hides no bf16 time.
  for p in tf32 bf16; do
    r k-filter-$p 60 env ALEXNET_TMA_FILTER=0 .gpf/bin/kernels "conv_backward_filter&$p" "pixel_grid"
    r k-tma-filter-$p 60 env ALEXNET_TMA_FILTER=1 .gpf/bin/kernels "conv_backward_filter&$p"
  done
  for p in tf32 bf16; do
    r bench-$p-tma-filter 60 env ALEXNET_TMA_FILTER=1 $H bench configs/alexnet.json --batch-size 128,256 --device cuda --precision $p
    r bench-$p-no-tma-filter 60 env ALEXNET_TMA_FILTER=0 $H bench configs/alexnet.json --batch-size 128,256 --device cuda --precision $p
  done
  # TF32's grid kernel only where a group has more than 128 filters
  # (conv3–4; =wide, the default), then none of TF32's on it (=bf16).
  r bench-tf32-wide 60 env ALEXNET_TMA_FILTER=wide $H bench configs/alexnet.json --batch-size 128,256 --device cuda --precision tf32
  r bench-tf32-bf16-filter 60 env ALEXNET_TMA_FILTER=bf16 $H bench configs/alexnet.json --batch-size 128,256 --device cuda --precision tf32
  # ncu on conv3's TMA weight gradients (bf16, and TF32 over the grid).
  for p in bf16 tf32; do
    r ncu-tma-filter-$p 90 env ALEXNET_TMA_FILTER=1 ncu --clock-control none -k regex:conv_backward_filter_.*_wg_tma_big -c 1 \
      --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats \
      .gpf/bin/kernels "conv_backward_filter&conv3 $p"
  done
  # kernels-base: the same benchmark of an earlier build, put there by hand.
  [ -x .gpf/bin/kernels-base ] && r k-base 60 env ALEXNET_TMA_DATA=1 .gpf/bin/kernels-base conv_forward conv_backward_data
  # The bf16 weight gradients as the step runs them, this build's and the
  # earlier one's, one after the other.
  r k-default-filter 60 .gpf/bin/kernels "conv_backward_filter&bf16" conv_backward_filter_sum
  [ -x .gpf/bin/kernels-base ] && r k-base-filter 60 .gpf/bin/kernels-base "conv_backward_filter&bf16"
  # The producer's ring: 2 to 7 stages of 32 KiB (5 by default), a block
  # per tile or resident blocks looping over tiles; then ncu on conv3's
  # TF32 forward and data gradient.
  for st in ${STAGES:-4 7}; do
    r k-stages-$st 60 env ALEXNET_TMA_STAGES=$st .gpf/bin/kernels conv_forward conv_backward_data
  done
  for st in ${RESIDENT:-5}; do
    r k-resident-$st 60 env ALEXNET_TMA_PERSISTENT=1 ALEXNET_TMA_STAGES=$st .gpf/bin/kernels conv_forward conv_backward_data
  done
  for p in tf32 bf16; do
    r bench-$p-resident 60 env ALEXNET_TMA_PERSISTENT=1 $H bench configs/alexnet.json --batch-size 128,256 --device cuda --precision $p
  done
  for k in conv_forward conv_backward_data; do
    r ncu-tma-$k 90 ncu --clock-control none -k regex:${k}_nhwc_tf32_wg_tma_big -c 1 \
      --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
      .gpf/bin/kernels "conv3 tf32"
  done
fi
if [ "${PHASES:-0}" = 1 ]; then
  # Strided data gradients by phases (the default) and the TMA data
  # gradients with the roles swapped (128 pixels × 64 channels, groups of
  # at most 64 channels: conv2 and conv1's phases): checks, then every
  # layer's data gradient beside an earlier build's (kernels-base, put
  # there by hand) and conv1's by columns; the TF32 pixel grid copies.
  r conv_data_phases 200 .gpf/bin/gpu_ops conv_data_phases conv_tma
  for p in tf32 bf16; do
    r k-data-$p 60 .gpf/bin/kernels "conv_backward_data&$p" conv_phase
    [ -x .gpf/bin/kernels-base ] && r k-data-base-$p 60 .gpf/bin/kernels-base "conv_backward_data&$p"
    r k-cols-$p 30 env ALEXNET_STRIDED_DATA=columns .gpf/bin/kernels "conv_backward_data&conv1 $p"
    r k-data-no-t-$p 30 env ALEXNET_TRANSPOSED=0 .gpf/bin/kernels "conv_backward_data&conv2 $p"
    # conv1's phases and conv2 on each kernel the heuristic can pick for a
    # group of 48 channels, the autotune off: `_t_slim` (big tiles turned
    # off), the swapped TMA kernel (the default), the 128×128 TMA kernel.
    for v in slim:ALEXNET_BIG_TILES=0 t:ALEXNET_BIG_TILES=1 big:ALEXNET_TRANSPOSED=0; do
      r k-data-${v%%:*}-$p 30 env ALEXNET_AUTOTUNE=0 ${v#*:} .gpf/bin/kernels "conv_backward_data&conv1 $p" "conv_backward_data&conv2 $p"
    done
  done
  r k-grid 30 .gpf/bin/kernels pixel_grid
  [ -x .gpf/bin/kernels-base ] && r k-grid-base 30 .gpf/bin/kernels-base pixel_grid
  # What bounds conv2's two products still behind cuDNN: its bf16 data
  # gradient on each of the three kernels (the autotune off) and its TF32
  # weight gradient as the step runs it.
  for v in slim:ALEXNET_BIG_TILES=0 t:ALEXNET_BIG_TILES=1 big:ALEXNET_TRANSPOSED=0; do
    r ncu-conv2-data-${v%%:*} 90 env ALEXNET_AUTOTUNE=0 ${v#*:} ncu --clock-control none -k regex:conv_backward_data_nhwc -c 1 \
      --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
      .gpf/bin/kernels "conv_backward_data&conv2 bf16"
  done
  r ncu-conv2-filter-tf32 90 ncu --clock-control none -k regex:conv_backward_filter -c 1 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
    .gpf/bin/kernels "conv_backward_filter&conv2 tf32"
  # The new kernels under the sanitizers, small shapes only.
  for tool in memcheck racecheck; do
    r phases-$tool 150 env ALEXNET_TEST_SMALL=1 ALEXNET_ARENA=0 compute-sanitizer --tool $tool --error-exitcode 1 .gpf/bin/gpu_ops conv_data_phases conv_tma
  done
fi
if [ "${WG_BIG:-0}" = 1 ]; then
  r conv_wg_big 120 .gpf/bin/gpu_ops conv_wg_big
  for tool in memcheck racecheck; do
    r wg-big-$tool 90 env ALEXNET_TEST_SMALL=1 ALEXNET_ARENA=0 compute-sanitizer --tool $tool --error-exitcode 1 .gpf/bin/gpu_ops conv_wg_big
  done
  # Every channels-last product, data gradients too, on the 128×128
  # warpgroup tiles fed by `cp.async` (gpu_ops conv_tma covers the TMA ones).
  r wg-big-forced 150 env ALEXNET_WGMMA=1 ALEXNET_TMA=0 ALEXNET_GEMM_TILES=128 ALEXNET_BIG_TILES=1 .gpf/bin/gpu_ops conv_forward conv_backward_data
  # The conv forwards alone, 128×128 tiles forced, on and off the warpgroup kernels.
  [ "${TMA:-0}" = 1 ] || r k-wg-big 90 env ALEXNET_BIG_TILES=1 ALEXNET_TRANSPOSED=0 .gpf/bin/kernels conv_forward
  r k-no-wg-big 90 env ALEXNET_WG_BIG=0 ALEXNET_BIG_TILES=1 ALEXNET_TRANSPOSED=0 .gpf/bin/kernels conv_forward
  for p in tf32 bf16; do
    r bench-$p-no-wg-big 60 env ALEXNET_WG_BIG=0 $H bench configs/alexnet.json --batch-size 128,256 --device cuda --precision $p
  done
fi
if [ "${TRAIN:-1}" = 1 ]; then
  # Two epochs: the synthetic set is made in the first, kept for the second.
  r main-job 90 $H train configs/alexnet.json --device cuda --precision bf16 --epochs 2 --out /tmp/runs-main --quiet
  cp /tmp/runs-main/*/metrics.jsonl $L/main-job-metrics.jsonl 2>/dev/null
  sed "s#/usr/share/datasets/fashion-mnist#$PWD/.gpf/fm#" configs/fashion-mnist.json > /tmp/fashion.json
  r fashion-bf16 150 $H train /tmp/fashion.json --device cuda --precision bf16 --out /tmp/runs
  ck=$(ls /tmp/runs/*/checkpoints/*.safetensors 2>/dev/null | sort | tail -n 1)
  [ -n "$ck" ] && r fashion-bf16-test 60 $H test "$ck" --device cuda
  cp /tmp/runs/*/metrics.jsonl $L/fashion-bf16-metrics.jsonl 2>/dev/null
fi
if [ "${CUDNN_KERNELS:-1}" = 1 ] && python3 -c 'import torch' 2>/dev/null; then
  r cudnn-kernels 120 python3 benches/pytorch_reference.py --batch-size 128 --precision tf32 bf16 --layers --kernels --steps 10
fi
if [ "${COMPARE:-0}" = 1 ]; then
  # Issue 4's table (what `bash .gpu/run.sh compare` makes, from this
  # pack): our step with its per-layer profile and every kernel, TF32 and
  # bf16, then PyTorch's on the same GPU; the files benches/compare_table.py
  # reads, in $L/table/.
  T=$L/table; mkdir -p $T
  { nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; env | grep '^ALEXNET_' | sort; } > $T/settings.txt
  for p in tf32 bf16; do
    r compare-ours-$p 90 $H bench configs/alexnet.json --batch-size 128,256 --profile --precision $p --device cuda --json $T/bench-$p.json
    r compare-kernels-$p 120 env ALEXNET_BENCH_JSON=$T/kernels-$p.json .gpf/bin/kernels $p
  done
  if python3 -c 'import torch' 2>/dev/null; then
    r compare-pytorch 200 python3 benches/pytorch_reference.py --batch-size 128 256 --precision tf32 bf16 --layers
    cp $L/compare-*.log $T/ 2>/dev/null; cp $L/compare-pytorch.log $T/pytorch.log 2>/dev/null
    r compare-table 30 python3 benches/compare_table.py $T
    cp $L/compare-table.log $T/ 2>/dev/null
  else
    echo "compare-pytorch SKIPPED (python3 cannot import torch)" | tee -a $L/summary.log
  fi
fi
[ "${GPU_OPS_ALL:-1}" = 1 ] && r gpu_ops 330 .gpf/bin/gpu_ops
grep -h "gpu_ops:\|ERROR SUMMARY\|RACECHECK SUMMARY" $L/gpu_ops*.log $L/memcheck.log $L/conv_data_phases.log $L/phases-*.log $L/conv_wg_big.log $L/wg-big-*.log $L/conv_tma.log $L/conv_tma_filter.log $L/tma-*.log >> $L/summary.log 2>/dev/null
grep -H "images/s\|arena" $L/bench-*.log | sed 's#.*/##' >> $L/summary.log
grep -h "ten views\|centre crop" $L/fashion-bf16-test.log >> $L/summary.log 2>/dev/null
cat $L/summary.log; pack
