"""Strict-mode reference ops: one batch-invariant definition of every op around the NVFP4 linears.

With ``NVFP4Recipe(strict_ops=True)`` both engines run these instead of their own kernels for the
ops between the linears (RMSNorm, residual adds, rotary embedding, attention core, SwiGLU, MoE
routing and combine) and for the BF16 GEMMs (LM head, MoE router), so the sampler's and the
learner's token log-probs are bitwise equal (see ``docs/strict.md``).

The contract of every op: each output element is a function of its own inputs alone (its row,
its head, its token's keys), never of the batch size, the row's position in memory, the thread
count, or the other rows. Two rules make that hold by construction:

- **Only correctly rounded arithmetic.** Every value comes from IEEE-754 add, sub, mul, div and
  sqrt (:func:`sqrt`: torch's goes through MKL on x86 and is not correctly rounded there),
  comparisons, and exact or round-to-nearest-even conversions, applied elementwise (torch
  applies these identically in its vectorized loop bodies and its scalar tails). Transcendental
  functions (exp, log, sin, cos) are evaluated here in float64 from those operations (Cody-Waite
  range reduction and a polynomial) and rounded once to float32: torch's own kernels use
  different code for the vectorized body and the scalar tail of a loop (``F.silu`` differs in
  about 4% of float32 elements), so their bits depend on where an element sits in memory.
- **Reductions in one fixed order**: :func:`fixed_sum`, a pairwise halving tree over the reduced
  dimension zero-padded to a power of two. Zeros appended to a reduction never change a bit, so a
  decode step that attends to t keys and a prefill row that sees the same t keys followed by
  masked ones give the same bits.

On CUDA tensors the same functions run Triton kernels (``minite_kernels.strict_ops``) that
evaluate these formulas operation for operation (same trees, same float64 polynomials, launched
without FMA contraction), so a GPU gives the CPU's bits; ``MINITE_BACKEND=torch`` keeps the torch
code below on the GPU too (also exact, slower). See ``docs/strict.md``, section GPU.

No multiply-add is ever fused (separate torch ops in eager mode); compiling these functions with
``torch.compile`` could fuse them and is not supported. Nothing here calls a BLAS / oneDNN GEMM,
a torch reduction (``sum``, ``softmax``, ``norm``) or a torch transcendental (``exp``, ``log``),
whose bits depend on the CPU's instruction set (AVX2 / AVX-512 / AMX kernels, vector width) and
the library's kernel choice: so the results are the same on every CPU, not only batch-invariant.
The forward is the contract; the gradients (for the learner) are not bitwise specified across
versions, but they follow the same two rules (fixed-order reductions, elementwise IEEE
arithmetic), so a strict learner step also gives the same bits on every CPU.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from minite_kernels.dispatch import BACKEND_ENV

#: Largest product tensor (elements) one chunk of :func:`linear` / :func:`causal_attention` builds.
CHUNK_ELEMENTS = 1 << 22

# exp: x = k*ln2 + r, |r| <= ln2/2 (fdlibm's split of ln2: k*_LN2_HI is exact for |k| < 2^21).
_INV_LN2 = 1.44269504088896338700e00
_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10
_EXP_COEFFS = tuple(1.0 / math.factorial(n) for n in range(14))  # truncation < 5e-18
# log: atanh series in s = (m-1)/(m+1), |s| <= 0.1716
_LOG_COEFFS = tuple(1.0 / (2 * n + 1) for n in range(12))  # truncation < 1e-18
_SQRT2 = 1.41421356237309514547e00
# sin/cos: x = k*pi/2 + r (fdlibm's 33-bit pieces of pi/2: k*_PIO2_i is exact for |k| < 2^20)
_TWO_OVER_PI = 6.36619772367581382433e-01
_PIO2_1 = 1.57079632673412561417e00
_PIO2_2 = 6.07710050630396597660e-11
_PIO2_3 = 2.02226624871116645580e-21
_PIO2_3T = 8.47842766036889956997e-32
_SIN_COEFFS = tuple((-1.0) ** n / math.factorial(2 * n + 1) for n in range(11))
_COS_COEFFS = tuple((-1.0) ** n / math.factorial(2 * n) for n in range(12))


def _triton(x: torch.Tensor) -> bool:
    """Whether ``x``'s op runs the Triton kernels: CUDA tensors, unless ``MINITE_BACKEND=torch``."""
    return x.is_cuda and os.environ.get(BACKEND_ENV, "").strip().lower() != "torch"


