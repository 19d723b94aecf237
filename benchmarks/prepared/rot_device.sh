#!/usr/bin/env bash
# Issue 13 (benchmarks/NOTES_kernels.md, forty-ninth session; prepared, not yet run): the unit
# layout with each code-word pair's bits placed for decode_pair_unit (3 funnel shifts, 4 byte
# gathers, 4 masks and 4 multiplies per 8 codes instead of 18 instructions),
# benchmarks/prepared/unit_rot.patch (kernel, unit_layout, CPU tests), against main's kernel
# source (`main`: the old decode timed on the new layout's words; its outputs are wrong, its time
# is not), then the streamed GPU tests on the patched tree. Prepare here first (no GPU, ~1 min):
#   git apply benchmarks/prepared/unit_rot.patch
#   python benchmarks/kernel_ab.py prepare --out ab --rev main=HEAD   # `shipped`: the patched file
#   git checkout -- kernels tests
# Device (carry ["ab"]): bash benchmarks/prepared/rot_device.sh
set -u
source benchmarks/prepared/device_env.sh
git apply benchmarks/prepared/unit_rot.patch || patch -p1 -s < benchmarks/prepared/unit_rot.patch || exit 1
timeout -s ABRT 150 python3 benchmarks/kernel_ab.py run --dir ab --names shipped,main \
  --times 1,8,16 --no-linear > "$OUT/ab.log" 2>&1
grep -v "^\[" "$OUT/ab.log" | tail -16
date -u | tee -a "$OUT/gpu.txt"
timeout -s ABRT 280 python3 -m pytest -q -x tests/gpu/test_gpu_kernels.py -p no:cacheprovider -k \
  "streamed_gemm or ring_survives or quantized_rows or kernel_layout or batch_invariant" \
  > "$OUT/pytest.log" 2>&1
tail -4 "$OUT/pytest.log"
(cd benchmarks && timeout -s ABRT 120 python3 consumer_probe.py 2>&1 | tail -8)
