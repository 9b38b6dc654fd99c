#!/usr/bin/env bash
set -u
if NL=$(python3 -c 'import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],"lib"))' 2>/dev/null); then
  mkdir -p /tmp/nccl && ln -sf "$NL/libnccl.so.2" /tmp/nccl/libnccl.so
  export LD_LIBRARY_PATH=/tmp/nccl:$NL:${LD_LIBRARY_PATH:-}
fi
B=.gpu/bin
t0=$(date +%s)
st() { echo "--- $1 at $(( $(date +%s) - t0 )) s" >> $OUT/summary.log; }
st gpu_ops; timeout 120 $B/gpu_ops > $OUT/tests.log 2>&1; echo "gpu_ops exit $?" >> $OUT/summary.log; tail -2 $OUT/tests.log >> $OUT/summary.log
st gpu_multi; timeout 120 $B/gpu_multi >> $OUT/tests.log 2>&1; echo "gpu_multi exit $?" >> $OUT/summary.log
st tiny; timeout 60 $B/host train configs/tiny.json --device cuda --out /tmp/runs --quiet >> $OUT/tests.log 2>&1; echo "tiny exit $?" >> $OUT/summary.log
st kernels; ALEXNET_BENCH_JSON=$OUT/kernel-bench.json timeout 150 $B/kernels > $OUT/bench.log 2>&1; echo "kernels exit $?" >> $OUT/summary.log
for p in tf32 fp32; do st bench-$p; timeout 100 $B/host bench configs/alexnet.json --batch-size 128,256 --profile --precision $p --device cuda >> $OUT/bench.log 2>&1; echo "bench $p exit $?" >> $OUT/summary.log; done
st pytorch; timeout 200 python3 benches/pytorch_reference.py --batch-size 128 256 --layers --steps 20 --json $OUT/pytorch.json > $OUT/pytorch.log 2>&1; echo "pytorch exit $?" >> $OUT/summary.log
st sanitize; for tool in memcheck racecheck; do ALEXNET_TEST_SMALL=1 timeout 100 compute-sanitizer --tool $tool --error-exitcode 1 $B/gpu_ops > /tmp/s.log 2>&1; echo "sanitizer $tool exit $?" >> $OUT/summary.log; tail -4 /tmp/s.log >> $OUT/sanitize.log; done
st done