def _kernels():
    from minite_kernels import strict_kernels

    return strict_kernels()


class _Recompute(torch.autograd.Function):
    """Forward by a Triton kernel, backward by autograd of the torch reference (recomputed), for
    the ops whose reference is plain differentiable torch code: the same gradients as on CPU."""

    @staticmethod
    def forward(ctx, fast, ref, *inputs):  # type: ignore[override]
        ctx.ref = ref
        ctx.save_for_backward(*inputs)
        return fast(*inputs)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        needs = ctx.needs_input_grad[2:]
        saved = ctx.saved_tensors
        inputs = [t.detach().requires_grad_(n) for t, n in zip(saved, needs, strict=True)]
        with torch.enable_grad():
            out = ctx.ref(*inputs)
        wanted = [t for t, n in zip(inputs, needs, strict=True) if n]
        grads = iter(torch.autograd.grad(out, wanted, grad) if wanted else ())
        return (None, None, *(next(grads) if n else None for n in needs))


def _dispatch(fast: Callable, ref: Callable, *inputs: torch.Tensor) -> torch.Tensor:
    if any(t.requires_grad for t in inputs) and torch.is_grad_enabled():
        return _Recompute.apply(fast, ref, *inputs)
    return fast(*inputs)


# -- reductions and elementary functions ---------------------------------------------------------


def fixed_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum over ``dim`` in a fixed order: zero-pad to a power of two, then add the upper half onto
    the lower half until one element is left. Trailing zeros never change the result."""
    x = x.movedim(dim, -1)
    n = x.shape[-1]
    size = 1 << max(n - 1, 0).bit_length()
    if size != n:
        x = F.pad(x, (0, size - n))
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


def _horner(z: torch.Tensor, coeffs: tuple[float, ...]) -> torch.Tensor:
    """``sum(coeffs[n] * z**n)`` by Horner's rule with separate multiply and add."""
    p = torch.full_like(z, coeffs[-1])
    for c in reversed(coeffs[:-1]):
        p = p * z + c
    return p


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """``2.0**k`` in float64 for int64 ``k`` in [-1022, 1023], built from the exponent bits."""
    return ((k + 1023) << 52).view(torch.float64)


def exp64(x: torch.Tensor) -> torch.Tensor:
    """``exp(x)`` for float64 ``x``, relative error below 1e-16; 0 below -745, finite (not inf)
    above 709: callers round to float32, where both ends saturate."""
    x = x.clamp(-745.0, 709.0)
    k = torch.round(x * _INV_LN2)
    r = (x - k * _LN2_HI) - k * _LN2_LO
    p = _horner(r, _EXP_COEFFS)
    ki = k.to(torch.int64)
    half = torch.div(ki, 2, rounding_mode="floor")
    return (p * _pow2(half)) * _pow2(ki - half)


def log64(x: torch.Tensor) -> torch.Tensor:
    """``log(x)`` for positive normal float64 ``x`` (absolute error below 2e-16 * (1 + |log x|))."""
    bits = x.view(torch.int64)
    e = (bits >> 52) - 1023
    m = ((bits & ((1 << 52) - 1)) | (1023 << 52)).view(torch.float64)  # [1, 2)
    big = m > _SQRT2
    m = torch.where(big, m * 0.5, m)
    e = (e + big.to(torch.int64)).to(torch.float64)
    f = m - 1.0
    s = f / (f + 2.0)
    log_m = (s * 2.0) * _horner(s * s, _LOG_COEFFS)
    return e * _LN2_HI + (e * _LN2_LO + log_m)


