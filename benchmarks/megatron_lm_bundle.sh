#!/usr/bin/env bash
# Make the bundle benchmarks/megatron_lm_pretrain.sh needs (run where pip and git work).
#
#   benchmarks/megatron_lm_bundle.sh MEGATRON_LM_GIT_DIR DEST [REF]
#
# DEST/whl: the megatron-core 0.19.2 wheel for Python 3.12 (it holds megatron/core and
# megatron/training); DEST/mlm: Megatron-LM's entry points, the packages outside the wheel and
# the dataset helpers' Makefile (Megatron-LM runs make at start-up; the wheel lacks it) at
# REF (default core_r0.19.0, the release branch of the wheel; its megatron/training is the
# wheel's file for file), exported with git archive from a clone of NVIDIA/Megatron-LM.
set -euo pipefail
git_dir=$1
dest=$2
ref=${3:-core_r0.19.0}
mkdir -p "$dest/whl" "$dest/mlm"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d "$dest/whl" megatron-core==0.19.2
git -C "$git_dir" archive "$ref" pretrain_gpt.py gpt_builders.py hybrid_builders.py \
    model_provider.py train_rl.py megatron/rl megatron/inference megatron/post_training \
    examples/rl megatron/core/datasets/Makefile LICENSE | tar -x -C "$dest/mlm"
mv "$dest/mlm/megatron/core/datasets/Makefile" "$dest/mlm/datasets_Makefile"
rm -r "$dest/mlm/megatron/core"  # megatron.core comes from the wheel
git -C "$git_dir" rev-parse "$ref" >"$dest/mlm/MEGATRON_LM_COMMIT"
