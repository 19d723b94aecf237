#!/usr/bin/env bash
# Issue 13 (benchmarks/NOTES_kernels.md, fifty-second section): the next device call, whatever
# card comes.
# - H200: the issue's table with both decode changes of 2026-12-07 (issue_table_device.sh; its
#   figures update README's H200 column, which predates them). With PARTS=1 (a second call,
#   ~5 min): parts_device.sh instead, the consumers alone (1-4 warpgroups), the bare stream and
#   the timing builds, never measured on an H200.
# - H100 (its table and the kernel test file ran in the fifty-second session): the other GPU test
#   files (last run whole on 6e90825, before the streamed kernel's decode changes; ~2-4 min).
#   Carry build/wheels too for the strict end-to-end test (gpu_suite_device.sh's header).
# First, on either card (~1 min; not with PARTS=1): scale_helpers.patch (the scale conversion's shared steps in one
# helper, and no byte duplication before the canonical decode's conversion; the same bits by the
# PTX conversion's definition, SASS 8-32 fewer instructions in the canonical-decode kernels, the
# streamed unit kernels unchanged) checked byte for byte against the shipped kernels, then timed.
# Ship it (apply, commit) only if --check reports 0 mismatches.
# Prepare here (no GPU, ~4 min, the tree clean): parts_device.sh's `prepare` command (into `ab`)
# with `--patch helpers=benchmarks/prepared/scale_helpers.patch` added.
# Device (carry ["ab"]): bash benchmarks/prepared/next_device.sh
set -u
source benchmarks/prepared/device_env.sh
if [ "${PARTS:-0}" != 1 ]; then
  timeout -s ABRT 120 python3 benchmarks/kernel_ab.py run --dir ab --names shipped,helpers \
    --check 1,9,16,64,256 --times 1,64,256 --no-linear > "$OUT/helpers.log" 2>&1
  grep -v "^\[" "$OUT/helpers.log" | tail -20
fi
if ! grep -q H200 "$OUT/gpu.txt"; then
  bash benchmarks/prepared/gpu_suite_device.sh tests/gpu --ignore=tests/gpu/test_gpu_kernels.py
elif [ "${PARTS:-0}" = 1 ]; then
  bash benchmarks/prepared/parts_device.sh
else
  bash benchmarks/prepared/issue_table_device.sh
fi
