#!/usr/bin/env bash
# The streamed kernel's ring at 6 stages, one consumer warpgroup per stage (the fix of a rare hang,
# forty-first session), checked and timed against the previous kernel (5 stages at BM = 16, 7 at
# BM = 8, shared round-robin by the consumer warpgroups). Here first (nvcc, ~1 min):
#   python benchmarks/kernel_ab.py prepare --out ab --rev before=6d05d18   (main before the fix, 8b68931)
# Then on the GPU (ab travels, untracked): bash benchmarks/prepared/stream_ring_device.sh.
# What decides: the stress test passes (30000 back-to-back launches end, eager bits), 0
# mismatches against `before`, and the times at M = 1, 8, 16 about even (the ring's depth
# changed: 5 -> 6 stages at 8 < M <= 16, 7 -> 6 at M <= 8).
set -u
mkdir -p /tmp/pk && ln -sfn "$PWD/kernels" /tmp/pk/minite_kernels
export PYTHONPATH=$PWD:/tmp/pk TRITON_CACHE_DIR=$PWD/build/triton MINITE_CACHE_DIR=$PWD/ab/cache
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
date -u | tee -a "$OUT/gpu.txt"
timeout 330 python3 -m pytest -q tests/gpu/test_gpu_kernels.py -k ring 2>&1 | tail -3 |
  tee "$OUT/stress.txt"
ab="python3 -u benchmarks/kernel_ab.py run --dir ab --names shipped,before"
timeout 90 $ab --check 1,2,9,16 2>&1 | tee "$OUT/check.txt"
timeout 120 $ab --times 1,8,16 --no-linear 2>&1 | tee "$OUT/times.txt"
date -u | tee -a "$OUT/gpu.txt"
