"""The learner's W4A4 linear with NVFP4 backward (Transformer Engine's NVFP4 training recipe).

Forward is exactly :func:`w4a4_linear` (the sampler's bits). Backward, which only the learner
runs and which the contract leaves to it:
- dgrad ``dX = Q(dY * w_dec) @ W_q``: the output gradient, scaled by the weight's per-channel
  decode scales, quantized in 1x16 blocks along N (per-tensor amax, stochastic rounding if the
  recipe says so), times the codes and tiles of the *same* 16x16-block weight as fprop;
- wgrad ``dW = Q(RHT(dY^T)) @ Q(RHT(X^T))^T``: both operands quantized in 1x16 blocks along the
  token dimension after the random Hadamard transform (tokens zero-padded to a multiple of 16);
- the bias gradient in float32.
All three GEMMs run through :func:`nvfp4_gemm` (the exact torch path on the CPU, the Triton
kernels on the GPU).
"""

from __future__ import annotations

import weakref

import torch

from .hadamard import random_hadamard_transform
from .linear import check_weight, nvfp4_gemm, w4a4_linear
from .nvfp4 import NVFP4Tensor, quantize_nvfp4, unpack_codes
from .recipe import DEFAULT_RECIPE, NVFP4Recipe


def transposed_weight_codes(w_q: NVFP4Tensor) -> NVFP4Tensor:
    """The codes and 16x16 tile scales of ``w_q`` [N, K] laid out as ``W^T`` [K, N], with a unit
    decode scale: ``dequantize(result) * w_q.channel_decode_scale()[None, :] == dequantize(w_q).T``.

    16x16 tiles make this a pure re-layout (no re-quantization); cached per weight version.
    """
    key = (w_q.codes.data_ptr(), w_q.codes._version, w_q.scales._version)
    cached = _TRANSPOSED.get(w_q)
    if cached is not None and cached[0] == key:
        return cached[1]
    if not w_q.block_2d or w_q.rows % 16:
        raise ValueError(
            f"dgrad needs a 16x16-block weight with a multiple of 16 rows, got {list(w_q.shape)} "
            f"(block_2d={w_q.block_2d})"
        )
    codes_t = unpack_codes(w_q.codes).t()
    tiles_t = w_q.scales[::16].t().repeat_interleave(16, dim=0)
    result = NVFP4Tensor(
        codes=(codes_t[:, 0::2] | (codes_t[:, 1::2] << 4)).contiguous(),
        scales=tiles_t.contiguous(),
        decode_scale=torch.ones((), dtype=torch.float32, device=w_q.device),
        shape=torch.Size((w_q.cols, w_q.rows)),
        dtype=w_q.dtype,
        block_2d=True,
        recipe_fingerprint=w_q.recipe_fingerprint,
    )
    _TRANSPOSED[w_q] = (key, result)
    return result


_TRANSPOSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def nvfp4_dgrad(grad_out: torch.Tensor, w_q: NVFP4Tensor, recipe: NVFP4Recipe) -> torch.Tensor:
    """``dX`` [M, K] (float32) from ``grad_out`` [M, N] and the fprop weight ``w_q`` [N, K].

    The weight's per-channel decode scales are folded into the gradient before it is quantized
    (1x16 along N, per-tensor amax), so the GEMM's weight operand is ``w_q``'s own tiles.
    """
    scaled = grad_out.float() * w_q.channel_decode_scale()
    g = quantize_nvfp4(
        scaled, amax="tensor", recipe=recipe, stochastic=recipe.grad_stochastic_rounding
    )
    return nvfp4_gemm(g, transposed_weight_codes(w_q), out_dtype=torch.float32)


def nvfp4_wgrad(grad_out: torch.Tensor, x: torch.Tensor, recipe: NVFP4Recipe) -> torch.Tensor:
    """``dW`` [N, K] (float32) from ``grad_out`` [M, N] and the layer input ``x`` [M, K]."""
    tokens = grad_out.shape[0]
    pad = -tokens % 16
    g_t = torch.nn.functional.pad(grad_out.t(), (0, pad))
    x_t = torch.nn.functional.pad(x.t(), (0, pad))
    if recipe.wgrad_rht:
        g_t, x_t = random_hadamard_transform(g_t), random_hadamard_transform(x_t)
    g_q = quantize_nvfp4(
        g_t.contiguous(), amax="tensor", recipe=recipe, stochastic=recipe.grad_stochastic_rounding
    )
    x_q = quantize_nvfp4(x_t.contiguous(), amax="tensor", recipe=recipe)
    return nvfp4_gemm(g_q, x_q, out_dtype=torch.float32)


class _W4A4LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, w_q, recipe):  # type: ignore[override]
        ctx.save_for_backward(x, weight, bias)
        ctx.w_q, ctx.recipe = w_q, recipe
        return w4a4_linear(x, w_q, bias, recipe=recipe)

    @staticmethod
    def backward(ctx, grad_y):  # type: ignore[override]
        x, weight, bias = ctx.saved_tensors
        w_q, recipe = ctx.w_q, ctx.recipe
        k, n = x.shape[-1], grad_y.shape[-1]
        g2, x2 = grad_y.reshape(-1, n), x.reshape(-1, k)
        dx = dw = db = None
        if g2.shape[0] == 0:
            dx = torch.zeros_like(x) if ctx.needs_input_grad[0] else None
            dw = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
            db = torch.zeros_like(bias) if bias is not None and ctx.needs_input_grad[2] else None
            return dx, dw, db, None, None
        if ctx.needs_input_grad[0]:
            dx = nvfp4_dgrad(g2, w_q, recipe).to(x.dtype).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            dw = nvfp4_wgrad(g2, x2, recipe).to(weight.dtype)
        if bias is not None and ctx.needs_input_grad[2]:
            db = g2.float().sum(0).to(bias.dtype)
        return dx, dw, db, None, None


def w4a4_linear_train(
    x: torch.Tensor,
    weight: torch.Tensor,
    w_q: NVFP4Tensor,
    bias: torch.Tensor | None = None,
    *,
    recipe: NVFP4Recipe = DEFAULT_RECIPE,
) -> torch.Tensor:
    """:func:`w4a4_linear` with NVFP4 backward into the high-precision master ``weight``.

    ``w_q`` must be ``quantize_weight(weight)`` (the caller caches it between optimizer steps).
    """
    check_weight(w_q, recipe, "w4a4_linear_train")
    if tuple(weight.shape) != tuple(w_q.shape):
        raise ValueError(
            f"w4a4_linear_train: master weight {list(weight.shape)} and its quantized copy "
            f"{list(w_q.shape)} differ in shape"
        )
    return _W4A4LinearFunction.apply(x, weight, bias, w_q, recipe)
