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
kernels on the GPU), except on Hopper (sm_90), which has no FP4 MMA: there the same operands are
quantized by fused Triton kernels straight to their exact BF16 values ``code * block scale``
(stochastic rounding and RHT included) and dgrad/wgrad run as cuBLAS BF16 GEMMs with FP32
output, the global decode scales applied after (:func:`hopper_grad_operands`). Same quantized
operands, another (free) accumulation order; ``HOPPER_CUBLAS_BACKWARD = False`` restores the
``nvfp4_gemm`` path there. The forward never changes.
"""

from __future__ import annotations

import functools
import os
import weakref

import minite_kernels
import torch
from minite_kernels.dispatch import kernel_arch

from .hadamard import RHT_SIGNS, random_hadamard_transform
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


#: Hopper backward through cuBLAS on exact BF16 operands (``MINITE_HOPPER_BACKWARD=nvfp4``: off).
HOPPER_CUBLAS_BACKWARD = os.environ.get("MINITE_HOPPER_BACKWARD", "").strip().lower() != "nvfp4"
#: Keep each NVFP4 weight's decoded BF16 copy (the Hopper dgrad operand) from one backward to the
#: next while the weight is unchanged: 2 bytes per weight element, as much as the BF16 master
#: weights. ``MINITE_CACHE_DECODED_WEIGHT=0``: decode it in every backward and keep nothing (one
#: more read of the codes and write of the copy per linear and backward). Same bits either way.
CACHE_DECODED_WEIGHT = os.environ.get("MINITE_CACHE_DECODED_WEIGHT", "1").strip() != "0"


def wgrad_rht_signs(recipe: NVFP4Recipe) -> tuple[int, ...] | None:
    """The sign vector of the RHT ``diag(signs) @ H16 / 4`` that the recipe applies to the
    wgrad operands, or None (the Hopper kernels take it as an argument: ``minite_kernels``
    imports nothing from here)."""
    return RHT_SIGNS if recipe.wgrad_rht else None


@functools.cache
def mm_out_dtype_supported(device_type: str) -> bool:
    """Whether this torch build has a float32-output BF16 ``torch.mm`` (``aten::mm.dtype``)
    kernel for ``device_type`` (``"cuda"``, ``"cpu"``): a registry look-up, nothing runs."""
    key = torch._C._dispatch_key_for_device(device_type)
    return torch._C._dispatch_has_kernel_for_dispatch_key("aten::mm.dtype", key)


def mm_f32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b`` of BF16 matrices with a float32 result and float32 accumulation, into ``out``
    when given: ``torch.mm(..., out_dtype=float32)`` where the device has that kernel (see
    :func:`mm_out_dtype_supported`), else a float32 GEMM of the operands cast up (the same exact
    products, more memory). Never a BF16-rounded product; errors (OOM, shapes) propagate."""
    if mm_out_dtype_supported(a.device.type):
        return torch.mm(a, b, out_dtype=torch.float32, out=out)
    return torch.mm(a.float(), b.float(), out=out)


def stochastic_rounding_seed(device: torch.device) -> torch.Tensor:
    """The seed of one backward's stochastic rounding on Hopper: int64 [1] in [0, 2^30) drawn
    from ``device``'s torch generator, on the device (no host synchronization).

    That generator is the CUDA RNG state Megatron checkpoints and restores (``cuda_rng_state``,
    or the active ``get_cuda_rng_tracker()`` fork's state, also checkpointed), and it advances in
    the fixed order of the backward's linears: a run resumed from a checkpoint draws the seeds
    it would have drawn without the interruption. (The host generator used before also feeds
    the data loader and anything else on the host, so its sequence was not reproducible.)"""
    return torch.randint(0, 2**30, (1,), dtype=torch.int64, device=device)


