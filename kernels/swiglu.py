"""The MoE experts' SwiGLU (and router-probability product) in one pass each way.

``swiglu_forward(gate_up, probs)`` gives ``dtype(f32(dtype(silu(f32 gate) * f32 up)) * f32 prob)``
(without ``probs``: ``dtype(silu(f32 gate) * f32 up)``), bitwise what the torch composition
``(silu(gate.float()) * up.float()).to(dtype)`` then ``(act * probs[:, None]).to(dtype)`` gives on
CUDA: ``silu(g) = g / (1 + exp(-g))`` with the CUDA math library's ``expf`` (libdevice) and IEEE
division, every product and sum rounded on its own (no FMA contraction), as torch's separate
element-wise kernels round them. ``swiglu_backward`` is the autograd of that composition, with
``sigmoid(g) = 1 / (1 + exp(-g))``: the same bits for the input gradient; the probabilities'
gradient (the row sum of ``grad * act``) is summed in this kernel's fixed order (deterministic,
independent of the other rows), which equals torch's sum up to float32 rounding.

Triton's interpreter has no libdevice: there ``exp`` is numpy's (logic tests only).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ._fp import round_to_bf16

_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
if not _INTERPRETED:
    from triton.language.extra import libdevice

BLOCK_T = 4


@triton.jit
def _exp(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.exp(x)
    return tl.exp(x)


@triton.jit
def _round_to(v, OUT_BF16: tl.constexpr, out_dtype: tl.constexpr):
    """float32 -> the nearest value of the output dtype (ties to even), as float32."""
    if OUT_BF16:
        return round_to_bf16(v)
    return v.to(out_dtype).to(tl.float32)


@triton.jit
def _row_block(p_ptr, T, HAS_P: tl.constexpr, BLOCK_T: tl.constexpr):
    """This program's BLOCK_T rows: (in range, int64 indices, float32 probabilities or ones)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_rows = rows < T
    p = tl.full([BLOCK_T], 1.0, tl.float32)
    if HAS_P:
        p = tl.load(p_ptr + rows, mask=in_rows, other=0.0).to(tl.float32)
    return in_rows, rows.to(tl.int64), p


@triton.jit
def _gate_up_chunk(x_ptr, stride_x, rows64, in_rows, f0, F, BLOCK_F: tl.constexpr):
    """Columns [f0, f0 + BLOCK_F) of the gate and up halves of rows ``rows64`` as float32 (zeros
    outside), their column offsets and mask."""
    cols = f0 + tl.arange(0, BLOCK_F)
    mask = in_rows[:, None] & (cols < F)[None, :]
    x = x_ptr + rows64[:, None] * stride_x + cols[None, :]
    g = tl.load(x, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x + F, mask=mask, other=0.0).to(tl.float32)
    return g, u, cols, mask


@triton.jit
def _swiglu_forward_kernel(
    x_ptr, stride_x, p_ptr, y_ptr, stride_y, T, F,
    HAS_P: tl.constexpr, OUT_BF16: tl.constexpr, PRECISE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr,
):  # fmt: skip
    in_rows, rows64, p = _row_block(p_ptr, T, HAS_P, BLOCK_T)
    out_dtype: tl.constexpr = y_ptr.dtype.element_ty
    for f0 in range(0, F, BLOCK_F):
        g, u, cols, mask = _gate_up_chunk(x_ptr, stride_x, rows64, in_rows, f0, F, BLOCK_F)
        act = _round_to(tl.math.div_rn(g, 1.0 + _exp(-g, PRECISE)) * u, OUT_BF16, out_dtype)
        if HAS_P:
            act = _round_to(act * p[:, None], OUT_BF16, out_dtype)
        y = y_ptr + rows64[:, None] * stride_y + cols[None, :]
        tl.store(y, act.to(out_dtype), mask=mask)


