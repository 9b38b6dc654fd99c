#!/usr/bin/env bash
# engine-v2 validation + pinned uploads
set -u
B=.gpu/bin
T=$OUT/tests.log
if NL=$(python3 -c 'import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],"lib"))' 2>/dev/null); then
  mkdir -p /tmp/nccl && ln -sf "$NL/libnccl.so.2" /tmp/nccl/libnccl.so; export LD_LIBRARY_PATH=/tmp/nccl:$NL:${LD_LIBRARY_PATH:-}; fi
timeout 200 $B/gpu_ops > $OUT/gpu_ops.log 2>&1; echo "gpu_ops exit $?" >> $T; tail -3 $OUT/gpu_ops.log >> $T
for tool in memcheck racecheck; do
  ALEXNET_TEST_SMALL=1 timeout 150 compute-sanitizer --tool $tool --error-exitcode 1 $B/gpu_ops > /tmp/s.log 2>&1; echo "$tool exit $?" >> $T; tail -3 /tmp/s.log >> $T
done
timeout 100 $B/kernels > $OUT/kernels.log 2>&1; echo "kernels exit $?" >> $T
for p in tf32 bf16; do timeout 60 $B/host bench configs/alexnet.json --batch-size 128,256 --profile --precision $p --device cuda >> $OUT/bench.log 2>&1; echo "bench $p exit $?" >> $T; done
for pin in 0 1; do ALEXNET_PINNED_UPLOADS=$pin timeout 60 $B/host train configs/alexnet.json --precision bf16 --max-steps 200 --log-every 50 --device cuda --out /tmp/runs$pin --quiet > $OUT/train-pin$pin.log 2>&1; echo "train pin=$pin exit $?" >> $T; done