def hopper_grad_operands(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    w_q: NVFP4Tensor,
    recipe: NVFP4Recipe,
    need_dx: bool,
    need_dw: bool,
) -> dict[str, torch.Tensor]:
    """The backward GEMM operands on Hopper, as exact BF16 ``code * block scale`` values.

    Keys: ``g_row`` [M, N] (dgrad: ``grad_out * w_dec`` in 1x16 blocks along N), ``w`` [N, K]
    (the fprop weight's own codes and tiles, times 2^-7, cached per weight version), ``g_col``
    [M16, N] and ``x_col`` [M16, K] (wgrad: 16-token blocks after the RHT, M16 = M rounded up to
    16), and ``g_dec`` / ``x_dec`` float32 [2] (``[0]`` the row operand's, ``[1]`` the col
    operand's decode scale). Per-tensor amax and stochastic rounding of gradients as the recipe
    says, exactly like :func:`nvfp4_dgrad` / :func:`nvfp4_wgrad` (their torch quantizer).
    """
    stochastic = recipe.grad_stochastic_rounding
    seed = stochastic_rounding_seed(grad_out.device) if stochastic else 0
    g_row, g_col, g_dec = minite_kernels.quantize_grad_operands(
        grad_out,
        row=need_dx,
        row_scale=w_q.decode_scale,
        row_stochastic=stochastic,
        col=need_dw,
        rht_signs=wgrad_rht_signs(recipe),
        col_stochastic=stochastic,
        seed=seed,
    )
    out = {"g_dec": g_dec}
    if need_dx:
        out["g_row"] = g_row
        out["w"] = minite_kernels.decoded_weight(w_q, CACHE_DECODED_WEIGHT)
    if need_dw:
        _, x_col, x_dec = minite_kernels.quantize_grad_operands(
            x, row=False, col=True, rht_signs=wgrad_rht_signs(recipe)
        )
        out.update(g_col=g_col, x_col=x_col, x_dec=x_dec)
    return out


def _hopper_backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    w_q: NVFP4Tensor,
    recipe: NVFP4Recipe,
    need_dx: bool,
    need_dw: bool,
    dx_dtype: torch.dtype,
    dw_dtype: torch.dtype,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(dX [M, K], dW [N, K])`` on Hopper: cuBLAS BF16 GEMMs of :func:`hopper_grad_operands`,
    float32 accumulators times the decode scales, one rounding to the output dtype."""
    ops = hopper_grad_operands(grad_out, x, w_q, recipe, need_dx, need_dw)
    dx = dw = None
    if need_dx:  # 128: the decoded weight's 2^-7
        acc = mm_f32(ops["g_row"], ops["w"])
        dx = minite_kernels.scale_rows(acc, ops["g_dec"][0] * 128.0, dx_dtype)
        del acc
    if need_dw:
        acc = mm_f32(ops["g_col"].t(), ops["x_col"])
        dw = minite_kernels.scale_rows(acc, ops["g_dec"][1] * ops["x_dec"][1], dw_dtype)
    return dx, dw


class _W4A4LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, w_q, recipe, row_amax, tp_group, where):  # type: ignore[override]
        ctx.save_for_backward(x, weight, bias)
        ctx.w_q, ctx.recipe = w_q, recipe
        return w4a4_linear(
            x, w_q, bias, recipe=recipe, row_amax=row_amax, tp_group=tp_group, where=where
        )

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
            return dx, dw, db, None, None, None, None, None
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (need_dx or need_dw) and HOPPER_CUBLAS_BACKWARD and kernel_arch(x.device) == "sm90":
            dx, dw = _hopper_backward(g2, x2, w_q, recipe, need_dx, need_dw, x.dtype, weight.dtype)
            dx = dx.reshape(x.shape) if dx is not None else None
        else:
            if need_dx:
                dx = nvfp4_dgrad(g2, w_q, recipe).to(x.dtype).reshape(x.shape)
            if need_dw:
                dw = nvfp4_wgrad(g2, x2, recipe).to(weight.dtype)
        if bias is not None and ctx.needs_input_grad[2]:
            db = g2.float().sum(0).to(bias.dtype)
        return dx, dw, db, None, None, None, None, None


def w4a4_linear_train(
    x: torch.Tensor,
    weight: torch.Tensor,
    w_q: NVFP4Tensor,
    bias: torch.Tensor | None = None,
    *,
    recipe: NVFP4Recipe = DEFAULT_RECIPE,
    row_amax: torch.Tensor | None = None,
    tp_group: torch.distributed.ProcessGroup | None = None,
    where: str = "w4a4_linear_train",
) -> torch.Tensor:
    """:func:`w4a4_linear` with NVFP4 backward into the high-precision master ``weight``.

    ``w_q`` must be ``quantize_weight(weight)`` (the caller caches it between optimizer steps);
    ``row_amax``, ``tp_group`` and ``where`` as in :func:`w4a4_linear` (forward only). With
    ``tp_group`` the output is the whole row-parallel result on every rank; its gradient is this
    rank's output gradient, as for an all-reduce (whose backward is the identity).
    """
    check_weight(w_q, recipe, "w4a4_linear_train")
    if tuple(weight.shape) != tuple(w_q.shape):
        raise ValueError(
            f"w4a4_linear_train: master weight {list(weight.shape)} and its quantized copy "
            f"{list(w_q.shape)} differ in shape"
        )
    return _W4A4LinearFunction.apply(x, weight, bias, w_q, recipe, row_amax, tp_group, where)
