#!/usr/bin/env bash
# The streamed kernel's partials by whole 32-byte sectors and its weight copies first to evict from
# L2 (stream_sector_partials.patch, stream_evict_first.patch; same bits), with two timing probes,
# in one GPU call of about six minutes with Triton's compiles. Here first (nvcc, ~4 min):
#   python benchmarks/kernel_ab.py prepare --out ab \
#     --patch sector=benchmarks/prepared/stream_sector_partials.patch \
#     --patch evict=benchmarks/prepared/stream_evict_first.patch \
#     --patch sector_evict=benchmarks/prepared/stream_sector_partials.patch+benchmarks/prepared/stream_evict_first.patch \
#     --patch storeonly=benchmarks/prepared/stream_probe_storeonly.patch \
#     --patch nopart=benchmarks/prepared/stream_probe_nopart.patch
# Then on the GPU (ab travels, untracked): bash benchmarks/prepared/stream_l2_device.sh
# Output under $OUT as it comes. The probes give wrong outputs: never --check them.
set -u
mkdir -p /tmp/pk && ln -sfn "$PWD/kernels" /tmp/pk/minite_kernels
export PYTHONPATH=$PWD:/tmp/pk TRITON_CACHE_DIR=$PWD/build/triton  # build/ is kept while held
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
date -u | tee -a "$OUT/gpu.txt"
ab="python3 -u benchmarks/kernel_ab.py run --dir ab"
timeout 150 $ab --names shipped,sector,evict,sector_evict --check 1,2,9,16 2>&1 | tee "$OUT/check.txt"
timeout 150 $ab --names shipped,sector,evict,sector_evict,storeonly,nopart --times 16,8,1 \
  --no-linear 2>&1 | tee "$OUT/times.txt"
timeout 150 $ab --names shipped,sector_evict --times 1,16 2>&1 | tee "$OUT/linear.txt"
# the streamed kernel's GPU tests with both patches applied to this machine's copy of the tree
git apply benchmarks/prepared/stream_sector_partials.patch benchmarks/prepared/stream_evict_first.patch &&
  timeout 240 python3 -m pytest -q -rf tests/gpu/test_gpu_kernels.py -k "streamed_gemm or \
    batch_invariant or kernel_layout or quantized_rows" 2>&1 | tee "$OUT/tests.txt"
date -u | tee -a "$OUT/gpu.txt"
