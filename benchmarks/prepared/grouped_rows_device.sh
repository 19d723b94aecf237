#!/usr/bin/env bash
# The grouped decode GEMM quantizing its BF16 rows itself (grouped_quantized_rows.patch: MoE
# decode steps, groups averaging at most one row, one launch instead of the quantizer's and the
# GEMM's), prepared offline in the forty-fourth session: bits equal to the CPU quantizer followed
# by the grouped GEMM in Triton's interpreter (split and unsplit, K % 128 != 0, ties, NaN / Inf /
# zero / saturated rows); compiled for sm_90 with 211-214 registers per thread against the
# GEMM's 151-152 (no spills: 2 programs per SM instead of 3). Not yet run on a GPU. In one call:
# the patch applied to the device's copy, the grouped GPU tests, then gemm.py's grouped part,
# whose column "quantize, then ours" times the two launches the patch replaces in the same run
# (grouped_w4a4_linear is the one launch at 1 and 16 tokens). What decides: the tests pass and
# grouped_w4a4_linear beats "quantize, then ours" at 1 and 16 tokens on both expert shapes;
# then land the patch (git apply) with the figures in docs/kernels.md and
# benchmarks/RESULTS.md. ~2-4 min on a fresh machine.
set -u
source benchmarks/prepared/device_env.sh
patch_file=benchmarks/prepared/grouped_quantized_rows.patch
(git apply "$patch_file" 2> /dev/null || patch -p1 < "$patch_file") || exit 1
timeout -s ABRT 300 python3 -m pytest -v -p no:cacheprovider tests/gpu/test_gpu_kernels.py \
  -k grouped > "$OUT/tests.txt" 2>&1
echo "pytest rc=$?"
tail -12 "$OUT/tests.txt"
mkdir -p "$OUT/gr"
timeout -s ABRT 180 python3 benchmarks/gemm.py --only grouped --out "$OUT/gr" 2>&1 | tail -14
date -u | tee -a "$OUT/gpu.txt"
