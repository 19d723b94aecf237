#!/usr/bin/env bash
# The streamed kernel's ring at 6 stages, one consumer warpgroup per stage (the fix of a rare hang,
# forty-first session, 8b68931), against the previous kernel (5 stages at BM = 16, 7 at BM = 8,
# shared round-robin by the consumer warpgroups). The forty-third session ran the stress test
# (passed) and the two variants that hung on the old ring (both finished); the bits and times
# against `before` are what is left. Here first (nvcc, ~1.5 min):
#   python benchmarks/kernel_ab.py prepare --out ab --rev before=6d05d18
# Then on the GPU (ab travels, untracked): bash benchmarks/prepared/stream_ring_device.sh.
# What decides: the stress test passes again (30000 back-to-back launches end, eager bits), 0
# mismatches against `before`, and the times at M = 1, 8, 16 about even (the ring's depth
# changed: 5 -> 6 stages at 8 < M <= 16, 7 -> 6 at M <= 8). Every step has its own time limit
# (~1.5 min in all when nothing hangs); then, in the same or a second call,
# issue_table_device.sh.
set -u
source benchmarks/prepared/device_env.sh
timeout 200 python3 -m pytest -q tests/gpu/test_gpu_kernels.py -k ring 2>&1 | tail -3 |
  tee "$OUT/stress.txt"
ab="python3 -u benchmarks/kernel_ab.py run --dir ab"
timeout 90 $ab --names shipped,before --check 1,2,9,16 2>&1 | tee "$OUT/check.txt"
timeout 120 $ab --names shipped,before --times 1,8,16 --no-linear 2>&1 | tee "$OUT/times.txt"
date -u | tee -a "$OUT/gpu.txt"
