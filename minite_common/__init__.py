"""miniTE's numerical core: the NVFP4 recipe, quantizer and W4A4 linear that both engines call."""

from .autograd import nvfp4_dgrad, nvfp4_wgrad, w4a4_linear_train
from .grouped import (
    expert_counts,
    expert_swiglu,
    grouped_w4a4_linear_train,
    quantize_stacked_weight,
)
from .hadamard import random_hadamard_transform, rht_matrix
from .linear import (
    exact_block_dot,
    gemm_path,
    grouped_w4a4_linear,
    nvfp4_gemm,
    quantize_weight,
    refresh_kernel_layout,
    row_amax,
    w4a4_linear,
    with_kernel_layout,
)
from .nvfp4 import NVFP4Tensor, cat_rows, dequantize_nvfp4, quantize_nvfp4, unpack_codes
from .recipe import (
    DEFAULT_RECIPE,
    NVFP4Recipe,
    RecipeMismatchError,
    check_fingerprints,
)

__all__ = [
    "DEFAULT_RECIPE",
    "NVFP4Recipe",
    "NVFP4Tensor",
    "RecipeMismatchError",
    "cat_rows",
    "check_fingerprints",
    "dequantize_nvfp4",
    "exact_block_dot",
    "expert_swiglu",
    "gemm_path",
    "expert_counts",
    "grouped_w4a4_linear",
    "grouped_w4a4_linear_train",
    "nvfp4_dgrad",
    "nvfp4_gemm",
    "nvfp4_wgrad",
    "quantize_nvfp4",
    "quantize_stacked_weight",
    "quantize_weight",
    "random_hadamard_transform",
    "refresh_kernel_layout",
    "rht_matrix",
    "row_amax",
    "unpack_codes",
    "w4a4_linear",
    "w4a4_linear_train",
    "with_kernel_layout",
]
