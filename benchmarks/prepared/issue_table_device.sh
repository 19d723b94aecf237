#!/usr/bin/env bash
# Issue 13's table on the GPU in one device call:
# gemm.py's square and Qwen3-30B-A3B parts (w4a4_linear and the GEMM against cuBLAS BF16, graph
# replay, weights rotated past L2), then decode_step.py. Each part under its own time limit, so
# that a slow part leaves the others' figures in $OUT (sq/, qw/, ds/). ~1 min with warm caches,
# several on a fresh machine (compiles). Carrying `ab` (`python benchmarks/kernel_ab.py prepare
# --out ab`, here) saves the CUDA kernels' compiles; see device_env.sh. The grouped experts:
# `python3 benchmarks/gemm.py --only grouped`.
set -u
source benchmarks/prepared/device_env.sh
mkdir -p "$OUT/sq" "$OUT/qw" "$OUT/ds"
timeout -s ABRT 240 python3 benchmarks/gemm.py --only square --out "$OUT/sq" 2>&1 | tail -40
date -u | tee -a "$OUT/gpu.txt"
timeout -s ABRT 150 python3 benchmarks/gemm.py --only qwen --out "$OUT/qw" 2>&1 | tail -30
date -u | tee -a "$OUT/gpu.txt"
timeout -s ABRT 180 python3 benchmarks/decode_step.py --out "$OUT/ds" 2>&1 | tail -30
date -u | tee -a "$OUT/gpu.txt"
