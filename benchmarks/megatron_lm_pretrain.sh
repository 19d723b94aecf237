#!/usr/bin/env bash
# Megatron-LM's pretrain_gpt.py with the miniTE spec vs --transformer-impl local, on a GPU machine.
#
#   benchmarks/megatron_lm_pretrain.sh BUNDLE OUT [megatron_lm_pretrain.py run options...]
#
# BUNDLE is what benchmarks/megatron_lm_bundle.sh made (whl/: the megatron-core wheel; mlm/:
# Megatron-LM's pretrain_gpt.py and friends at the matching release). Installs the wheel to
# /tmp/site, makes minite_kernels importable, runs benchmarks/megatron_lm_pretrain.py run.
set -euo pipefail
bundle=$(realpath "$1")
out=$(realpath -m "$2")
shift 2
repo=$(cd "$(dirname "$0")/.." && pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$bundle"/whl/*.whl
# Megatron-LM runs `make -C megatron/core/datasets` at start-up; the wheel has the built helper
# but not its Makefile: put Megatron-LM's there and name the built file, so make finds it current.
datasets=/tmp/site/megatron/core/datasets
cp "$bundle/mlm/datasets_Makefile" "$datasets/Makefile"
touch "$datasets"/helpers_cpp*.so
MAKEFLAGS="LIBEXT=$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
export MAKEFLAGS
mkdir -p /tmp/pk "$out"
ln -sfn "$repo/kernels" /tmp/pk/minite_kernels
export PYTHONPATH="$repo:/tmp/pk:/tmp/site"
export PYTHONUNBUFFERED=1
python3 "$repo/benchmarks/megatron_lm_pretrain.py" run --mlm-dir "$bundle/mlm" --out "$out" "$@"
