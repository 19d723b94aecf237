#!/usr/bin/env bash
# Issue 13 (benchmarks/NOTES_kernels.md, fifty-first section), the first call of the next session
# on any GPU (~5 min on a fresh H100; ~8 on an H200 with the issue's table):
# 1. The packed scale conversion (507030f) beside the kernel before it (`prev`, 8574743): its
#    re-timing (the one call that ran had one point at 0.956x) and the streamed GPU tests on the
#    shipped tree (bits against Triton, the ring stress, weight updates in graphs, batch
#    invariance), which the fifty-first session could not run.
# 2. On an H200 only: the issue's table with both decode changes (issue_table_device.sh; its
#    figures update README's H200 column), then, in a second call, parts_device.sh (prepare `ab`
#    per its header first, adding `--rev prev=8574743`).
# Prepare here (no GPU, ~1 min, the tree clean):
#   python benchmarks/kernel_ab.py prepare --out ab --rev prev=8574743
# Device (carry ["ab"]): bash benchmarks/prepared/next_device.sh
set -u
source benchmarks/prepared/device_env.sh
timeout -s ABRT 150 python3 benchmarks/kernel_ab.py run --dir ab --names shipped,prev \
  --check 1,16 --times 1,8,16 > "$OUT/ab.log" 2>&1
grep -v "^\[" "$OUT/ab.log" | tail -32
if grep -q H200 "$OUT/gpu.txt"; then
  bash benchmarks/prepared/issue_table_device.sh
else
  timeout -s ABRT 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_kernels.py -k \
    "streamed_gemm or ring_survives or quantized_rows or kernel_layout or batch_invariant" \
    > "$OUT/tests.txt" 2>&1
  echo "pytest rc=$?"
  tail -5 "$OUT/tests.txt"
fi
date -u | tee -a "$OUT/gpu.txt"