def sincos64(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sin(x), cos(x))`` for float64 ``x`` with |x| < 1.6e6, absolute error below 1e-15."""
    k = torch.round(x * _TWO_OVER_PI)
    r = ((x - k * _PIO2_1) - k * _PIO2_2) - k * _PIO2_3
    r = r - k * _PIO2_3T
    z = r * r
    s = r * _horner(z, _SIN_COEFFS)
    c = _horner(z, _COS_COEFFS)
    q = torch.remainder(k.to(torch.int64), 4)
    sin = torch.where(q == 0, s, torch.where(q == 1, c, torch.where(q == 2, -s, -c)))
    cos = torch.where(q == 0, c, torch.where(q == 1, -s, torch.where(q == 2, -c, s)))
    return sin, cos


def sqrt(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float32 ``sqrt(x)`` for float32 ``x >= 0`` (no gradient).

    ``torch.sqrt`` goes through MKL's vector math on x86 CPUs, whose float32 results depend on
    the instruction set (AVX2 and AVX-512 differ in the last bit). Here: a float64 square root
    rounded to float32 (within one float32 ulp), then corrected against the two neighbouring
    midpoints, whose squares are exact in float64 (a 25-bit number squared); a square root is
    never exactly a midpoint, so the result is the correctly rounded one on every CPU."""
    x = x.float()
    y = torch.sqrt(x.double()).to(torch.float32)
    xd = x.double()
    up = torch.nextafter(y, torch.full_like(y, math.inf))
    down = torch.nextafter(y, torch.zeros_like(y))
    mid_up = (y.double() + up.double()) * 0.5
    mid_down = (y.double() + down.double()) * 0.5
    y = torch.where(mid_up * mid_up < xd, up, y)
    y = torch.where((mid_down * mid_down > xd) & (y > 0), down, y)
    return torch.where(torch.isfinite(x) & (x >= 0), y, torch.sqrt(x))


class _Exp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        y = exp64(x.detach().double()).to(torch.float32)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (y,) = ctx.saved_tensors
        return grad * y


def exp(x: torch.Tensor) -> torch.Tensor:
    """``float32(exp(x))`` for a float tensor ``x``: float64 evaluation rounded once."""
    return _Exp.apply(x)


# -- norms, residuals, activations ---------------------------------------------------------------


