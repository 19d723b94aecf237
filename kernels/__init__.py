"""miniTE's Triton kernels (imported as ``minite_kernels``), reached through ``minite_common``.

``dispatch.kernel_arch(device)`` says whether they serve a device; the entry points below take
NVFP4 operands as objects with ``codes``, ``scales``, ``decode_scale``, ``rows`` and ``cols``
(``minite_common.NVFP4Tensor``) and import Triton only when called. This package imports nothing
from ``minite_common``: what the kernels need of the recipe (e.g. the RHT matrix) is passed in.
"""

from __future__ import annotations

import torch

from .dispatch import BACKEND_ENV, kernel_arch, kernel_layout_enabled

__all__ = [
    "BACKEND_ENV",
    "decoded_weight",
    "fold_partials",
    "gemm_path",
    "grouped_nvfp4_gemm",
    "kernel_arch",
    "kernel_layout",
    "nvfp4_gemm",
    "nvfp4_gemm_partials",
    "quantize_grad_operands",
    "quantize_nvfp4",
    "quantized_rows_gemm",
    "strict_kernels",
    "swiglu_backward",
    "swiglu_forward",
]


def quantize_nvfp4(x: torch.Tensor, *, amax: str, block_2d: bool, global_amax=None):
    """``(codes, scales, decode_scale)`` of ``x``, bit-identical to the torch reference."""
    from .nvfp4_quantize import quantize_nvfp4_triton

    return quantize_nvfp4_triton(x, amax=amax, block_2d=block_2d, global_amax=global_amax)


def nvfp4_gemm(a, w, bias=None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``a @ w.T`` with the contract's epilogue, on the kernel family of ``a``'s device."""
    if kernel_arch(a.device) == "sm100":
        from .w4a4_gemm_sm100 import nvfp4_gemm_sm100

        return nvfp4_gemm_sm100(a, w, bias, out_dtype)
    from .w4a4_gemm import nvfp4_gemm_sm90

    return nvfp4_gemm_sm90(a, w, bias, out_dtype)


def quantized_rows_gemm(x: torch.Tensor, w, bias=None, out_dtype=torch.bfloat16):
    """``a @ w.T`` with ``a`` the per-row-amax NVFP4 quantization of BF16 rows ``x``, computed
    without materializing ``a`` where a kernel's activation pass quantizes (Hopper, 8 < M <=
    256, and M = 1 at K <= 4096 on weights with their kernel layout; see
    ``w4a4_gemm.quantized_rows_gemm_sm90``); None where none does. Bitwise equal to
    ``nvfp4_gemm(quantize(x), w, ...)``."""
    if kernel_arch(x.device) != "sm90":
        return None
    from .w4a4_gemm import quantized_rows_gemm_sm90

    return quantized_rows_gemm_sm90(x, w, bias, out_dtype)


def kernel_layout(w):
    """A kernel-friendly copy of NVFP4 weight ``w``'s codes and scales where a GPU kernel reads one
    (Hopper: the streamed small-M GEMM's :class:`~.w4a4_gemm_cuda.UnitLayout`, for the weights it
    serves), else None; None too with ``MINITE_KERNEL_LAYOUT=0``. Same numbers either way."""
    if kernel_arch(w.codes.device) != "sm90" or not kernel_layout_enabled():
        return None
    from .w4a4_gemm_cuda import layout_for

    return layout_for(w)


def nvfp4_gemm_partials(a, w) -> torch.Tensor:
    """Float32 [ceil(K/512), M, N]: the fold-chunk partials of ``a @ w.T`` (contract v2), which
    :func:`fold_partials` turns into exactly :func:`nvfp4_gemm`'s output; concatenating the
    partials of K shards that start on multiples of 512 gives the unsharded GEMM's (Hopper)."""
    if kernel_arch(a.device) != "sm90":
        raise NotImplementedError(
            "fold-chunk partials exist on the Hopper (sm_90) kernels only; the Blackwell path "
            "accumulates in tl.dot_scaled's own order"
        )
    from .w4a4_gemm import nvfp4_gemm_partials_sm90

    return nvfp4_gemm_partials_sm90(a, w)


def fold_partials(partials, a_decode_scale, w_decode_scale, bias=None, out_dtype=torch.bfloat16):
    """The GEMM's in-order fold of ``partials`` [C, M, N] and its epilogue (bitwise)."""
    from .w4a4_gemm import fold_partials as impl

    return impl(partials, a_decode_scale, w_decode_scale, bias, out_dtype)


def grouped_nvfp4_gemm(a, w, sizes, out_dtype: torch.dtype = torch.bfloat16):
    """MoE experts' GEMM: rows of ``a`` grouped by ``sizes`` (a host list or a device tensor,
    which the Hopper kernel reads on the device) against ``w`` stacked [G*N, K]."""
    if kernel_arch(a.device) == "sm100":
        from .w4a4_gemm_sm100 import grouped_nvfp4_gemm_sm100

        return grouped_nvfp4_gemm_sm100(a, w, sizes, out_dtype)
    from .w4a4_gemm import grouped_nvfp4_gemm_sm90

    return grouped_nvfp4_gemm_sm90(a, w, sizes, out_dtype)


def gemm_path(arch: str) -> str:
    """Name of the kernel family and its K-order configuration for ``arch`` (sm90, sm100)."""
    if arch == "sm100":
        from .w4a4_gemm_sm100 import gemm_path_sm100

        return gemm_path_sm100()
    from .w4a4_gemm import gemm_path_sm90

    return gemm_path_sm90()


def quantize_grad_operands(x: torch.Tensor, **kwargs):
    """The learner's backward operands on Hopper as exact BF16 ``code * scale`` values (see
    ``nvfp4_grad.quantize_grad_operands``)."""
    from .nvfp4_grad import quantize_grad_operands as impl

    return impl(x, **kwargs)


def scale_rows(
    acc: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype, rows_per_scale: int = 0
) -> torch.Tensor:
    """``out_dtype(acc * scale[r // rows_per_scale])``: the backward GEMMs' epilogue (see
    ``nvfp4_grad.scale_rows``)."""
    from .nvfp4_grad import scale_rows as impl

    return impl(acc, scale, out_dtype, rows_per_scale)


def decoded_weight(w, cache: bool = True) -> torch.Tensor:
    """BF16 ``code * scale * 2^-7`` of an NVFP4 weight in natural order (cached per version)."""
    from .nvfp4_grad import decoded_weight as impl

    return impl(w, cache)


def strict_kernels():
    """The strict-mode kernels (module ``strict_ops``: Triton twins of ``minite_common.ops``)."""
    from . import strict_ops

    return strict_ops


def swiglu_forward(gate_up: torch.Tensor, probs: torch.Tensor | None = None) -> torch.Tensor:
    """The experts' SwiGLU (times the router probabilities) in one pass (see ``swiglu``)."""
    from .swiglu import swiglu_forward as impl

    return impl(gate_up, probs)


def swiglu_backward(grad, gate_up, probs=None, need_probs_grad: bool = False):
    """``(d gate_up, d probs or None)`` of :func:`swiglu_forward` in one pass."""
    from .swiglu import swiglu_backward as impl

    return impl(grad, gate_up, probs, need_probs_grad)
