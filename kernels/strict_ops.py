"""Strict-mode ops on CUDA: Triton twins of ``minite_common.ops``' torch reference, same bits.

Every kernel evaluates the reference's formula operation for operation, so its output is bitwise
the CPU reference's (``minite_common.ops`` dispatches here for CUDA tensors):

- **No contraction**: every kernel is launched with ``enable_fp_fusion=False`` (Triton then asks
  LLVM for no FMA and passes ``--fmad=false`` to ptxas), so ``a * b + c`` is a rounded product
  and a rounded sum, as in eager torch. Divisions are ``tl.math.div_rn`` and square roots
  ``tl.sqrt_rn`` (Triton's ``/`` on float32 and ``tl.sqrt`` are approximate on NVIDIA GPUs).
- **Transcendentals** (exp, log) are the reference's float64 Cody-Waite + Horner evaluations,
  written out with the same constants, rounded once to float32; ``rint`` is the exact
  ``(x + 1.5*2^52) - 1.5*2^52`` (round half to even, as ``torch.round``).
- **Reductions** are the reference's ``fixed_sum``: over a power-of-two size ``P`` (zero-padded),
  the upper half is added onto the lower half until one element is left. Element ``j`` of the
  reduced axis is split as ``j = a * NC + c`` (``a`` the high bits, held in registers, ``c`` the
  low bits, looped over): the tree first halves over the high bits (:func:`_halve`, in
  registers), then over ``c``, which is the adjacent pairwise tree over ``c`` in bit-reversed
  order, kept on a stack of partial sums across loop iterations (:func:`_push`, binary-counter
  merging). So long reductions (vocabulary, keys, K) stream without changing the order.

Each program computes whole output rows (or one output tile of a GEMM) from its own inputs only,
so every result is batch-invariant and deterministic. This module imports nothing from
``minite_common``; the wrappers take and return torch tensors on one CUDA device (they also run
under ``TRITON_INTERPRET=1`` on CPU tensors, which is how the CPU test suite checks them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Launch options of every strict kernel: no fused multiply-add.
LAUNCH = {"enable_fp_fusion": False}
#: Levels of the partial-sum stack: a streamed reduction has at most 2**MAX_LEVELS loop steps.
MAX_LEVELS = 8

NEG_INF = tl.constexpr(float("-inf"))
_RINT = tl.constexpr(6755399441055744.0)  # 1.5 * 2**52
_INV_LN2 = tl.constexpr(1.44269504088896338700e00)
_LN2_HI = tl.constexpr(6.93147180369123816490e-01)
_LN2_LO = tl.constexpr(1.90821492927058770002e-10)
_SQRT2 = tl.constexpr(1.41421356237309514547e00)


# -- elementary functions (float64, the reference's constants) ------------------------------------


@triton.jit
def _rint(x):
    """Round float64 ``x`` (|x| < 2**51) to an integer, ties to even."""
    return (x + _RINT) - _RINT


@triton.jit
def _pow2(k):
    """``2.0**k`` in float64 for int64 ``k`` in [-1022, 1023]."""
    return ((k + 1023) << 52).to(tl.float64, bitcast=True)


@triton.jit
def _exp_poly(r):
    p = r * 1.6059043836821613e-10 + 2.08767569878681e-09
    p = p * r + 2.505210838544172e-08
    p = p * r + 2.755731922398589e-07
    p = p * r + 2.7557319223985893e-06
    p = p * r + 2.48015873015873e-05
    p = p * r + 0.0001984126984126984
    p = p * r + 0.001388888888888889
    p = p * r + 0.008333333333333333
    p = p * r + 0.041666666666666664
    p = p * r + 0.16666666666666666
    p = p * r + 0.5
    p = p * r + 1.0
    return p * r + 1.0


@triton.jit
def _log_poly(z):
    p = z * 0.043478260869565216 + 0.047619047619047616
    p = p * z + 0.05263157894736842
    p = p * z + 0.058823529411764705
    p = p * z + 0.06666666666666667
    p = p * z + 0.07692307692307693
    p = p * z + 0.09090909090909091
    p = p * z + 0.1111111111111111
    p = p * z + 0.14285714285714285
    p = p * z + 0.2
    p = p * z + 0.3333333333333333
    return p * z + 1.0


@triton.jit
def exp64(x):
    """``exp`` of float64 ``x``: ``minite_common.ops.exp64`` operation for operation."""
    x = tl.where(x < -745.0, -745.0, x)
    x = tl.where(x > 709.0, 709.0, x)  # NaN stays NaN (comparisons are false)
    k = _rint(x * _INV_LN2)
    r = (x - k * _LN2_HI) - k * _LN2_LO
    p = _exp_poly(r)
    ki = tl.where(k == k, k, 0.0).to(tl.int64)
    half = ki >> 1  # floor(k / 2)
    return (p * _pow2(half)) * _pow2(ki - half)


@triton.jit
def log64(x):
    """``log`` of positive normal float64 ``x``: ``minite_common.ops.log64``."""
    bits = x.to(tl.int64, bitcast=True)
    e = (bits >> 52) - 1023
    m = ((bits & 0xFFFFFFFFFFFFF) | 0x3FF0000000000000).to(tl.float64, bitcast=True)
    big = m > _SQRT2
    m = tl.where(big, m * 0.5, m)
    ef = (e + big.to(tl.int64)).to(tl.float64)
    f = m - 1.0
    s = f / (f + 2.0)  # float64 "/" is div.rn.f64 on NVIDIA GPUs (float32 "/" is not)
    log_m = (s * 2.0) * _log_poly(s * s)
    return ef * _LN2_HI + (ef * _LN2_LO + log_m)


@triton.jit
def exp32(x):
    """``float32(exp(x))`` of float32 ``x`` (``minite_common.ops.exp``)."""
    return exp64(x.to(tl.float64)).to(tl.float32)


# -- fixed-order reduction ------------------------------------------------------------------------


@triton.jit
def _halve(x, R: tl.constexpr, N: tl.constexpr, STEPS: tl.constexpr):
    """``[R, N] -> [R, N >> STEPS]``: ``STEPS`` levels of the halving tree over the last axis
    (element ``i`` plus element ``i + half``)."""
    for st in tl.static_range(STEPS):
        x = tl.sum(tl.reshape(x, (R, 2, N >> (st + 1))), axis=1)
    return x


@triton.jit
def _bitrev(i, L: tl.constexpr):
    r = i * 0
    for b in tl.static_range(L):
        r = r | (((i >> b) & 1) << (L - 1 - b))
    return r


@triton.jit
def _level(slot, v, carry, bit):
    merge = carry & (bit == 1)
    place = carry & (bit == 0)
    return tl.where(place, v, slot), tl.where(merge, slot + v, v), merge


@triton.jit
def _push(v, i, L: tl.constexpr, s0, s1, s2, s3, s4, s5, s6, s7):
    """Item ``i`` of an adjacent pairwise tree over ``2**L`` items: merge ``v`` with the stack's
    partial sums like a binary counter. After item ``2**L - 1`` the returned ``v`` is the sum."""
    carry = i >= 0
    if L > 0:
        s0, v, carry = _level(s0, v, carry, i & 1)
    if L > 1:
        s1, v, carry = _level(s1, v, carry, (i >> 1) & 1)
    if L > 2:
        s2, v, carry = _level(s2, v, carry, (i >> 2) & 1)
    if L > 3:
        s3, v, carry = _level(s3, v, carry, (i >> 3) & 1)
    if L > 4:
        s4, v, carry = _level(s4, v, carry, (i >> 4) & 1)
    if L > 5:
        s5, v, carry = _level(s5, v, carry, (i >> 5) & 1)
    if L > 6:
        s6, v, carry = _level(s6, v, carry, (i >> 6) & 1)
    if L > 7:
        s7, v, carry = _level(s7, v, carry, (i >> 7) & 1)
    return v, s0, s1, s2, s3, s4, s5, s6, s7


def _split(size: int, min_regs: int = 1) -> tuple[int, int, int]:
    """``(P, S, L)`` for a reduction over ``size`` elements: ``P`` = padded power of two,
    ``S`` = elements per loop step held in registers, ``2**L = P / S`` loop steps."""
    p = 1 << max(size - 1, 0).bit_length()
    s = min(p, max(min_regs, p >> MAX_LEVELS))
    return p, s, (p // s).bit_length() - 1


def _log2(n: int) -> int:
    return n.bit_length() - 1


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


# -- elementwise ops ------------------------------------------------------------------------------


@triton.jit
def _residual_add_kernel(x_ptr, r_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
    r = tl.load(r_ptr + offs, mask=mask).to(tl.float32)
    tl.store(y_ptr + offs, (x + r).to(y_ptr.dtype.element_ty), mask=mask)


def _elementwise(kernel, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``kernel`` over the broadcast ``a`` and ``b``, in ``a``'s dtype (1024 elements a program)."""
    a, b = torch.broadcast_tensors(a, b)
    a, b = a.contiguous(), b.contiguous()
    y = torch.empty_like(a)
    n = a.numel()
    if n:
        kernel[(triton.cdiv(n, 1024),)](a, b, y, n, BLOCK=1024, **LAUNCH)
    return y


