#!/usr/bin/env bash
# The GPU tests in one device call, the whole log in $OUT/suite.txt (its tail printed). Arguments
# go to pytest (default: tests/gpu). On a fresh machine tests/gpu/test_gpu_kernels.py alone takes
# ~6.5 min (Triton and nvcc compiles; ~75 s once cached), the other files ~2 min, so run them as
# two calls:
#   bash benchmarks/prepared/gpu_suite_device.sh tests/gpu/test_gpu_kernels.py
#   bash benchmarks/prepared/gpu_suite_device.sh tests/gpu --ignore=tests/gpu/test_gpu_kernels.py
# The strict end-to-end test needs Megatron-Core: download its wheel here and carry build/wheels
# (the device has no network), e.g.
#   pip download megatron-core==0.16.1 --no-deps --python-version 3.12 --only-binary=:all: \
#     -d build/wheels
# Carrying `ab` (kernel_ab.py prepare) saves the CUDA kernels' compiles; see device_env.sh.
set -u
source benchmarks/prepared/device_env.sh
if compgen -G "build/wheels/*.whl" > /dev/null; then
  python3 -m pip install -q --no-deps build/wheels/*.whl 2>&1 | grep -v WARNING
fi
timeout -s ABRT 560 python3 -m pytest -v -p no:cacheprovider -rs --durations=10 "${@:-tests/gpu}" \
  > "$OUT/suite.txt" 2>&1
echo "pytest rc=$?"
grep -E "FAILED|ERROR|Timeout|Fatal Python" "$OUT/suite.txt" | head -20
tail -20 "$OUT/suite.txt"
date -u | tee -a "$OUT/gpu.txt"
