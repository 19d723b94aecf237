#!/usr/bin/env bash
# Issue 13 (benchmarks/NOTES_kernels.md, fiftieth session; prepared, not yet run), one call on any
# GPU (~3 min):
# 1. `scales` (benchmarks/prepared/unit_scales.patch): the streamed kernel converts a chunk's four
#    unit-layout scale bytes with two E4M3x2 conversions from the packed word instead of four
#    (no byte extraction, no duplication): -11 instructions per chunk and consumer thread (SASS,
#    nvcc 13.0), same operations per scale, so the same bits; `--check` compares its bytes with
#    the shipped kernel's, then times. Ship it with a same-run gain.
# 2. `widedec` (benchmarks/prepared/wide_unit_decode_probe.patch, a timing build, wrong outputs):
#    every register-A kernel for M > 16 decodes with decode_pair_unit; against the shipped kernel at
#    M = 32-256, it bounds what the unit layout's decode could give them (build the 27th session's
#    `wide-units` only if it gains >= ~1.05x).
# 3. The consumers alone (consumer_probe.py), shipped and then with `scales` applied to the tree.
# Prepare here (no GPU, ~3 min, the tree clean):
#   P=benchmarks/prepared; python benchmarks/kernel_ab.py prepare --out ab \
#     --patch scales=$P/unit_scales.patch --patch widedec=$P/wide_unit_decode_probe.patch
# Device (carry ["ab"]): bash benchmarks/prepared/next_device.sh
set -u
source benchmarks/prepared/device_env.sh
timeout -s ABRT 150 python3 benchmarks/kernel_ab.py run --dir ab --names shipped,scales \
  --check 1,2,9,16 --times 1,8,16 --no-linear > "$OUT/scales.log" 2>&1
grep -v "^\[" "$OUT/scales.log" | tail -20
timeout -s ABRT 150 python3 benchmarks/kernel_ab.py run --dir ab --names shipped,widedec \
  --times 32,64,128,256 --no-linear > "$OUT/widedec.log" 2>&1
grep -v "^\[" "$OUT/widedec.log" | tail -22
(cd benchmarks && echo "consumer probe, shipped:" && timeout -s ABRT 100 python3 consumer_probe.py 2>&1 | tail -7)
git apply benchmarks/prepared/unit_scales.patch || exit 1
(cd benchmarks && echo "consumer probe, scales:" && timeout -s ABRT 100 python3 consumer_probe.py 2>&1 | tail -7)
date -u | tee -a "$OUT/gpu.txt"