def residual_add(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``x + residual`` in float32, rounded once to ``x``'s dtype."""
    return _elementwise(_residual_add_kernel, x, residual)


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask).to(tl.float32)
    y = tl.math.div_rn(g, exp32(-g) + 1.0) * u
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``dtype(f32(g / f32(1 + exp(-g))) * u)``, in ``gate``'s dtype."""
    return _elementwise(_silu_mul_kernel, gate, up)


@triton.jit
def _rope_kernel(x_ptr, c_ptr, s_ptr, y_ptr, D, HALF, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    rot = i < HALF
    x1 = tl.load(x_ptr + row * D + i, mask=rot, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + row * D + HALF + i, mask=rot, other=0.0).to(tl.float32)
    c = tl.load(c_ptr + row * HALF + i, mask=rot, other=0.0)
    s = tl.load(s_ptr + row * HALF + i, mask=rot, other=0.0)
    ty = y_ptr.dtype.element_ty
    tl.store(y_ptr + row * D + i, (x1 * c - x2 * s).to(ty), mask=rot)
    tl.store(y_ptr + row * D + HALF + i, (x2 * c + x1 * s).to(ty), mask=rot)
    for j0 in range(2 * HALF, D, BLOCK):  # features past the rotary part pass through
        j = j0 + i
        tl.store(y_ptr + row * D + j, tl.load(x_ptr + row * D + j, mask=j < D), mask=j < D)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``2*cos.shape[-1]`` features of ``x`` (NeoX layout), ``cos``/``sin``
    float32 broadcasting against ``x[..., :half]``: ``[x1*c - x2*s, x2*c + x1*s]`` rounded once."""
    half = cos.shape[-1]
    shape = x.shape[:-1] + (half,)
    xc = x.contiguous()
    c = cos.float().expand(shape).reshape(-1, half).contiguous()
    s = sin.float().expand(shape).reshape(-1, half).contiguous()
    y = torch.empty_like(xc)
    rows = c.shape[0]
    if rows and half:
        block = _pow2_at_least(half)
        _rope_kernel[(rows,)](xc, c, s, y, x.shape[-1], half, BLOCK=block, **LAUNCH)
    elif rows:
        y.copy_(xc)
    return y


@triton.jit
def _moe_combine_kernel(y_ptr, w_ptr, o_ptr, SLOTS, HID, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = h < HID
    acc = tl.zeros([BLOCK], tl.float32)
    for k in range(SLOTS):
        w = tl.load(w_ptr + t * SLOTS + k).to(tl.float32)
        y = tl.load(y_ptr + (t * SLOTS + k) * HID + h, mask=mask).to(tl.float32)
        acc = acc + w * y
    tl.store(o_ptr + t * HID + h, acc.to(o_ptr.dtype.element_ty), mask=mask)


def moe_combine(expert_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``sum_slot w[t, slot] * y[t, slot]`` of ``expert_out`` [T, k, H], slots in order, float32,
    rounded once to ``expert_out``'s dtype."""
    tokens, slots, hidden = expert_out.shape
    y = expert_out.contiguous()
    w = weights.contiguous()
    out = torch.empty(tokens, hidden, dtype=y.dtype, device=y.device)
    if tokens and hidden:
        grid = (tokens, triton.cdiv(hidden, 1024))
        _moe_combine_kernel[grid](y, w, out, slots, hidden, BLOCK=1024, **LAUNCH)
    return out


# -- row reductions -------------------------------------------------------------------------------


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, D, eps, P: tl.constexpr, LP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, P)
    mask = i < D
    x = tl.load(x_ptr + row * D + i, mask=mask, other=0.0).to(tl.float32)
    ss = tl.reshape(_halve(tl.reshape(x * x, (1, P)), 1, P, LP), (1,))
    var = tl.math.div_rn(ss, tl.full([1], D, tl.int32).to(tl.float32))
    inv = tl.math.div_rn(tl.full([1], 1.0, tl.float32), tl.sqrt_rn(var + eps))
    w = tl.load(w_ptr + i, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * D + i, ((x * inv) * w).to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``dtype((x * r) * w)``, ``r = 1 / sqrt(fixed_sum(x*x) / D + eps)`` per row, float32."""
    d = x.shape[-1]
    xc = x.contiguous()
    y = torch.empty_like(xc)
    rows = xc.numel() // d if d else 0
    if rows:
        p = _pow2_at_least(d)
        warps = 8 if p >= 4096 else 4
        _rms_norm_kernel[(rows,)](
            xc, weight.contiguous(), y, d, eps, P=p, LP=_log2(p), num_warps=warps, **LAUNCH
        )
    return y


@triton.jit
def _softmax_kernel(x_ptr, y_ptr, E, P: tl.constexpr, LP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, P)
    mask = i < E
    x = tl.load(x_ptr + row * E + i, mask=mask, other=NEG_INF).to(tl.float32)
    m = tl.max(x, axis=0)
    m = tl.where(tl.sum((x != x).to(tl.int32), axis=0) > 0, float("nan"), m)  # as torch.amax
    e = tl.where(mask, exp32(x - m), 0.0)
    den = tl.reshape(_halve(tl.reshape(e, (1, P)), 1, P, LP), (1,))
    tl.store(y_ptr + row * E + i, tl.math.div_rn(e, den), mask=mask)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """float32 softmax over the last dimension: ``e / fixed_sum(e)``, ``e = exp(x - max x)``."""
    e = x.shape[-1]
    xc = x.contiguous()
    y = torch.empty(xc.shape, dtype=torch.float32, device=xc.device)
    rows = xc.numel() // e if e else 0
    if rows:
        p = _pow2_at_least(e)
        _softmax_kernel[(rows,)](xc, y, e, P=p, LP=_log2(p), **LAUNCH)
    return y


@triton.jit
def _log_softmax_kernel(
    x_ptr, y_ptr, V, BLOCK: tl.constexpr, S: tl.constexpr, LS: tl.constexpr, L: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * V
    i = tl.arange(0, BLOCK)
    mx = tl.full([BLOCK], NEG_INF, tl.float32)
    nan = tl.zeros([BLOCK], tl.int32)
    for j0 in range(0, V, BLOCK):
        x = tl.load(base + j0 + i, mask=j0 + i < V, other=NEG_INF).to(tl.float32)
        mx = tl.maximum(mx, x)
        nan += (x != x).to(tl.int32)
    m = tl.max(mx, axis=0).to(tl.float64)
    m64 = tl.where(tl.sum(nan, axis=0) > 0, float("nan"), m)  # torch's amax propagates NaN
    # fixed_sum of exp64(x - m) over the padded row: j = a * NC + c
    NC: tl.constexpr = 1 << L
    a = tl.arange(0, S)
    z = tl.zeros([1, 1], tl.float64)
    s0, s1, s2, s3, s4, s5, s6, s7 = z, z, z, z, z, z, z, z
    total = z
    for it in range(NC):
        j = a * NC + _bitrev(it, L)
        x = tl.load(base + j, mask=j < V, other=0.0).to(tl.float64)
        e = tl.where(j < V, exp64(x - m64), 0.0)
        v = _halve(tl.reshape(e, (1, S)), 1, S, LS)
        total, s0, s1, s2, s3, s4, s5, s6, s7 = _push(v, it, L, s0, s1, s2, s3, s4, s5, s6, s7)
    lse = tl.reshape(log64(total), (1,))
    for j0 in range(0, V, BLOCK):
        j = j0 + i
        x = tl.load(base + j, mask=j < V, other=0.0).to(tl.float64)
        tl.store(y_ptr + row * V + j, ((x - m64) - lse).to(tl.float32), mask=j < V)


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """float32 ``f32((x - m) - log(fixed_sum(exp(x - m))))`` per row, in float64."""
    v = logits.shape[-1]
    xc = logits.contiguous()
    y = torch.empty(xc.shape, dtype=torch.float32, device=xc.device)
    rows = xc.numel() // v if v else 0
    if rows:
        _, s, levels = _split(v, min_regs=64)
        _log_softmax_kernel[(rows,)](
            xc, y, v, BLOCK=1024, S=s, LS=_log2(s), L=levels, num_warps=4, **LAUNCH
        )
    return y


# -- BF16 GEMM (LM head, router) ------------------------------------------------------------------


@triton.jit
def _linear_kernel(
    x_ptr, w_ptr, y_ptr, M, N, K, sxm, swn,
    BM: tl.constexpr, BN: tl.constexpr, S: tl.constexpr, LS: tl.constexpr, L: tl.constexpr,
):  # fmt: skip
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    a = tl.arange(0, S)
    NC: tl.constexpr = 1 << L
    z = tl.zeros([BM, BN], tl.float32)
    s0, s1, s2, s3, s4, s5, s6, s7 = z, z, z, z, z, z, z, z
    total = z
    for it in range(NC):
        k = a * NC + _bitrev(it, L)
        km = k < K
        x = tl.load(
            x_ptr + rm[:, None].to(tl.int64) * sxm + k[None, :],
            mask=(rm < M)[:, None] & km[None, :], other=0.0,
        ).to(tl.float32)  # fmt: skip
        w = tl.load(
            w_ptr + rn[:, None].to(tl.int64) * swn + k[None, :],
            mask=(rn < N)[:, None] & km[None, :], other=0.0,
        ).to(tl.float32)  # fmt: skip
        prod = tl.reshape(x[:, None, :] * w[None, :, :], (BM * BN, S))
        v = tl.reshape(_halve(prod, BM * BN, S, LS), (BM, BN))
        total, s0, s1, s2, s3, s4, s5, s6, s7 = _push(v, it, L, s0, s1, s2, s3, s4, s5, s6, s7)
    offs = rm[:, None].to(tl.int64) * N + rn[None, :]
    tl.store(y_ptr + offs, total, mask=(rm < M)[:, None] & (rn < N)[None, :])


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float32 ``y[m, n] = fixed_sum_k(f32(x[m, k]) * f32(w[n, k]))`` of ``x`` [..., K]."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    wc = w if w.stride(-1) == 1 else w.contiguous()
    m, n = x2.shape[0], wc.shape[0]
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    if m and n:
        _, s, levels = _split(k, min_regs=16)
        bm, bn = (16, 16) if m > 8 else (1, 64)  # each element's tree is the same in any tile
        grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
        _linear_kernel[grid](
            x2, wc, y, m, n, k, x2.stride(0), wc.stride(0),
            BM=bm, BN=bn, S=s, LS=_log2(s), L=levels, **LAUNCH,
        )  # fmt: skip
    elif m:
        y.zero_()
    return y.reshape(*x.shape[:-1], n)


# -- attention ------------------------------------------------------------------------------------


@triton.jit
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, s_ptr,
    tok_ptr, pos_ptr, seq_ptr, len_ptr, bt_ptr,
    scale, H, GROUP, D, DV, BS, bt_stride,
    sq_t, sq_h, sk_b, sk_o, sk_h, sv_b, sv_o, sv_h, so_t, so_h,
    DP: tl.constexpr, LDP: tl.constexpr, DVP: tl.constexpr, BJ: tl.constexpr,
    S: tl.constexpr, LS: tl.constexpr, L: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    tok = tl.load(tok_ptr + pid // H).to(tl.int64)
    h = pid % H
    hk = h // GROUP
    pos = tl.load(pos_ptr + tok)
    seq = tl.load(seq_ptr + tok).to(tl.int64)
    tk = tl.load(len_ptr + seq)
    bt = bt_ptr + seq * bt_stride
    NC: tl.constexpr = 1 << L
    srow = s_ptr + pid.to(tl.int64) * (S * NC)
    d = tl.arange(0, DP)
    q = tl.load(q_ptr + tok * sq_t + h * sq_h + d, mask=d < D, other=0.0).to(tl.float32)
    # scores s_j = fixed_sum_d(q_d * k_jd) * scale, and their max over the visible keys
    mx = tl.full([BJ], NEG_INF, tl.float32)
    nan = tl.zeros([BJ], tl.int32)
    for j0 in range(0, tk, BJ):
        j = j0 + tl.arange(0, BJ)
        jm = j < tk
        blk = tl.load(bt + j // BS, mask=jm, other=0).to(tl.int64)
        kt = tl.load(
            k_ptr + blk[:, None] * sk_b + (j % BS)[:, None].to(tl.int64) * sk_o + hk * sk_h
            + d[None, :],
            mask=jm[:, None] & (d < D)[None, :], other=0.0,
        ).to(tl.float32)  # fmt: skip
        sj = tl.reshape(_halve(q[None, :] * kt, BJ, DP, LDP), (BJ,)) * scale
        tl.store(srow + j, sj, mask=jm)
        valid = jm & (j <= pos)
        mx = tl.maximum(mx, tl.where(valid, sj, NEG_INF))
        nan += (valid & (sj != sj)).to(tl.int32)
    m = tl.max(mx, axis=0)
    m = tl.where(tl.sum(nan, axis=0) > 0, float("nan"), m)
    tl.debug_barrier()
    # out = fixed_sum_j(e_j * v_j) / fixed_sum_j(e_j), j = a * NC + c
    a = tl.arange(0, S)
    dv = tl.arange(0, DVP)
    zn = tl.zeros([DVP, 1], tl.float32)
    zd = tl.zeros([1, 1], tl.float32)
    n0, n1, n2, n3, n4, n5, n6, n7 = zn, zn, zn, zn, zn, zn, zn, zn
    e0, e1, e2, e3, e4, e5, e6, e7 = zd, zd, zd, zd, zd, zd, zd, zd
    num = zn
    den = zd
    for it in range(NC):
        j = a * NC + _bitrev(it, L)
        jm = j < tk
        valid = jm & (j <= pos)
        sj = tl.load(srow + j, mask=jm, other=0.0)
        e = tl.where(valid, exp32(tl.where(valid, sj - m, NEG_INF)), 0.0)
        blk = tl.load(bt + j // BS, mask=jm, other=0).to(tl.int64)
        vt = tl.load(
            v_ptr + blk[None, :] * sv_b + (j % BS)[None, :].to(tl.int64) * sv_o + hk * sv_h
            + dv[:, None],
            mask=jm[None, :] & (dv < DV)[:, None], other=0.0,
        ).to(tl.float32)  # fmt: skip
        terms = tl.where(jm[None, :], e[None, :] * vt, 0.0)
        vn = _halve(terms, DVP, S, LS)
        vd = _halve(tl.reshape(e, (1, S)), 1, S, LS)
        num, n0, n1, n2, n3, n4, n5, n6, n7 = _push(vn, it, L, n0, n1, n2, n3, n4, n5, n6, n7)
        den, e0, e1, e2, e3, e4, e5, e6, e7 = _push(vd, it, L, e0, e1, e2, e3, e4, e5, e6, e7)
    out = tl.reshape(tl.math.div_rn(num, den), (DVP,))
    tl.store(o_ptr + tok * so_t + h * so_h + dv, out.to(o_ptr.dtype.element_ty), mask=dv < DV)


#: Largest score scratch (float32 elements) one attention launch uses; more tokens are chunked.
SCRATCH_ELEMENTS = 1 << 25


def paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_ids: torch.Tensor,
    positions: torch.Tensor,
    seq_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """Causal attention of query tokens ``q`` [T, H, D] against paged keys and values.

    ``key_cache`` [blocks, block_size, Hk, D] and ``value_cache`` [blocks, block_size, Hk, Dv]
    (any strides, last dimension contiguous); token ``t`` belongs to sequence ``seq_ids[t]``,
    sits at ``positions[t]`` and attends keys ``0..positions[t]`` of the ``seq_lens[s]`` keys of
    its sequence, found through ``block_tables[s]``. Output [T, H, Dv] in ``q``'s dtype, each row
    ``minite_common.ops.causal_attention``'s row for the same ``seq_lens[s]`` keys.
    """
    tokens, heads, dim = q.shape
    kv_heads, dim_v = key_cache.shape[2], value_cache.shape[3]
    out = torch.empty(tokens, heads, dim_v, dtype=q.dtype, device=q.device)
    if tokens == 0:
        return out
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("paged_attention: the caches' last dimension must be contiguous")
    qc = q if q.stride(-1) == 1 else q.contiguous()
    dev = q.device
    seq_ids = seq_ids.to(device=dev, dtype=torch.int32)
    positions = positions.to(device=dev, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    bt = block_tables.to(device=dev, dtype=torch.int32)
    padded = [_pow2_at_least(n) for n in seq_lens]
    tok_padded = torch.tensor(padded, device=dev)[seq_ids.long()]
    dp, dvp = _pow2_at_least(dim), _pow2_at_least(dim_v)
    for p in sorted(set(padded)):
        toks = torch.nonzero(tok_padded == p).flatten().to(torch.int32)
        if toks.numel() == 0:
            continue
        _, s, levels = _split(p, min_regs=16)
        step = max(1, SCRATCH_ELEMENTS // (heads * p))
        for start in range(0, toks.numel(), step):
            chunk = toks[start : start + step]
            scratch = torch.empty(chunk.numel() * heads, p, dtype=torch.float32, device=dev)
            _attention_kernel[(chunk.numel() * heads,)](
                qc, key_cache, value_cache, out, scratch,
                chunk, positions, seq_ids, lens, bt,
                float(scale), heads, heads // kv_heads, dim, dim_v, key_cache.shape[1],
                bt.stride(0),
                qc.stride(0), qc.stride(1),
                key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
                value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
                out.stride(0), out.stride(1),
                DP=dp, LDP=_log2(dp), DVP=dvp, BJ=16, S=s, LS=_log2(s), L=levels, **LAUNCH,
            )  # fmt: skip
    return out


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """One sequence: ``q`` [Tq, H, D] at ``q_positions`` against ``k`` [Tk, Hk, D], ``v``
    [Tk, Hk, Dv] (keys 0..Tk-1): :func:`paged_attention` with the keys as one block."""
    tk = k.shape[0]
    kc = k if k.stride(-1) == 1 else k.contiguous()
    vc = v if v.stride(-1) == 1 else v.contiguous()
    table = torch.zeros(1, 1, dtype=torch.int32, device=q.device)
    seq_ids = torch.zeros(q.shape[0], dtype=torch.int32, device=q.device)
    return paged_attention(
        q, kc.unsqueeze(0), vc.unsqueeze(0), table, seq_ids, q_positions, [tk], scale
    )
