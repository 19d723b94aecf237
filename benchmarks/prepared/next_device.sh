#!/usr/bin/env bash
# Issue 13 (benchmarks/NOTES_kernels.md, fifty-second section): the next device call, whatever
# card comes: the issue's table with both decode changes of 2026-12-07 (issue_table_device.sh;
# on an H200 its figures update README's H200 column, which predates them; on an H100 they
# refresh the decode-step rows, which predate them too). With PARTS=1 on an H200 (a second
# call, ~5 min): parts_device.sh instead, the consumers alone (1-4 warpgroups), the bare stream
# and the timing builds, never measured on an H200.
# Prepare here (no GPU, ~4 min, the tree clean): parts_device.sh's `prepare` command with
# `--rev prev=8574743` added, into `ab`. Device (carry ["ab"]): bash benchmarks/prepared/next_device.sh
set -u
source benchmarks/prepared/device_env.sh
if [ "${PARTS:-0}" = 1 ] && grep -q H200 "$OUT/gpu.txt"; then
  bash benchmarks/prepared/parts_device.sh
else
  bash benchmarks/prepared/issue_table_device.sh
fi
