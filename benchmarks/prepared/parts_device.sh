#!/usr/bin/env bash
# Issue 13 (benchmarks/NOTES_kernels.md, forty-ninth session): does the streamed kernel (M <= 16)
# keep up with its weight stream? On any GPU the consumers alone (consumer_probe.py; its cubin
# compiles on the device in ~30 s unless ab/cache has it); on an H200 also the bare-stream probe
# and every timing build against the shipped kernel, `early` (each stage released as soon as its
# data landed; wrong outputs) included: the stream's and the parts' times never measured there.
# Prepare here first (no GPU, ~4 min, the tree clean):
#   P=benchmarks/prepared; python benchmarks/kernel_ab.py prepare --out ab \
#     --patch early=$P/stream_probe_early.patch \
#     --patch early_nopart=$P/stream_probe_early.patch+$P/stream_probe_nopart.patch \
#     --patch nopart=$P/stream_probe_nopart.patch --patch nocompute=$P/stream_probe_nocompute.patch \
#     --patch bare=$P/stream_probe_nopart.patch+$P/stream_probe_noact.patch+$P/stream_probe_nocompute.patch \
#     --patch nodecode=$P/stream_probe_nodecode.patch --patch nomma=$P/stream_probe_nomma.patch
# Device (carry ["ab"]): bash benchmarks/prepared/parts_device.sh
set -u
source benchmarks/prepared/device_env.sh
(cd benchmarks && timeout -s ABRT 120 python3 consumer_probe.py --out "$OUT/cp" 2>&1 | tail -20)
if grep -q H200 "$OUT/gpu.txt"; then
  (cd benchmarks && timeout -s ABRT 100 python3 stream_probe.py --out "$OUT/sp" 2>&1 | tail -16)
  timeout -s ABRT 240 python3 benchmarks/kernel_ab.py run --dir ab \
    --names shipped,early,early_nopart,nopart,nocompute,bare,nodecode,nomma \
    --times 1,8,16 --no-linear --shapes "8192^2,qkv,o,4096x12288,28672x4096" > "$OUT/parts.log" 2>&1
  grep -v "^\[" "$OUT/parts.log" | tail -18
fi
date -u | tee -a "$OUT/gpu.txt"
