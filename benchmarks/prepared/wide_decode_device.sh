#!/usr/bin/env bash
# Issue 13 (benchmarks/NOTES_kernels.md, fiftieth session; prepared, not yet run): would the
# register-A kernels for M > 16 (wide, mid, clustered small-M) gain from the unit layout's
# 13-instruction decode? Timing build `widedec` (benchmarks/prepared/wide_unit_decode_probe.patch:
# they decode their canonical words with decode_pair_unit, so their outputs are wrong and their
# times are what the decode would cost them) against the shipped kernel at M = 32-256. If it gains
# >= ~1.05x, the real change is the twenty-seventh session's `wide-units` design (the wide kernels
# reading the unit layout where a weight has one) with this decode. Prepare here (no GPU, ~2 min):
#   python benchmarks/kernel_ab.py prepare --out ab \
#     --patch widedec=benchmarks/prepared/wide_unit_decode_probe.patch
# Device (carry ["ab"]): bash benchmarks/prepared/wide_decode_device.sh
set -u
source benchmarks/prepared/device_env.sh
timeout -s ABRT 200 python3 benchmarks/kernel_ab.py run --dir ab --names shipped,widedec \
  --times 32,64,128,256 --no-linear > "$OUT/widedec.log" 2>&1
grep -v "^\[" "$OUT/widedec.log" | tail -22
date -u | tee -a "$OUT/gpu.txt"
