#!/usr/bin/env bash
# The polled hand-off (stream_sentinel.patch) on the GPU machine, one phase per device call.
# Here first: git apply benchmarks/prepared/stream_sentinel.patch
#             python benchmarks/kernel_ab.py prepare --out ab --rev before=HEAD
# Then on the GPU (ab travels, untracked):   bash benchmarks/prepared/stream_sentinel_device.sh times
# (then `check`, then `tests`); each writes its output under $OUT as it comes.
set -u
phase=${1:?times, check or tests}
mkdir -p /tmp/pk && ln -sfn "$PWD/kernels" /tmp/pk/minite_kernels
export PYTHONPATH=$PWD:/tmp/pk TRITON_CACHE_DIR=$PWD/build/triton  # build/ is kept while held
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
case $phase in
  times) timeout 480 python3 -u benchmarks/kernel_ab.py run --dir ab --names before,shipped \
           --times 1,8,16 --no-linear 2>&1 | tee "$OUT/times.txt" ;;
  check) timeout 420 python3 -u benchmarks/kernel_ab.py run --dir ab --names before,shipped \
           --check 1,2,9,16 2>&1 | tee "$OUT/check.txt" ;;
  tests) timeout 480 python3 -m pytest -q -rf tests/gpu/test_gpu_kernels.py -k "streamed_gemm or \
           batch_invariant or kernel_layout or workspaces or w4a4_linear_matches or \
           quantized_rows or dispatch_picks" 2>&1 | tee "$OUT/tests.txt" ;;
  *) echo "unknown phase $phase" >&2; exit 2 ;;
esac