def _residual_add_ref(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    return (x.float() + residual.float()).to(x.dtype)


def residual_add(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``x + residual`` in float32, rounded once to ``x``'s dtype."""
    if _triton(x) and x.shape == residual.shape:
        return _dispatch(_kernels().residual_add, _residual_add_ref, x, residual)
    return _residual_add_ref(x, residual)


def _rms_inv(xf: torch.Tensor, eps: float) -> torch.Tensor:
    var = fixed_sum(xf * xf) / xf.shape[-1]
    return 1.0 / sqrt(var + torch.tensor(eps, dtype=torch.float32, device=xf.device))


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        if _triton(x):
            return _kernels().rms_norm(x.detach(), weight.detach(), eps)
        xf = x.detach().float()
        return ((xf * _rms_inv(xf, eps).unsqueeze(-1)) * weight.detach().float()).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        xf, g = x.float(), grad.float()
        inv = _rms_inv(xf, ctx.eps).unsqueeze(-1)
        n = xf * inv
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            gn = g * weight.float()
            mean = (fixed_sum(gn * n) / x.shape[-1]).unsqueeze(-1)
            grad_x = (inv * (gn - n * mean)).to(x.dtype)
        if ctx.needs_input_grad[1]:  # rows in order, one fixed tree
            grad_w = fixed_sum((g * n).reshape(-1, x.shape[-1]), dim=0).to(weight.dtype)
        return grad_x, grad_w, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, in ``x``'s dtype:
    ``y = dtype(f32(x * r) * w)`` with ``r = 1 / sqrt(fixed_sum(x*x) / D + eps)`` in float32.
    Backward: fixed-order formulas (the weight's gradient sums the rows with :func:`fixed_sum`)."""
    return _RMSNorm.apply(x, weight, float(eps))


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(r), r)`` with ``r = residual_add(x, residual)``: a pre-norm block's entry."""
    r = residual_add(x, residual)
    return rms_norm(r, weight, eps), r


def _silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    g = gate.float()
    return ((g / (exp(-g) + 1.0)) * up.float()).to(gate.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up``: ``dtype(f32(g / f32(1 + exp(-g))) * u)`` in float32."""
    if _triton(gate):
        return _dispatch(_kernels().silu_mul, _silu_mul_ref, gate, up)
    return _silu_mul_ref(gate, up)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """:func:`silu_mul` of the two halves ``[gate | up]`` of ``x``'s last dimension."""
    gate, up = x.chunk(2, dim=-1)
    return silu_mul(gate, up)


# -- rotary embedding ----------------------------------------------------------------------------


def rope_cos_sin(
    positions: torch.Tensor, rotary_dim: int, base: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` float32 ``[*positions.shape, rotary_dim/2]`` of the angles
    ``position * base**(-2i/rotary_dim)``, all in float64, each rounded once to float32."""
    if rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even, got {rotary_dim}")
    device = positions.device
    i = torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=device)
    log_base = log64(torch.tensor(float(base), dtype=torch.float64, device=device))
    inv_freq = exp64(-(i / rotary_dim) * log_base)
    sin, cos = sincos64(positions.to(torch.float64).unsqueeze(-1) * inv_freq)
    return cos.to(torch.float32), sin.to(torch.float32)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``2*cos.shape[-1]`` features of ``x`` (half-split / NeoX layout), in
    ``x``'s dtype: ``[x1*c - x2*s, x2*c + x1*s]`` in float32, rounded once; the rest passes.
    ``cos``/``sin`` broadcast against ``x[..., :half]``."""
    if _triton(x):
        return _dispatch(_kernels().apply_rope, _apply_rope_ref, x, cos, sin)
    return _apply_rope_ref(x, cos, sin)


def _apply_rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = cos.shape[-1]
    xf = x[..., : 2 * half].float()
    x1, x2 = xf[..., :half], xf[..., half:]
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    if 2 * half < x.shape[-1]:
        out = torch.cat([out, x[..., 2 * half :]], dim=-1)
    return out


# -- attention -----------------------------------------------------------------------------------


def _attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor, scale: float
) -> torch.Tensor:
    tq, heads, dim = q.shape
    tk, kv_heads, _ = k.shape
    dim_v = v.shape[-1]
    group = heads // kv_heads
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, Tk, D]
    vf = v.float().repeat_interleave(group, dim=1).permute(1, 2, 0)  # [H, Dv, Tk]
    scale_t = torch.tensor(scale, dtype=torch.float32, device=q.device)
    key_pos = torch.arange(tk, device=q.device)
    chunk = max(1, CHUNK_ELEMENTS // max(1, heads * tk * max(dim, dim_v)))
    out = []
    for start in range(0, tq, chunk):
        qc = q[start : start + chunk].float().transpose(0, 1)  # [H, c, D]
        s = fixed_sum(qc.unsqueeze(2) * kf.unsqueeze(1)) * scale_t  # [H, c, Tk]
        valid = key_pos <= q_positions[start : start + chunk].unsqueeze(-1)  # [c, Tk]
        m = torch.where(valid, s, -torch.inf).amax(dim=-1, keepdim=True)
        e = torch.where(valid, exp(torch.where(valid, s - m, -torch.inf)), 0.0)
        den = fixed_sum(e)  # [H, c]
        num = fixed_sum(e.unsqueeze(2) * vf.unsqueeze(1))  # [H, c, Dv]
        out.append((num / den.unsqueeze(-1)).transpose(0, 1).to(q.dtype))
    return torch.cat(out) if out else q.new_empty(0, heads, dim_v)


def _per_query_head(t: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """[Tk, Hk, D] keys or values -> [H, Tk, D] in ``dtype``, each KV head repeated for the
    ``group`` query heads that read it."""
    return t.to(dtype).repeat_interleave(group, dim=1).transpose(0, 1)


def _attention_grads(
    dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
    v: torch.Tensor, fold: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``dq`` [H, Tq, D] and per-query-head ``dk`` / ``dv`` [H, Tk, .] in the inputs' layouts and
    dtypes, the query heads of a KV group added by ``fold`` over dimension 1 of [Hk, group, ...]."""
    kv_heads = k.shape[1]
    dk = fold(dk.view(kv_heads, -1, *dk.shape[1:]))
    dv = fold(dv.view(kv_heads, -1, *dv.shape[1:]))
    return (dq.transpose(0, 1).to(q.dtype), dk.transpose(0, 1).to(k.dtype),
            dv.transpose(0, 1).to(v.dtype))  # fmt: skip


def _backward_operands(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """What both attention backwards start from, in ``dtype``: keys and values per query head
    ([H, Tk, D], [H, Tk, Dv]), the key positions, and zero ``dk`` / ``dv`` accumulators."""
    heads, dim = q.shape[1:]
    tk, kv_heads, _ = k.shape
    group = heads // kv_heads
    kf = _per_query_head(k, group, dtype)
    vf = _per_query_head(v, group, dtype)
    dk = torch.zeros(heads, tk, dim, dtype=dtype, device=q.device)
    dv = torch.zeros(heads, tk, v.shape[-1], dtype=dtype, device=q.device)
    return kf, vf, torch.arange(tk, device=q.device), dk, dv


def _attention_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    scale: float,
    grad: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`causal_attention` with fixed-order sums only (float32):
    ``p = softmax(s)`` as in the forward, ``dv_j = sum_i p_ij do_i``, ``dp_ij = do_i . v_j``,
    ``ds = p * (dp - sum_j p_ij dp_ij)``, ``dq_i = scale * sum_j ds_ij k_j``,
    ``dk_j = scale * sum_i ds_ij q_i``; query chunks added in order, query heads of a KV group
    added in order."""
    tq, heads, dim = q.shape
    tk, dim_v = k.shape[0], v.shape[-1]
    kf, vf, key_pos, dk, dv = _backward_operands(q, k, v, torch.float32)
    scale_t = torch.tensor(scale, dtype=torch.float32, device=q.device)
    chunk = max(1, CHUNK_ELEMENTS // max(1, heads * tk * max(dim, dim_v)))
    dq = []
    for start in range(0, tq, chunk):
        qc = q[start : start + chunk].float().transpose(0, 1)  # [H, c, D]
        go = grad[start : start + chunk].float().transpose(0, 1)  # [H, c, Dv]
        s = fixed_sum(qc.unsqueeze(2) * kf.unsqueeze(1)) * scale_t  # [H, c, Tk]
        valid = key_pos <= q_positions[start : start + chunk].unsqueeze(-1)
        m = torch.where(valid, s, -torch.inf).amax(dim=-1, keepdim=True)
        e = torch.where(valid, exp(torch.where(valid, s - m, -torch.inf)), 0.0)
        p = e / fixed_sum(e).unsqueeze(-1)  # [H, c, Tk]
        dv = dv + fixed_sum(p.unsqueeze(-1) * go.unsqueeze(2), dim=1)  # [H, Tk, Dv]
        dp = fixed_sum(go.unsqueeze(2) * vf.unsqueeze(1))  # [H, c, Tk]
        ds = p * (dp - fixed_sum(p * dp).unsqueeze(-1))
        dq.append(fixed_sum(ds.unsqueeze(-1) * kf.unsqueeze(1), dim=2) * scale_t)  # [H, c, D]
        dk = dk + fixed_sum(ds.unsqueeze(-1) * qc.unsqueeze(2), dim=1) * scale_t  # [H, Tk, D]
    dq_t = torch.cat(dq, dim=1) if dq else q.new_zeros(heads, 0, dim, dtype=torch.float32)
    return _attention_grads(dq_t, dk, dv, q, k, v, functools.partial(fixed_sum, dim=1))


def _attention_backward_gemm(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    scale: float,
    grad: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of :func:`_attention_backward` through batched float64 GEMMs (the GPU's
    backward: a few cuBLAS calls per chunk of queries instead of the fixed-order sums' many
    elementwise passes). Deterministic on one GPU (no atomics), not the CPU's bits."""
    tq, heads, dim = q.shape
    kf, vf, key_pos, dk, dv = _backward_operands(q, k, v, torch.float64)
    chunk = max(1, CHUNK_ELEMENTS * 4 // max(1, heads * k.shape[0]))  # [H, c, Tk] float64 scores
    dq = []
    for start in range(0, tq, chunk):
        qc = q[start : start + chunk].double().transpose(0, 1)  # [H, c, D]
        go = grad[start : start + chunk].double().transpose(0, 1)  # [H, c, Dv]
        valid = key_pos <= q_positions[start : start + chunk].unsqueeze(-1)  # [c, Tk]
        p = torch.softmax((qc @ kf.transpose(1, 2) * scale).masked_fill(~valid, -torch.inf), -1)
        dv += p.transpose(1, 2) @ go
        dp = go @ vf.transpose(1, 2)  # [H, c, Tk]
        ds = p * (dp - (p * dp).sum(-1, keepdim=True))
        dq.append(ds @ kf * scale)
        dk += ds.transpose(1, 2) @ qc * scale
    dq_t = torch.cat(dq, dim=1) if dq else q.new_zeros(heads, 0, dim, dtype=torch.float64)
    return _attention_grads(dq_t, dk, dv, q, k, v, lambda t: t.sum(1))


def _attention_plain(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """The same attention with torch's own matmul and softmax (a reference for the tests)."""
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    s = (q.float().transpose(0, 1) @ kf.transpose(1, 2)) * scale
    valid = torch.arange(k.shape[0], device=q.device) <= q_positions.unsqueeze(-1)
    p = torch.softmax(s.masked_fill(~valid, -torch.inf), dim=-1)
    return (p @ vf).transpose(0, 1).to(q.dtype)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, q_positions, scale):  # type: ignore[override]
        ctx.save_for_backward(q, k, v, q_positions)
        ctx.scale = scale
        if _triton(q):
            return _kernels().causal_attention(q.detach(), k.detach(), v.detach(), q_positions,
                                               scale)  # fmt: skip
        return _attention_forward(q.detach(), k.detach(), v.detach(), q_positions, scale)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        q, k, v, q_positions = ctx.saved_tensors
        backward = _attention_backward_gemm if _triton(q) else _attention_backward
        dq, dk, dv = backward(q, k, v, q_positions, ctx.scale, grad)
        needs = ctx.needs_input_grad
        return (dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None,
                None, None)  # fmt: skip


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal (grouped-query) attention of one sequence, in ``q``'s dtype.

    ``q`` [Tq, H, D] holds queries at positions ``q_positions`` [Tq] (int); ``k`` [Tk, Hk, D] and
    ``v`` [Tk, Hk, Dv] hold the keys and values of positions 0..Tk-1 (query head h reads kv head
    ``h // (H/Hk)``). The query at position p attends keys 0..p, in float32:
    ``s_j = fixed_sum_d(q_d * k_jd) * scale``, ``e_j = exp(s_j - max_j s_j)``,
    ``out = dtype(fixed_sum_j(e_j * v_j) / fixed_sum_j(e_j))``. Keys past p contribute exact
    zeros, so the result does not depend on Tk: a decode step that reads t keys from the KV cache
    gives the bits of the prefill row at that position.
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"causal_attention: expected q [Tq, H, D], k/v [Tk, Hk, D] with H a multiple of Hk; "
            f"got {list(q.shape)}, {list(k.shape)}, {list(v.shape)}"
        )
    if q_positions.numel() and int(q_positions.max()) >= k.shape[0]:
        raise ValueError(
            f"causal_attention: a query at position {int(q_positions.max())} needs "
            f"{int(q_positions.max()) + 1} keys, got {k.shape[0]}"
        )
    return _Attention.apply(q, k, v, q_positions, float(scale))


def paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: Sequence[int] | torch.Tensor,
    seq_lens: Sequence[int] | torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """A sampler's step of :func:`causal_attention` (chunked prefill and decode, forward only)
    over a paged KV cache, for a batch of sequences.

    Sequence ``i`` has ``seq_lens[i]`` tokens, the last ``n_i`` of which are its queries, rows
    ``query_start_loc[i]:query_start_loc[i+1]`` of ``q`` [T, H, D] (a decode step: ``n_i = 1``).
    Its key and value of position ``p`` are ``key_cache[b, p % block_size]`` and
    ``value_cache[b, p % block_size]`` with ``b = block_table[i, p // block_size]``; the caches
    are [blocks, block_size, Hk, D] and [blocks, block_size, Hk, Dv] (strided views allowed, e.g.
    of a [blocks, Hk, block_size, D] layout). Row ``r`` of the output [T, H, Dv] is bitwise the
    row of :func:`causal_attention` over that sequence's keys ``0..seq_lens[i]-1``, so the decode
    of the token at position t gives row t of the full-sequence attention.
    """
    if isinstance(query_start_loc, torch.Tensor):
        query_start_loc = query_start_loc.tolist()
    if isinstance(seq_lens, torch.Tensor):
        seq_lens = seq_lens.tolist()
    starts, lens = [int(s) for s in query_start_loc], [int(n) for n in seq_lens]
    block_size = key_cache.shape[1]
    problems = []
    if q.dim() != 3 or key_cache.dim() != 4 or value_cache.dim() != 4:
        problems.append("q must be [T, H, D] and the caches [blocks, block_size, Hk, D]")
    elif q.shape[1] % key_cache.shape[2] or key_cache.shape[:3] != value_cache.shape[:3]:
        problems.append("q's heads must be a multiple of the caches' (equal) KV heads")
    if len(starts) != len(lens) + 1 or (starts and (starts[0] != 0 or starts[-1] != q.shape[0])):
        problems.append("query_start_loc must run from 0 to T with one more entry than seq_lens")
    for i, n in enumerate(lens):
        count = starts[i + 1] - starts[i] if i + 1 < len(starts) else 0
        if not 0 <= count <= n or -(-n // block_size) > block_table.shape[-1]:
            problems.append(f"sequence {i}: {count} queries, {n} tokens, block table too short")
    if problems:
        raise ValueError("paged_attention: " + "; ".join(problems[:3]))
    if _triton(q):
        counts = [starts[i + 1] - starts[i] for i in range(len(lens))]
        seq_ids = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(counts))
        positions = [torch.arange(n - c, n) for n, c in zip(lens, counts, strict=True)]
        positions = torch.cat(positions) if positions else torch.zeros(0, dtype=torch.int64)
        return _kernels().paged_attention(
            q, key_cache, value_cache, block_table, seq_ids, positions, lens, float(scale)
        )
    out = q.new_empty(q.shape[0], q.shape[1], value_cache.shape[-1])
    for i, length in enumerate(lens):
        start, end = starts[i], starts[i + 1]
        if end == start:
            continue
        pos = torch.arange(length, device=q.device)
        block = block_table[i, pos // block_size].long()
        offset = pos % block_size
        out[start:end] = causal_attention(
            q[start:end], key_cache[block, offset], value_cache[block, offset],
            pos[length - (end - start) :], scale,
        )  # fmt: skip
    return out


# -- BF16 GEMMs (LM head, MoE router) ------------------------------------------------------------


def _linear_forward(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if _triton(x):
        return _kernels().linear(x, w)
    x2 = x.reshape(-1, x.shape[-1])
    rows_out, k = w.shape
    wf = w.float()
    cols = max(1, min(rows_out, CHUNK_ELEMENTS // max(k, 1)))
    rows = max(1, CHUNK_ELEMENTS // max(cols * k, 1))
    y = torch.empty(x2.shape[0], rows_out, dtype=torch.float32, device=x.device)
    for r in range(0, x2.shape[0], rows):
        xr = x2[r : r + rows].float().unsqueeze(1)
        for c in range(0, rows_out, cols):
            y[r : r + rows, c : c + cols] = fixed_sum(xr * wf[c : c + cols].unsqueeze(0))
    return y.reshape(*x.shape[:-1], rows_out)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):  # type: ignore[override]
        ctx.save_for_backward(x, w)
        return _linear_forward(x.detach(), w.detach())

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, w = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1]).float()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:  # g @ w, a fixed_sum over the outputs
            grad_x = _linear_forward(g, w.float().t()).reshape(*x.shape).to(x.dtype)
        if ctx.needs_input_grad[1]:  # g.T @ x, a fixed_sum over the tokens
            grad_w = _linear_forward(g.t(), x.reshape(-1, x.shape[-1]).float().t()).to(w.dtype)
        return grad_x, grad_w


def linear(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``x @ w.T (+ bias)`` for high-precision (BF16) layers, batch-invariant:
    ``y[m, n] = out_dtype(fixed_sum_k(f32(x[m,k] * w[n,k])) (+ f32(bias[n])))``; products of
    BF16 values are exact in float32. ``out_dtype`` defaults to ``x``'s dtype. No BLAS: the
    result does not depend on the CPU's GEMM kernels (the backward is fixed-order too)."""
    if x.shape[-1] != w.shape[-1]:
        raise ValueError(f"linear: x {list(x.shape)} does not match weight {list(w.shape)}")
    y = _Linear.apply(x, w)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype)


# -- MoE routing and combine, log-probs ----------------------------------------------------------


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if _triton(x):
            p = _kernels().softmax(x.detach())
        else:
            xf = x.detach().float()
            e = exp(xf - xf.amax(dim=-1, keepdim=True))
            p = e / fixed_sum(e).unsqueeze(-1)
        ctx.save_for_backward(p)
        return p

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (p,) = ctx.saved_tensors
        g = grad.float()
        return p * (g - fixed_sum(p * g).unsqueeze(-1))


def softmax(x: torch.Tensor) -> torch.Tensor:
    """float32 softmax over the last dimension: ``e / fixed_sum(e)``, ``e = exp(x - max x)``
    (:func:`exp`); the backward ``p * (g - fixed_sum(p * g))`` is fixed-order too."""
    return _Softmax.apply(x)


def topk_routing(
    logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing of ``logits`` [T, E]: ``(weights float32 [T, k], ids int64 [T, k])``.

    Experts are ranked by logit, ties to the lower index. With ``renormalize`` the weights are
    the softmax over the k selected logits, else the softmax over all E, taken at the selected
    experts (both in float32 with :func:`softmax`).
    """
    lf = logits.float()
    values, order = torch.sort(lf, dim=-1, descending=True, stable=True)
    ids = order[:, :top_k]
    if renormalize:
        return softmax(values[:, :top_k]), ids
    return softmax(lf).gather(-1, ids), ids


def _moe_combine_forward(expert_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    if _triton(expert_out):
        return _kernels().moe_combine(expert_out, weights)
    acc = torch.zeros(
        expert_out.shape[0], expert_out.shape[2], dtype=torch.float32, device=expert_out.device
    )
    for slot in range(expert_out.shape[1]):
        acc = acc + weights[:, slot : slot + 1].float() * expert_out[:, slot].float()
    return acc.to(expert_out.dtype)


class _MoECombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, expert_out, weights):  # type: ignore[override]
        ctx.save_for_backward(expert_out, weights)
        return _moe_combine_forward(expert_out.detach(), weights.detach())

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        expert_out, weights = ctx.saved_tensors
        g = grad.float()
        grad_out = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_out = (weights.float().unsqueeze(-1) * g.unsqueeze(1)).to(expert_out.dtype)
        if ctx.needs_input_grad[1]:  # sum over the hidden dimension: one fixed tree
            grad_w = fixed_sum(expert_out.float() * g.unsqueeze(1)).to(weights.dtype)
        return grad_out, grad_w


def moe_combine(expert_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``sum_slot weights[t, slot] * expert_out[t, slot]`` of ``expert_out`` [T, k, H] in float32,
    slots added in order 0..k-1 (the ranking of :func:`topk_routing`), rounded once."""
    return _MoECombine.apply(expert_out, weights)


def _log_softmax_forward(x: torch.Tensor) -> torch.Tensor:
    if _triton(x):
        return _kernels().log_softmax(x)
    xf = x.float()
    m = xf.amax(dim=-1, keepdim=True)  # exact in any order
    s = xf.double() - m.double()
    lse = log64(fixed_sum(exp64(s)))  # the sum is >= 1: exp(0) is one of its terms
    return (s - lse.unsqueeze(-1)).to(torch.float32)


class _LogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        y = _log_softmax_forward(x.detach())
        ctx.save_for_backward(y)
        ctx.dtype = x.dtype
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (y,) = ctx.saved_tensors
        g = grad.float()
        p = exp64(y.double()).to(torch.float32)
        return (g - p * fixed_sum(g).unsqueeze(-1)).to(ctx.dtype)


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """float32 ``log_softmax`` over the last dimension of ``logits``, the same bits on every CPU:
    ``f32((x - m) - log(fixed_sum(exp(x - m))))`` with ``m`` the row's max, evaluated in float64
    (:func:`exp64`, :func:`log64`) and rounded once.

    torch's own ``log_softmax`` kernel treats each row alone, but its bits depend on the CPU
    (its vectorized exp and its reduction order follow the instruction set: AVX2, AVX-512, or
    none), so strict mode uses this one on both sides: the learner's ``token_logprobs`` and vLLM's
    sampler (``Sampler.compute_logprobs``, replaced by ``minite_vllm.engine_patches`` in a strict
    engine).
    """
    return _LogSoftmax.apply(logits)
