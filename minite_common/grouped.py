"""The learner's grouped (MoE experts) W4A4 linear, the stacked expert weight quantizer and the
experts' SwiGLU.

- :func:`grouped_w4a4_linear_train`: forward is exactly :func:`grouped_w4a4_linear` (the
  function the sampler's MoE method calls); backward is, per expert, what
  :func:`w4a4_linear_train`'s backward gives for that expert's rows alone: dgrad with the
  expert's own 16x16 weight tiles (output gradient times the expert's per-channel decode scales,
  1x16 blocks, the expert's own per-tensor amax), wgrad with the RHT over each expert's own
  tokens zero-padded to 16, stochastic rounding as the recipe says. On the CPU (and Blackwell)
  it loops over the experts through :func:`nvfp4_dgrad` / :func:`nvfp4_wgrad`, so with nearest
  rounding it is bitwise the per-expert backward; on Hopper the operands of all experts come
  from two Triton launches per operand (``minite_kernels.nvfp4_grouped``) and the GEMMs are
  cuBLAS BF16 GEMMs with float32 output, one per expert and direction (``torch._grouped_mm``
  returns its input dtype only, which would round the accumulator to BF16 before the decode
  scales), the decode scales applied in one vectorized epilogue per output.
- :func:`quantize_stacked_weight`: every expert's HF tensors (``[gate_e; up_e]`` rows per expert
  as Megatron's ``linear_fc1`` holds them, or ``down_e``) each with its own amax, bitwise
  ``cat_rows`` of :func:`quantize_weight` of each tensor; one launch on Hopper/Blackwell.
- :func:`expert_swiglu`: ``bf16(silu(f32 gate) * f32 up)``, the sampler's MoE activation (and,
  for the learner, the router probabilities' product), one fused kernel each way on the GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from minite_kernels.dispatch import kernel_arch

from . import autograd as _autograd
from .autograd import nvfp4_dgrad, nvfp4_wgrad
from .linear import check_weight, grouped_w4a4_linear, host_group_sizes, quantize_weight
from .nvfp4 import BLOCK, NVFP4Tensor, cat_rows, check_quantizable
from .recipe import DEFAULT_RECIPE, NVFP4Recipe


def expert_counts(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Rows routed to each expert: int32 [num_experts] on ``expert_ids``' device, for
    :func:`grouped_w4a4_linear`'s ``group_sizes``. Unlike ``torch.bincount`` (which reads the
    largest id on the host on CUDA), it never synchronizes, so a decode step stays capturable in
    a CUDA graph; integer counts, so the result is deterministic."""
    ids = expert_ids.reshape(-1).long()
    counts = torch.zeros(num_experts, dtype=torch.int32, device=ids.device)
    return counts.scatter_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))


_FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def expert_swiglu(gate_up: torch.Tensor, probs: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU of ``gate_up`` [T, 2F] = ``[gate | up]``: ``act = dtype(silu(f32 gate) * f32 up)``,
    one rounding (the sampler's MoE activation); with the router probabilities ``probs`` [T]
    (the learner's experts), ``dtype(act * probs[:, None])`` as Megatron's expert MLP applies
    them. Differentiable (the backward keeps only the inputs and computes in float32).

    On a GPU the kernels serve, one fused pass each way (``minite_kernels.swiglu``): the same bits
    as the torch composition used elsewhere, except the probabilities' gradient (a row sum, in
    the kernel's fixed order: equal up to float32 rounding).
    """
    fusable = (
        gate_up.dim() == 2
        and gate_up.stride(1) == 1
        and gate_up.dtype in _FUSED_DTYPES
        and (probs is None or probs.dtype in _FUSED_DTYPES)
    )
    if fusable and kernel_arch(gate_up.device):
        return _FusedExpertSwiGLU.apply(gate_up, probs)
    act = _ExpertSwiGLU.apply(gate_up)
    return act if probs is None else (act * probs.unsqueeze(-1)).to(act.dtype)


class _FusedExpertSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up, probs):  # type: ignore[override]
        from minite_kernels import swiglu_forward

        probs = None if probs is None else probs.contiguous()
        ctx.save_for_backward(gate_up, probs)
        return swiglu_forward(gate_up, probs)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        from minite_kernels import swiglu_backward

        gate_up, probs = ctx.saved_tensors
        need_probs = probs is not None and ctx.needs_input_grad[1]
        return swiglu_backward(grad.contiguous(), gate_up, probs, need_probs)


def _swiglu_forward(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


class _ExpertSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up):  # type: ignore[override]
        ctx.save_for_backward(gate_up)
        return _swiglu_forward(gate_up)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (gate_up,) = ctx.saved_tensors
        gate, up = gate_up.float().chunk(2, dim=-1)
        sig = torch.sigmoid(gate)
        g = grad.float()
        d_gate = g * up * (sig * (1.0 + gate * (1.0 - sig)))
        d_up = g * (gate * sig)
        return torch.cat([d_gate, d_up], dim=-1).to(gate_up.dtype)


def quantize_stacked_weight(
    w: torch.Tensor,
    segment_rows: int,
    *,
    recipe: NVFP4Recipe = DEFAULT_RECIPE,
    names: list[str] | None = None,
) -> NVFP4Tensor:
    """Quantize ``w`` [S*R, K], S HF tensors of ``segment_rows`` = R rows stacked (every expert's
    gate, up or down), each with its own amax, as :func:`quantize_weight` quantizes each.

    Bitwise ``cat_rows([quantize_weight(w[s*R:(s+1)*R]) for s in range(S)])`` (per-row decode
    scales). With 16x16 tiles on a GPU served by the kernels it is one quantize launch after one
    amax reduction; elsewhere it loops over the tensors. ``names`` (one per tensor) name a tensor
    holding NaN/Inf in the error, which is raised before anything is quantized.
    """
    check_quantizable(w, "stacked expert weight")
    rows, k = w.shape
    if segment_rows <= 0 or rows % segment_rows:
        raise ValueError(
            f"quantize_stacked_weight: {rows} rows are not a whole number of {segment_rows}-row "
            "tensors"
        )
    count = rows // segment_rows
    finite = torch.isfinite(w.reshape(count, segment_rows * k)).all(dim=1)
    if not bool(finite.all()):
        labels = names or [f"tensor {s}" for s in range(count)]
        bad = [labels[s] for s in (~finite).nonzero().flatten().tolist()]
        raise ValueError(f"{bad}: weight holds NaN/Inf values; refusing to quantize it")
    if recipe.weight_block_2d and segment_rows % BLOCK == 0 and kernel_arch(w.device):
        from minite_kernels.nvfp4_grouped import quantize_stacked_weight as kernel

        amax = w.reshape(count, segment_rows * k).abs().amax(dim=1).float()
        codes, scales, decode = kernel(w, amax.repeat_interleave(segment_rows))
        return NVFP4Tensor(
            codes=codes,
            scales=scales,
            decode_scale=decode,
            shape=torch.Size((rows, k)),
            dtype=w.dtype,
            block_2d=True,
            recipe_fingerprint=recipe.fingerprint(),
        )
    parts = [
        quantize_weight(w[s * segment_rows : (s + 1) * segment_rows], recipe=recipe)
        for s in range(count)
    ]
    return cat_rows(parts)


def _split(sizes: list[int]) -> list[tuple[int, int, int]]:
    """``(group, first row, rows)`` of each non-empty group."""
    out, start = [], 0
    for g, size in enumerate(sizes):
        if size:
            out.append((g, start, size))
        start += size
    return out


def _looped_backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    w_q: NVFP4Tensor,
    sizes: list[int],
    recipe: NVFP4Recipe,
    need_dx: bool,
    need_dw: bool,
    dx_dtype: torch.dtype,
    dw_dtype: torch.dtype,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Per expert, exactly the one-linear backward (:func:`nvfp4_dgrad`, :func:`nvfp4_wgrad`)."""
    n, k = w_q.rows // len(sizes), x.shape[1]
    dx = torch.zeros(x.shape[0], k, dtype=dx_dtype, device=x.device) if need_dx else None
    dw = torch.zeros(w_q.rows, k, dtype=dw_dtype, device=x.device) if need_dw else None
    for g, start, size in _split(sizes):
        rows = slice(start, start + size)
        if need_dx:
            dx[rows] = nvfp4_dgrad(grad_out[rows], w_q.narrow_rows(g * n, n), recipe).to(dx_dtype)
        if need_dw:
            dw[g * n : (g + 1) * n] = nvfp4_wgrad(grad_out[rows], x[rows], recipe).to(dw_dtype)
    return dx, dw


def _mm_per_group(lhs, rhs, out) -> None:
    """``out[g] = lhs[g] @ rhs[g]`` (BF16 in, float32 accumulation and result) per group, zero
    where the product is over no elements. The per-group views come from one ``split``/``unbind``
    each (slicing them one by one made the loop host-bound); they die with this call."""
    for a, b, o in zip(lhs, rhs, out, strict=True):
        if a.shape[1]:
            _autograd.mm_f32(a, b, o)
        else:
            o.zero_()


def _hopper_backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    w_q: NVFP4Tensor,
    sizes: list[int],
    recipe: NVFP4Recipe,
    need_dx: bool,
    need_dw: bool,
    dx_dtype: torch.dtype,
    dw_dtype: torch.dtype,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Hopper: every expert's operands from ``minite_kernels.nvfp4_grouped`` (two launches per
    operand), per-expert cuBLAS GEMMs into float32 accumulators, one scale epilogue per output."""
    import minite_kernels
    from minite_kernels.nvfp4_grouped import quantize_grouped_grad_operands, sizes_on_device

    groups, dev = len(sizes), x.device
    tokens, n, k = x.shape[0], w_q.rows // groups, x.shape[1]
    stochastic = recipe.grad_stochastic_rounding
    seed = _autograd.stochastic_rounding_seed(grad_out.device) if stochastic else 0
    key = tuple(sizes)
    g_row, g_col, g_dec = quantize_grouped_grad_operands(
        grad_out,
        key,
        row=need_dx,
        row_scale=w_q.channel_decode_scale(),
        row_stochastic=stochastic,
        col=need_dw,
        rht_signs=_autograd.wgrad_rht_signs(recipe),
        col_stochastic=stochastic,
        seed=seed,
    )
    dx = dw = None
    if need_dx:
        w = minite_kernels.decoded_weight(w_q, _autograd.CACHE_DECODED_WEIGHT)  # code*scale*2^-7
        acc = torch.empty(tokens, k, dtype=torch.float32, device=dev)
        _mm_per_group(g_row.split(sizes), w.view(groups, n, k).unbind(0), acc.split(sizes))
        scale = (g_dec[:, 0] * 128.0).repeat_interleave(
            sizes_on_device(key, dev), output_size=tokens
        )
        dx = minite_kernels.scale_rows(acc, scale, dx_dtype, rows_per_scale=1)
        del acc, g_row
    if need_dw:
        _, x_col, x_dec = quantize_grouped_grad_operands(
            x, key, row=False, col=True, rht_signs=_autograd.wgrad_rht_signs(recipe)
        )
        acc = torch.empty(groups, n, k, dtype=torch.float32, device=dev)
        padded = [-(-size // 16) * 16 for size in sizes]  # each group's column-operand rows
        lhs = [part.t() for part in g_col.split(padded)]
        _mm_per_group(lhs, x_col.split(padded), acc.unbind(0))
        dw = minite_kernels.scale_rows(
            acc.view(groups * n, k), g_dec[:, 1] * x_dec[:, 1], dw_dtype, rows_per_scale=n
        )
    return dx, dw


class _GroupedW4A4Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, w_q, sizes, recipe):  # type: ignore[override]
        ctx.save_for_backward(x)
        ctx.w_q, ctx.sizes, ctx.recipe, ctx.w_dtype = w_q, sizes, recipe, weight.dtype
        return grouped_w4a4_linear(x, w_q, sizes, recipe=recipe)

    @staticmethod
    def backward(ctx, grad_y):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        args = (grad_y, x, ctx.w_q, ctx.sizes, ctx.recipe, need_dx, need_dw, x.dtype, ctx.w_dtype)
        if (
            x.shape[0]
            and (need_dx or need_dw)
            and _autograd.HOPPER_CUBLAS_BACKWARD
            and kernel_arch(x.device) == "sm90"
        ):
            dx, dw = _hopper_backward(*args)
        else:
            dx, dw = _looped_backward(*args)
        return dx, dw, None, None, None


def grouped_w4a4_linear_train(
    x: torch.Tensor,
    weight: torch.Tensor,
    w_q: NVFP4Tensor,
    group_sizes: torch.Tensor | list[int],
    *,
    recipe: NVFP4Recipe = DEFAULT_RECIPE,
) -> torch.Tensor:
    """:func:`grouped_w4a4_linear` of ``x`` [T, K] (rows grouped by expert, ``group_sizes[g]``
    rows for expert g) with the NVFP4 backward into the stacked master ``weight`` [G*N, K].

    ``w_q`` must be the stacked quantized weight (:func:`quantize_stacked_weight` of ``weight``'s
    BF16 values; the caller caches it between optimizer steps). See the module docstring.
    """
    check_weight(w_q, recipe, "grouped_w4a4_linear_train")
    if tuple(weight.shape) != tuple(w_q.shape):
        raise ValueError(
            f"grouped_w4a4_linear_train: master weight {list(weight.shape)} and its quantized "
            f"copy {list(w_q.shape)} differ in shape"
        )
    if x.dim() != 2:
        raise ValueError(f"grouped_w4a4_linear_train: x must be [T, K], got {list(x.shape)}")
    sizes = host_group_sizes(group_sizes, "grouped_w4a4_linear_train")
    return _GroupedW4A4Function.apply(x, weight, w_q, sizes, recipe)
