#!/usr/bin/env bash
# Issue 13 (benchmarks/NOTES_kernels.md, forty-ninth session): does the streamed kernel (M <= 16)
# lose its time to stages held while the consumers work? `early` releases each stage as soon as
# its data has landed (a timing build, wrong outputs), against the shipped kernel and the
# forty-sixth session's timing builds, on any GPU; on an H200 first the bare-stream probe and
# every part (never measured there). Prepare here first (no GPU, ~4 min, the tree clean):
#   P=benchmarks/prepared; python benchmarks/kernel_ab.py prepare --out ab \
#     --patch early=$P/stream_probe_early.patch \
#     --patch early_nopart=$P/stream_probe_early.patch+$P/stream_probe_nopart.patch \
#     --patch nopart=$P/stream_probe_nopart.patch --patch nocompute=$P/stream_probe_nocompute.patch \
#     --patch bare=$P/stream_probe_nopart.patch+$P/stream_probe_noact.patch+$P/stream_probe_nocompute.patch \
#     --patch nodecode=$P/stream_probe_nodecode.patch --patch nomma=$P/stream_probe_nomma.patch
# Device (carry ["ab"]): bash benchmarks/prepared/parts_device.sh
set -u
source benchmarks/prepared/device_env.sh
if grep -q H200 "$OUT/gpu.txt"; then
  (cd benchmarks && timeout -s ABRT 100 python3 stream_probe.py --out "$OUT/sp" 2>&1 | tail -16)
  NAMES=shipped,early,early_nopart,nopart,nocompute,bare,nodecode,nomma
else
  NAMES=shipped,early,early_nopart,nopart,nocompute
fi
timeout -s ABRT 240 python3 benchmarks/kernel_ab.py run --dir ab --names "$NAMES" \
  --times 1,8,16 --no-linear --shapes "8192^2,qkv,o,4096x12288,28672x4096" \
  > "$OUT/parts.log" 2>&1
grep -v "^\[" "$OUT/parts.log" | tail -18
date -u | tee -a "$OUT/gpu.txt"
