#!/usr/bin/env bash
# Sourced by the device scripts here: the project importable from the tree (kernels/ as
# minite_kernels), Triton's and miniTE's caches in the tree (`ab/cache` holds the cubins that
# `kernel_ab.py prepare` compiled, so the device spends no time in nvcc), a Python traceback where
# `timeout -s ABRT` cuts a hang, and the GPU and start time in $OUT/gpu.txt.
mkdir -p /tmp/pk && ln -sfn "$PWD/kernels" /tmp/pk/minite_kernels
export PYTHONPATH=$PWD:/tmp/pk TRITON_CACHE_DIR=$PWD/build/triton MINITE_CACHE_DIR=$PWD/ab/cache
export PYTHONFAULTHANDLER=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
date -u | tee -a "$OUT/gpu.txt"