@triton.jit
def _swiglu_backward_kernel(
    x_ptr, stride_x, p_ptr, dy_ptr, stride_dy, dx_ptr, stride_dx, dp_ptr, T, F,
    HAS_P: tl.constexpr, NEED_DP: tl.constexpr, OUT_BF16: tl.constexpr, PRECISE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr,
):  # fmt: skip
    in_rows, rows64, p = _row_block(p_ptr, T, HAS_P, BLOCK_T)
    out_dtype: tl.constexpr = dx_ptr.dtype.element_ty
    dp = tl.zeros((BLOCK_T, BLOCK_F), tl.float32)
    for f0 in range(0, F, BLOCK_F):
        g, u, cols, mask = _gate_up_chunk(x_ptr, stride_x, rows64, in_rows, f0, F, BLOCK_F)
        dy = tl.load(dy_ptr + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0)
        dy = dy.to(tl.float32)
        e = _exp(-g, PRECISE)
        if HAS_P:
            if NEED_DP:
                act = _round_to(tl.math.div_rn(g, 1.0 + e) * u, OUT_BF16, out_dtype)
                dp += dy * act
            dy = _round_to(dy * p[:, None], OUT_BF16, out_dtype)
        sig = tl.math.div_rn(1.0, 1.0 + e)
        d_gate = dy * u * (sig * (1.0 + g * (1.0 - sig)))
        d_up = dy * (g * sig)
        dx = dx_ptr + rows64[:, None] * stride_dx + cols[None, :]
        tl.store(dx, _round_to(d_gate, OUT_BF16, out_dtype).to(out_dtype), mask=mask)
        tl.store(dx + F, _round_to(d_up, OUT_BF16, out_dtype).to(out_dtype), mask=mask)
    if NEED_DP:
        tl.store(dp_ptr + rows64, tl.sum(dp, axis=1), mask=in_rows)


def _check(gate_up: torch.Tensor, probs: torch.Tensor | None, where: str) -> tuple[int, int]:
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"{where}: need gate_up [T, 2F] with unit column stride, got "
                         f"{list(gate_up.shape)} strides {gate_up.stride()}")  # fmt: skip
    t, f = gate_up.shape[0], gate_up.shape[1] // 2
    if probs is not None and (probs.shape != (t,) or not probs.is_contiguous()):
        raise ValueError(f"{where}: probs must be contiguous [{t}], got {list(probs.shape)}")
    return t, f


def _block_f(f: int) -> int:
    return min(512, triton.next_power_of_2(max(f, 16)))


def swiglu_forward(gate_up: torch.Tensor, probs: torch.Tensor | None = None) -> torch.Tensor:
    """[T, F] of ``gate_up`` [T, 2F] = ``[gate | up]`` (and ``probs`` [T]), see the module
    docstring; in ``gate_up``'s dtype."""
    t, f = _check(gate_up, probs, "swiglu_forward")
    y = torch.empty(t, f, dtype=gate_up.dtype, device=gate_up.device)
    if t and f:
        _swiglu_forward_kernel[(triton.cdiv(t, BLOCK_T),)](
            gate_up, gate_up.stride(0), probs if probs is not None else y, y, y.stride(0), t, f,
            HAS_P=probs is not None, OUT_BF16=y.dtype == torch.bfloat16,
            PRECISE=not _INTERPRETED, BLOCK_T=BLOCK_T, BLOCK_F=_block_f(f), num_warps=4,
            enable_fp_fusion=False,
        )  # fmt: skip
    return y


def swiglu_backward(
    grad: torch.Tensor,
    gate_up: torch.Tensor,
    probs: torch.Tensor | None = None,
    need_probs_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(d gate_up [T, 2F] in gate_up's dtype, d probs [T] in probs' dtype or None)`` for the
    output gradient ``grad`` [T, F] of :func:`swiglu_forward`."""
    t, f = _check(gate_up, probs, "swiglu_backward")
    if grad.shape != (t, f) or grad.stride(1) != 1:
        raise ValueError(f"swiglu_backward: grad must be [{t}, {f}] with unit column stride")
    dx = torch.empty_like(gate_up, memory_format=torch.contiguous_format)
    need_dp = need_probs_grad and probs is not None
    dp = torch.empty(t, dtype=torch.float32, device=gate_up.device) if need_dp else None
    if t and f:
        _swiglu_backward_kernel[(triton.cdiv(t, BLOCK_T),)](
            gate_up, gate_up.stride(0), probs if probs is not None else dx, grad, grad.stride(0),
            dx, dx.stride(0), dp if need_dp else dx, t, f,
            HAS_P=probs is not None, NEED_DP=need_dp, OUT_BF16=dx.dtype == torch.bfloat16,
            PRECISE=not _INTERPRETED, BLOCK_T=BLOCK_T, BLOCK_F=_block_f(f), num_warps=4,
            enable_fp_fusion=False,
        )  # fmt: skip
    elif need_dp:
        dp.zero_()
    return dx, (dp.to(probs.dtype) if need_dp else None)
