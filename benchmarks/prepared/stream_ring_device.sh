#!/usr/bin/env bash
# The streamed kernel's ring at 6 stages, one consumer warpgroup per stage (the fix of a rare hang,
# forty-first session, 8b68931), checked and timed against the previous kernel (5 stages at
# BM = 16, 7 at BM = 8, shared round-robin by the consumer warpgroups), and the `early1` variant
# (which hung at 28672 x 4096 every time on the old ring) rebuilt on the new one. Here first
# (nvcc, ~2 min):
#   git show 6d05d18:benchmarks/prepared/stream_image_early1.patch > /tmp/early1.patch
#   python benchmarks/kernel_ab.py prepare --out ab --rev before=6d05d18 \
#     --patch early1=/tmp/early1.patch --patch noact=benchmarks/prepared/stream_probe_noact.patch
# Then on the GPU (ab travels, untracked): bash benchmarks/prepared/stream_ring_device.sh.
# What decides: the stress test passes (30000 back-to-back launches end, eager bits), 0
# mismatches against `before`, `early1` through w4a4_linear at 28672 x 4096 finishes (and the
# `noact` timing probe at 4096 x 12288, M = 16, which stalled on the old ring), and the
# times at M = 1, 8, 16 about even (the ring's depth changed: 5 -> 6 stages at 8 < M <= 16,
# 7 -> 6 at M <= 8). Every step has its own time limit; the whole fits one 600 s call (~4 min
# when nothing hangs); then, in a second call, issue_table_device.sh.
set -u
source benchmarks/prepared/device_env.sh
timeout 200 python3 -m pytest -q tests/gpu/test_gpu_kernels.py -k ring 2>&1 | tail -3 |
  tee "$OUT/stress.txt"
ab="python3 -u benchmarks/kernel_ab.py run --dir ab"
timeout -s ABRT 90 $ab --names shipped,early1 --times 12,16 --shapes 28672x4096 2>&1 |
  grep -v "^  File.*site-packages" | tee "$OUT/early1.txt"
timeout -s ABRT 70 $ab --names shipped,noact --times 16 --shapes 4096x12288 --no-linear 2>&1 |
  grep -v "^  File.*site-packages" | tee "$OUT/noact.txt"
timeout 90 $ab --names shipped,before --check 1,2,9,16 2>&1 | tee "$OUT/check.txt"
timeout 120 $ab --names shipped,before --times 1,8,16 --no-linear 2>&1 | tee "$OUT/times.txt"
date -u | tee -a "$OUT/gpu.txt"
