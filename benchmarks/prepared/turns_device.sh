#!/usr/bin/env bash
# The forty-seventh session's prepared device call (issue 13, benchmarks/NOTES_kernels.md): the
# streamed kernel with its tile sums handed on by turn barriers (stream_turn_sums.patch, "turns")
# against main, bits then times; on an H200 also the bare-stream probe and the timing builds of
# the forty-sixth session; last, the patch applied to this copy of the tree and the streamed GPU
# tests on it. Prepare here first (no GPU, a minute), the tree clean:
#   P=benchmarks/prepared; python benchmarks/kernel_ab.py prepare --out ab \
#     --patch turns=$P/stream_turn_sums.patch \
#     --patch nopart=$P/stream_probe_nopart.patch --patch nocompute=$P/stream_probe_nocompute.patch \
#     --patch bare=$P/stream_probe_nopart.patch+$P/stream_probe_noact.patch+$P/stream_probe_nocompute.patch \
#     --patch nodecode=$P/stream_probe_nodecode.patch --patch nomma=$P/stream_probe_nomma.patch
# Device (carry ["ab"]): bash benchmarks/prepared/turns_device.sh (LEAN=1: no H200 probes)
set -u
source benchmarks/prepared/device_env.sh
timeout -s ABRT 150 python3 benchmarks/kernel_ab.py run --dir ab --names shipped,turns \
  --check 1,2,9,16 --times 1,8,16 --no-linear > "$OUT/ab.log" 2>&1
grep -v "^\[" "$OUT/ab.log" | tail -24
if [ -z "${LEAN:-}" ] && grep -q H200 "$OUT/gpu.txt"; then  # LEAN=1: bits, times, tests only
  (cd benchmarks && timeout -s ABRT 100 python3 stream_probe.py --out "$OUT/sp" 2>&1 | tail -14)
  timeout -s ABRT 150 python3 benchmarks/kernel_ab.py run --dir ab \
    --names shipped,nopart,nocompute,bare,nodecode,nomma --times 1,16 --no-linear \
    --shapes "8192^2,qkv,o" > "$OUT/probe.log" 2>&1
  grep -v "^\[" "$OUT/probe.log" | tail -10
fi
date -u | tee -a "$OUT/gpu.txt"
if command -v patch > /dev/null; then
  patch -p1 -s < benchmarks/prepared/stream_turn_sums.patch || exit 1
else
  git apply benchmarks/prepared/stream_turn_sums.patch || exit 1
fi
timeout -s ABRT 240 python3 -m pytest -q -x tests/gpu/test_gpu_kernels.py -k \
  "streamed_gemm or tile_parts or ring_survives or quantized_rows or kernel_layout or batch_invariant" \
  > "$OUT/pytest.log" 2>&1
tail -4 "$OUT/pytest.log"
