#!/usr/bin/env bash
# The streamed kernel's image variant (w4a4_linear at 8 < M <= 16) copying its first units' weight
# into the ring before griddepcontrol.wait, while the image pass still runs (same bits; 1, 2 or all
# five stages: stream_image_early{1,2,5}.patch). Here first (nvcc, ~2 min):
#   python benchmarks/kernel_ab.py prepare --out ab \
#     --patch early1=benchmarks/prepared/stream_image_early1.patch \
#     --patch early2=benchmarks/prepared/stream_image_early2.patch \
#     --patch early5=benchmarks/prepared/stream_image_early5.patch
# Then on the GPU (ab travels, untracked): bash benchmarks/prepared/stream_image_early_device.sh
# [tests]. Output under $OUT as it comes. What decides: 0 mismatches, and the `linear` times at
# M = 12-16 (the GEMM times do not run the image variant) faster than shipped's.
set -u
mkdir -p /tmp/pk && ln -sfn "$PWD/kernels" /tmp/pk/minite_kernels
export PYTHONPATH=$PWD:/tmp/pk TRITON_CACHE_DIR=$PWD/build/triton  # build/ is kept while held
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
date -u | tee -a "$OUT/gpu.txt"
ab="python3 -u benchmarks/kernel_ab.py run --dir ab --names shipped,early1,early2,early5"
timeout 200 $ab --times 16 --shapes qkv,o,8192^2 2>&1 | tee "$OUT/times16.txt"
timeout 120 $ab --check 9,16 2>&1 | tee "$OUT/check.txt"
timeout 200 $ab --times 12,16 2>&1 | tee "$OUT/times.txt"
if [ "${1:-}" = tests ]; then  # the streamed GPU tests with early1 applied to this copy of the tree
  git apply benchmarks/prepared/stream_image_early1.patch &&
    timeout 240 python3 -m pytest -q -rf tests/gpu/test_gpu_kernels.py -k "streamed_gemm or \
      batch_invariant or kernel_layout or quantized_rows" 2>&1 | tee "$OUT/tests.txt"
fi
date -u | tee -a "$OUT/gpu.txt"
