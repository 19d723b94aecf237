"""Strict-mode reference ops: one batch-invariant definition of every op around the NVFP4 linears.

With ``NVFP4Recipe(strict_ops=True)`` both engines run these instead of their own kernels for the
ops between the linears (RMSNorm, residual adds, rotary embedding, attention core, SwiGLU, MoE
routing and combine) and for the BF16 GEMMs (LM head, MoE router), so the sampler's and the
learner's token log-probs are bitwise equal (see ``docs/strict.md``).

The contract of every op: each output element is a function of its own inputs alone (its row,
its head, its token's keys), never of the batch size, the row's position in memory, the thread
count, or the other rows. Two rules make that hold by construction:

- **Only correctly rounded arithmetic.** Every value comes from IEEE-754 add, sub, mul, div and
  sqrt, comparisons, and exact or round-to-nearest-even conversions, applied elementwise (torch
  applies these identically in its vectorized loop bodies and its scalar tails). Transcendental
  functions (exp, log, sin, cos) are evaluated here in float64 from those operations (Cody-Waite
  range reduction and a polynomial) and rounded once to float32: torch's own kernels use
  different code for the vectorized body and the scalar tail of a loop (``F.silu`` differs in
  about 4% of float32 elements), so their bits depend on where an element sits in memory.
- **Reductions in one fixed order**: :func:`fixed_sum`, a pairwise halving tree over the reduced
  dimension zero-padded to a power of two. Zeros appended to a reduction never change a bit, so a
  decode step that attends to t keys and a prefill row that sees the same t keys followed by
  masked ones give the same bits.

No multiply-add is ever fused (separate torch ops in eager mode); compiling these functions with
``torch.compile`` could fuse them and is not supported. The forward is the contract; gradients
(for the learner) use plain torch formulas where it is cheaper (attention, linear) and are not
bitwise specified.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

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


def residual_add(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``x + residual`` in float32, rounded once to ``x``'s dtype."""
    return (x.float() + residual.float()).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, in ``x``'s dtype:
    ``y = dtype(f32(x * r) * w)`` with ``r = 1 / sqrt(fixed_sum(x*x) / D + eps)`` in float32."""
    xf = x.float()
    var = fixed_sum(xf * xf) / x.shape[-1]
    inv = 1.0 / torch.sqrt(var + torch.tensor(eps, dtype=torch.float32, device=x.device))
    return ((xf * inv.unsqueeze(-1)) * weight.float()).to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(r), r)`` with ``r = residual_add(x, residual)``: a pre-norm block's entry."""
    r = residual_add(x, residual)
    return rms_norm(r, weight, eps), r


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up``: ``dtype(f32(g / f32(1 + exp(-g))) * u)`` in float32."""
    g = gate.float()
    return ((g / (exp(-g) + 1.0)) * up.float()).to(gate.dtype)


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


def _attention_plain(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """The same attention with torch's own matmul and softmax (gradients, tests)."""
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
        return _attention_forward(q.detach(), k.detach(), v.detach(), q_positions, scale)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        q, k, v, q_positions = ctx.saved_tensors
        needs = ctx.needs_input_grad[:3]
        inputs = [t.detach().requires_grad_(n) for t, n in zip((q, k, v), needs, strict=True)]
        with torch.enable_grad():
            out = _attention_plain(*inputs, q_positions, ctx.scale)
            wanted = [t for t in inputs if t.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, grad) if wanted else ())
        return (*(next(grads) if n else None for n in needs), None, None)


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


# -- BF16 GEMMs (LM head, MoE router) ------------------------------------------------------------


def _linear_forward(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
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
        g = grad.reshape(-1, grad.shape[-1])
        grad_x = (g @ w.float()).reshape(*x.shape).to(x.dtype) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = (g.T @ x.reshape(-1, x.shape[-1]).float()).to(w.dtype)
        return grad_x, grad_w


def linear(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``x @ w.T (+ bias)`` for high-precision (BF16) layers, batch-invariant:
    ``y[m, n] = out_dtype(fixed_sum_k(f32(x[m,k] * w[n,k])) (+ f32(bias[n])))``; products of
    BF16 values are exact in float32. ``out_dtype`` defaults to ``x``'s dtype."""
    if x.shape[-1] != w.shape[-1]:
        raise ValueError(f"linear: x {list(x.shape)} does not match weight {list(w.shape)}")
    y = _Linear.apply(x, w)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype)


# -- MoE routing and combine, log-probs ----------------------------------------------------------


def topk_routing(
    logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing of ``logits`` [T, E]: ``(weights float32 [T, k], ids int64 [T, k])``.

    Experts are ranked by logit, ties to the lower index. With ``renormalize`` the weights are
    the softmax over the k selected logits, else the softmax over all E, taken at the selected
    experts (both in float32 with :func:`exp` and :func:`fixed_sum`).
    """
    lf = logits.float()
    values, order = torch.sort(lf, dim=-1, descending=True, stable=True)
    ids = order[:, :top_k]
    if renormalize:
        top = values[:, :top_k]
        e = exp(top - top[:, :1])
        return e / fixed_sum(e).unsqueeze(-1), ids
    e = exp(lf - values[:, :1])
    return (e / fixed_sum(e).unsqueeze(-1)).gather(-1, ids), ids


def moe_combine(expert_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``sum_slot weights[t, slot] * expert_out[t, slot]`` of ``expert_out`` [T, k, H] in float32,
    slots added in order 0..k-1 (the ranking of :func:`topk_routing`), rounded once."""
    acc = torch.zeros(
        expert_out.shape[0], expert_out.shape[2], dtype=torch.float32, device=expert_out.device
    )
    for slot in range(expert_out.shape[1]):
        acc = acc + weights[:, slot : slot + 1].float() * expert_out[:, slot].float()
    return acc.to(expert_out.dtype)


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """float32 ``log_softmax`` over the last dimension of ``logits``.

    This one is torch's own kernel, because it is what vLLM's sampler computes its log-probs with
    (``logits.log_softmax(-1, dtype=float32)``) and the sampler is not a replaceable op; its CPU
    kernel treats each row alone (``tests/test_strict_alignment.py`` checks that a row gives the
    same bits whatever the batch, layout or thread count), so both engines agree.
    """
    return torch.log_softmax(logits.float(), dim=-1)
