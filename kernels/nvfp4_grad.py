"""The learner's backward GEMM operands on Hopper: NVFP4 quantize-dequantize of gradients and
activations in two fused passes, for BF16 tensor-core GEMMs (cuBLAS) in dgrad and wgrad.

Hopper has no FP4 MMA, so an NVFP4 GEMM runs on BF16 values ``code * f32(block scale)``, which
are exact in BF16; the FP32 global decode scales multiply the accumulator. The backward GEMMs
are the learner's own business (docs/contract.md section 7), so they need neither the forward's
fixed K order nor packed codes: these kernels write the exact BF16 values ``code * scale`` directly.

One input ``x`` [R, C] (R tokens, C features; any strides) gives, in the same passes:

- ``row``: blocks of 16 along C (dgrad's output-gradient operand), values ``x * col_scale[c]``
  (the weight's per-channel decode scales folded in); output [R, C];
- ``col``: blocks of 16 along R (wgrad's operands), optionally after the random Hadamard
  transform ``diag(signs) @ H16 / 4`` over 16-token blocks (rounded to BF16, as
  ``random_hadamard_transform``), tokens zero-padded to a multiple of 16; output
  [ceil(R/16)*16, C].

Each output has one per-tensor amax (first pass: atomic max of the tiles' amax, non-finite flag
alongside), then the recipe-v1 block scales of :func:`minite_common.quantize_nvfp4` (same
float32 formula and order) and codes rounded to nearest even, or stochastically with the torch
path's rule (the upper neighbour with probability ``(|v| - lo) / (hi - lo)``: ``floor(|v| /
step + u)``; 16-bit uniforms centred on their cells, two per integer hash of an element index
and a seed: elements 8 apart along their block share one hash). The decode scale (NaN
when the operand holds NaN/Inf, as the torch path gives) is written to a two-element vector.

Compared with the torch path, the codes and scales are the same function of the operand; only
the RHT's sums differ where float32 rounds them (the same butterfly order as the torch path's
float64 sums: rarely one BF16 ulp), and the stochastic rounding draws other random numbers of
the same distribution.

Layout: a program takes BLOCK_R rows (4 stripes of 16) and BLOCK_C columns (256, or 128 for
the row operand alone). The col operand
loads a stripe as 16 row vectors, each thread holding whole columns, so the RHT butterfly, the
16-token block amax and the block scale are per-thread arithmetic; the row operand loads the
same stripe again (from cache) as the two 8-column halves of each 16-column block, so each
thread holds whole blocks. No block scale is computed twice and no value crosses threads.

Also here: :func:`decoded_weight` (dgrad's BF16 weight operand, cached per weight version) and
:func:`scale_rows` (the backward GEMMs' epilogue: float32 accumulator times decode scales, one
rounding to the output dtype, in one pass).
"""

from __future__ import annotations

import os
import weakref

import torch
import triton
import triton.language as tl

from ._fp import (
    FLT_MAX,
    INF,
    SIXTH_F32,
    e4m3_to_f32,
    f32_to_e4m3_rne,
    global_scales,
    nan_like,
    round_to_bf16,
)
from .nvfp4_decode import CHUNK, STREAMS, decode_operand
from .nvfp4_quantize import e2m1_magic

_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
#: Rows per program (the grouped tile table's tile height).
BLOCK_R = 64
#: Rows of one column-operand block (and of one RHT).
STRIPE = tl.constexpr(16)
#: Row tiles per program of the dense amax pass (one reduction and one atomic for all of them).
AMAX_TILES = 4


SIGN = tl.constexpr(-(2**31))


@triton.jit
def _uniform_pair(seed, index):
    """Two uniforms in (0, 1) for each int32 ``index``, ``(k + 1/2) * 2^-16`` with k the high and
    the low 16 bits of Chris Wellons' lowbias32 integer hash of the index mixed with ``seed`` (a
    bijection with full avalanche; about 9 integer operations for two draws, against about 70
    per draw for ``tl.rand``'s 10-round Philox). The draws are centred on their 2^-16 cells, so
    the stochastic rounding below is unbiased to within 2^-17 of a step."""
    x = index.to(tl.uint32, bitcast=True) * 0x9E3779B9 + seed.to(tl.uint32)
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    x = x ^ (x >> 16)
    hi = tl.fma((x >> 16).to(tl.float32), 1.52587890625e-05, 7.62939453125e-06)
    lo = tl.fma((x & 0xFFFF).to(tl.float32), 1.52587890625e-05, 7.62939453125e-06)
    return hi, lo


@triton.jit
def _seeds(seed_ptr, STOCHASTIC: tl.constexpr):
    """The row and col operands' seeds from the int64 ``seed`` at ``seed_ptr`` (in [0, 2^31)):
    ``seed`` and ``(seed * 2654435761 + 1013904223) mod 2^31`` (``seed`` 0, nothing read, when
    not STOCHASTIC)."""
    seed = tl.full([], 0, tl.int64)
    if STOCHASTIC:
        seed = tl.load(seed_ptr).to(tl.int64)
    return seed, (seed * 2654435761 + 1013904223) % 2147483648


@triton.jit
def e2m1_round_nearest(a):
    """float32 ``a`` in [0, 6] rounded to the E2M1 grid (steps 1/2 below 2, 1 below 4, 2 up to
    6), ties to the even code: ``a + step * 2^23`` rounds to a multiple of ``step``."""
    magic = e2m1_magic(a).to(tl.float32, bitcast=True)
    return (a + magic) - magic


@triton.jit
def e2m1_round_stochastic(a, u):
    """float32 ``a`` in [0, 6] rounded to an E2M1 neighbour with ``u`` uniform in (0, 1):
    ``floor(a / step + u) * step`` (the upper one with probability ``(a - lo) / step``), the
    division exact (a power of two) and the sum rounded once in float32 (one fused multiply-add:
    ``a / step`` is exact). Never above 6 since ``a <= 6``."""
    magic = e2m1_magic(a)
    step = (magic - 0x0B800000).to(tl.float32, bitcast=True)
    per_step = (-0x75800000 - magic).to(tl.float32, bitcast=True)  # bits 0x8A800000 - magic
    return tl.floor(tl.fma(a, per_step, u)) * step


@triton.jit
def _block_scales(bamax, s_enc, s_dec):
    """``(scale, encode)`` of blocks with amax ``bamax`` (recipe v1, the float32 formula and
    order of :func:`minite_common.quantize_nvfp4`): the E4M3 block scale as float32 and the
    encode factor ``min(1 / (scale * S_dec), FLT_MAX)``, NaN propagated."""
    scale_f32 = tl.minimum(bamax * (s_enc * SIXTH_F32), 448.0, propagate_nan=tl.PropagateNan.ALL)
    scale = e4m3_to_f32(f32_to_e4m3_rne(scale_f32))
    encode = tl.minimum(
        tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale * s_dec),
        FLT_MAX,
        propagate_nan=tl.PropagateNan.ALL,
    )
    return scale, encode


@triton.jit
def _qdq(v, scale, encode, u, STOCHASTIC: tl.constexpr):
    """BF16 ``code * scale`` of float32 ``v`` (finite) in its block of ``scale`` / ``encode``
    (broadcast to ``v``), nearest-even or stochastic with the uniforms ``u``."""
    # v is finite and encode in (0, FLT_MAX]: the product is never NaN, so a plain min clamps.
    scaled = v * encode
    a = tl.minimum(tl.abs(scaled), 6.0)
    magnitude = e2m1_round_stochastic(a, u) if STOCHASTIC else e2m1_round_nearest(a)
    signed = magnitude.to(tl.int32, bitcast=True) | (scaled.to(tl.int32, bitcast=True) & SIGN)
    return (signed.to(tl.float32, bitcast=True) * scale).to(tl.bfloat16)


@triton.jit
def _draws(seed, index, STOCHASTIC: tl.constexpr):
    """The uniform pair of elements ``index`` and ``index`` + 8 positions along the block (see
    :func:`_uniform_pair`); zeros, unused, when not STOCHASTIC."""
    if STOCHASTIC:
        first, second = _uniform_pair(seed, index)
    else:
        first = tl.zeros(index.shape, tl.float32)
        second = first
    return first, second


@triton.jit
def _finite(v, NONFINITE):
    """``v`` with NaN/Inf as 0 where the operand's non-finite flag ``NONFINITE`` is set."""
    if NONFINITE != 0:
        v = tl.where(tl.abs(v) < INF, v, 0.0)
    return v


@triton.jit
def _magnitude_bits(v):
    """int32 bits of ``|v|``: their integer order is the float order, Inf and NaN on top."""
    return v.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _row_cols(c0, BLOCK_C: tl.constexpr):
    """Columns [1, BLOCK_C/16, 8] of the first halves of the 16-column blocks from ``c0``."""
    return c0 + tl.arange(0, BLOCK_C // 16)[None, :, None] * 16 + tl.arange(0, 8)[None, None, :]


@triton.jit
def _row_col_scales(col_scale_ptr, scale_stride, C, c0, ROW_SCALE: tl.constexpr,
                    BLOCK_C: tl.constexpr):  # fmt: skip
    """``col_scale`` of the two halves' columns (see :func:`_row_halves`); 1 if not ROW_SCALE."""
    cols = _row_cols(c0, BLOCK_C)
    if ROW_SCALE:
        lo = tl.load(col_scale_ptr + cols * scale_stride, mask=cols < C, other=1.0)
        hi = tl.load(col_scale_ptr + (cols + 8) * scale_stride, mask=cols < C, other=1.0)
    else:
        lo = tl.full(cols.shape, 1.0, tl.float32)
        hi = lo
    return lo, hi


@triton.jit
def _row_halves(x_ptr, stride_r, stride_c, r, r_end, C, c0, scale_lo, scale_hi,
                ROW_SCALE: tl.constexpr, BLOCK_C: tl.constexpr):  # fmt: skip
    """The row operand's float32 values ``x * col_scale[c]`` of rows ``r .. r+15`` and columns
    ``c0 ..`` as two [16, BLOCK_C/16, 8] tensors, the first and second half of each 16-column
    block (each thread holds whole blocks: the block amax needs no exchange), zeros outside the
    tensor; with the first half's rows [16, 1, 1], columns [1, BLOCK_C/16, 8] and mask.
    ``scale_lo`` / ``scale_hi``: :func:`_row_col_scales`."""
    rows = r + tl.arange(0, STRIPE)[:, None, None]
    cols = _row_cols(c0, BLOCK_C)
    ok = (rows < r_end) & (cols < C)
    ptrs = x_ptr + rows.to(tl.int64) * stride_r + cols.to(tl.int64) * stride_c
    lo = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
    hi = tl.load(ptrs + 8 * stride_c, mask=ok, other=0.0).to(tl.float32)
    if ROW_SCALE:
        lo = lo * scale_lo
        hi = hi * scale_hi
    return lo, hi, rows, cols, ok


@triton.jit
def _to_bf16(v, HW_CVT: tl.constexpr):
    """float32 -> nearest BF16 (ties to even), kept in float32: the hardware conversion, or in
    the interpreter (whose casts truncate) :func:`round_to_bf16`'s integer arithmetic."""
    if HW_CVT:
        return v.to(tl.bfloat16).to(tl.float32)
    return round_to_bf16(v)


@triton.jit
def _col_stripe(x_ptr, stride_r, stride_c, r, r_end, offs_c, C, RHT: tl.constexpr,
                SIGNS: tl.constexpr, HW_CVT: tl.constexpr):  # fmt: skip
    """The col operand's float32 values of the 16-row block at rows ``r .. r+15`` (zeros past
    ``r_end`` or C) as a tuple of 16 [BLOCK_C] rows, each thread holding whole columns. RHT:
    ``y = (x * signs) @ H16 / 4`` rounded to BF16 (``SIGNS`` bit i set: sign -1 for row i),
    the fast Walsh-Hadamard butterfly ``[a, b] -> [a + b, a - b]`` over pairs at distance 1,
    2, 4, 8 in float32 (the CPU path's order, which sums in float64)."""
    cptr = x_ptr + offs_c.to(tl.int64) * stride_c
    cmask = offs_c < C
    zero = offs_c * 0  # the row bound as a vector compare (the interpreter's scalar one is not)
    v = ()
    for i in tl.static_range(STRIPE):
        ok = cmask & (zero + (r + i) < r_end)
        row = tl.load(cptr + tl.cast(r + i, tl.int64) * stride_r, mask=ok, other=0.0)
        row = row.to(tl.float32)
        if RHT and (SIGNS >> i) & 1:
            row = -row
        v = v + (row,)
    if RHT:
        for h in tl.static_range(4):
            nxt = ()
            for i in tl.static_range(STRIPE):
                if (i >> h) & 1:
                    nxt = nxt + (v[i - (1 << h)] - v[i],)
                else:
                    nxt = nxt + (v[i] + v[i + (1 << h)],)
            v = nxt
        out = ()
        for i in tl.static_range(STRIPE):
            out = out + (_to_bf16(v[i] * 0.25, HW_CVT),)
        v = out
    return v


@triton.jit
def _stripe_max_bits(v, FINITE: tl.constexpr):
    """Elementwise max over the 16 rows of the magnitudes' bits of ``v`` (a tuple of 16
    [BLOCK_C]); FINITE: NaN/Inf count as 0."""
    top = tl.zeros(v[0].shape, tl.int32)
    for i in tl.static_range(STRIPE):
        bits = _magnitude_bits(v[i])
        if FINITE:
            bits = tl.where(bits < 0x7F800000, bits, 0)
        top = tl.maximum(top, bits)
    return top


@triton.jit
def _half_max_bits(lo, hi, FINITE: tl.constexpr):
    """Per 16-column block [16, BLOCK_C/16] the max of the magnitudes' bits of its two halves;
    FINITE: NaN/Inf count as 0."""
    lo = _magnitude_bits(lo)
    hi = _magnitude_bits(hi)
    if FINITE:
        lo = tl.where(lo < 0x7F800000, lo, 0)
        hi = tl.where(hi < 0x7F800000, hi, 0)
    return tl.maximum(tl.max(lo, axis=2), tl.max(hi, axis=2))


@triton.jit
def _amax_rows(x_ptr, stride_r, stride_c, r0, r_end, C, c0, col_scale_ptr, scale_stride,
               ROW: tl.constexpr, ROW_SCALE: tl.constexpr, COL: tl.constexpr, RHT: tl.constexpr,
               SIGNS: tl.constexpr, HW_CVT: tl.constexpr, FINITE: tl.constexpr,
               BLOCK_C: tl.constexpr):  # fmt: skip
    """``(row, col)`` magnitude bits: the max over rows ``r0 .. r_end`` (whole 16-row stripes)
    and columns ``c0 .. c0 + BLOCK_C`` of the row and col operands' values (scalars; 0 for an
    operand not asked for). FINITE: over the finite values only."""
    offs_c = c0 + tl.arange(0, BLOCK_C)
    scale_lo, scale_hi = _row_col_scales(col_scale_ptr, scale_stride, C, c0, ROW and ROW_SCALE,
                                         BLOCK_C)  # fmt: skip
    top_row = tl.zeros([STRIPE, BLOCK_C // 16], tl.int32)
    top_col = tl.zeros([BLOCK_C], tl.int32)
    for r in range(r0, r_end, STRIPE):
        if ROW:
            lo, hi, _, _, _ = _row_halves(x_ptr, stride_r, stride_c, r, r_end, C, c0, scale_lo,
                                          scale_hi, ROW_SCALE, BLOCK_C)  # fmt: skip
            top_row = tl.maximum(top_row, _half_max_bits(lo, hi, FINITE))
        if COL:
            v = _col_stripe(x_ptr, stride_r, stride_c, r, r_end, offs_c, C, RHT, SIGNS, HW_CVT)
            top_col = tl.maximum(top_col, _stripe_max_bits(v, FINITE))
    return tl.max(tl.max(top_row, axis=1), axis=0), tl.max(top_col, axis=0)


@triton.jit
def _publish_amax(stats, top, finite_top):
    """Atomic max into ``stats[0]`` of the amax over the finite values and into ``stats[1]`` of
    the non-finite flag (1.0 when ``top``, the bits over all values, is NaN/Inf)."""
    tl.atomic_max(stats + 0, finite_top.to(tl.float32, bitcast=True))
    tl.atomic_max(stats + 1, tl.where(top >= 0x7F800000, 1.0, 0.0))


@triton.jit
def _amax_program(x_ptr, stride_r, stride_c, r0, r_end, C, c0, col_scale_ptr, scale_stride,
                  stats, ROW: tl.constexpr, ROW_SCALE: tl.constexpr, COL: tl.constexpr,
                  RHT: tl.constexpr, SIGNS: tl.constexpr, HW_CVT: tl.constexpr,
                  BLOCK_C: tl.constexpr):  # fmt: skip
    """Pass 1 for rows ``r0 .. r_end`` (whole stripes) and BLOCK_C columns: atomic max of the
    row / col operand's amax and non-finite flag into ``stats[0:2]`` / ``stats[2:4]``. Only a
    program that finds NaN/Inf reads its rows again for the max over the finite values."""
    args = (x_ptr, stride_r, stride_c, r0, r_end, C, c0, col_scale_ptr, scale_stride)
    top_row, top_col = _amax_rows(*args, ROW, ROW_SCALE, COL, RHT, SIGNS, HW_CVT, False, BLOCK_C)
    fin_row, fin_col = top_row, top_col
    if (top_row >= 0x7F800000) | (top_col >= 0x7F800000):
        fin_row, fin_col = _amax_rows(*args, ROW, ROW_SCALE, COL, RHT, SIGNS, HW_CVT, True,
                                      BLOCK_C)  # fmt: skip
    if ROW:
        _publish_amax(stats, top_row, fin_row)
    if COL:
        _publish_amax(stats + 2, top_col, fin_col)


@triton.jit
def _decode_scale(stats, decode, first):
    """``(S_enc, S_dec, non-finite flag)`` of the operand with ``stats`` (amax, flag); the first
    program writes ``S_dec`` (NaN when the operand holds NaN/Inf) to ``decode``."""
    s_enc, s_dec = global_scales(tl.load(stats + 0))
    bad = tl.load(stats + 1)
    if first:
        tl.store(decode, tl.where(bad != 0, nan_like(s_dec), s_dec))
    return s_enc, s_dec, bad


@triton.jit
def _qdq_program(x_ptr, stride_r, stride_c, r0, r_end, p0, C, c0, first, col_scale_ptr,
                 scale_stride, stats, decode, row_out, col_out, seed_ptr,
                 ROW: tl.constexpr, ROW_SCALE: tl.constexpr, ROW_SR: tl.constexpr,
                 COL: tl.constexpr, RHT: tl.constexpr, SIGNS: tl.constexpr, COL_SR: tl.constexpr,
                 HW_CVT: tl.constexpr, BLOCK_C: tl.constexpr):  # fmt: skip
    """Pass 2 for rows ``r0 .. r_end`` (whole stripes) and BLOCK_C columns: BF16 ``code *
    scale`` into ``row_out`` [R, C] (row ``r``) and ``col_out`` (row ``p0 + r - r0``; both
    row-major); ``first``: write the decode scales to ``decode[0:2]``."""
    seed_row, seed_col = _seeds(seed_ptr, ROW_SR | COL_SR)
    offs_c = c0 + tl.arange(0, BLOCK_C)
    scale_lo, scale_hi = _row_col_scales(col_scale_ptr, scale_stride, C, c0, ROW and ROW_SCALE,
                                         BLOCK_C)  # fmt: skip
    if ROW:
        s_enc_r, s_dec_r, bad_r = _decode_scale(stats, decode, first)
    if COL:
        s_enc_c, s_dec_c, bad_c = _decode_scale(stats + 2, decode + 1, first)
    for r in range(r0, r_end, STRIPE):
        if ROW:
            lo, hi, rows, cols, ok = _row_halves(
                x_ptr, stride_r, stride_c, r, r_end, C, c0, scale_lo, scale_hi, ROW_SCALE, BLOCK_C
            )
            lo = _finite(lo, bad_r)
            hi = _finite(hi, bad_r)
            bamax = tl.maximum(tl.max(tl.abs(lo), axis=2), tl.max(tl.abs(hi), axis=2))
            scale, encode = _block_scales(bamax, s_enc_r, s_dec_r)
            scale = scale[:, :, None]
            encode = encode[:, :, None]
            # one hash for the two halves' elements (int32 index: streams repeat past 2^31)
            u_lo, u_hi = _draws(seed_row, rows * C + cols, ROW_SR)
            out = row_out + rows.to(tl.int64) * C + cols
            tl.store(out, _qdq(lo, scale, encode, u_lo, ROW_SR), mask=ok)
            tl.store(out + 8, _qdq(hi, scale, encode, u_hi, ROW_SR), mask=ok)
        if COL:
            v = _col_stripe(x_ptr, stride_r, stride_c, r, r_end, offs_c, C, RHT, SIGNS, HW_CVT)
            bamax = tl.zeros([BLOCK_C], tl.float32)
            w = ()
            for i in tl.static_range(STRIPE):
                vi = _finite(v[i], bad_c)
                bamax = tl.maximum(bamax, tl.abs(vi))
                w = w + (vi,)
            scale, encode = _block_scales(bamax, s_enc_c, s_dec_c)
            out = col_out + tl.cast(p0 + r - r0, tl.int64) * C + offs_c
            for i in tl.static_range(STRIPE // 2):  # rows i and i + 8 share a hash
                u_i, u_i8 = _draws(seed_col, (r + i) * C + offs_c, COL_SR)
                q = _qdq(w[i], scale, encode, u_i, COL_SR)
                tl.store(out + i * C, q, mask=offs_c < C)
                q = _qdq(w[i + 8], scale, encode, u_i8, COL_SR)
                tl.store(out + (i + 8) * C, q, mask=offs_c < C)


@triton.jit(do_not_specialize=["R"])
def _grad_amax_kernel(
    x_ptr,
    stride_r,
    stride_c,
    R,
    C,
    col_scale_ptr,
    scale_stride,
    stats_ptr,
    ROW: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    COL: tl.constexpr,
    RHT: tl.constexpr,
    SIGNS: tl.constexpr,
    HW_CVT: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Pass 1: atomic max of each output's amax and non-finite flag into ``stats``
    (row: [0], [1]; col: [2], [3]); ``stats`` starts at zero. A program reads ROWS rows and
    BLOCK_C columns once for both operands (elementwise maxima in registers, one reduction and
    one atomic per operand)."""
    r0 = tl.program_id(0) * ROWS
    _amax_program(x_ptr, stride_r, stride_c, r0, tl.minimum(r0 + ROWS, R), C,
                  tl.program_id(1) * BLOCK_C, col_scale_ptr, scale_stride, stats_ptr, ROW,
                  ROW_SCALE, COL, RHT, SIGNS, HW_CVT, BLOCK_C)  # fmt: skip


@triton.jit(do_not_specialize=["R"])
def _grad_qdq_kernel(
    x_ptr,
    stride_r,
    stride_c,
    R,
    C,
    col_scale_ptr,
    scale_stride,
    stats_ptr,
    decode_ptr,
    row_out,
    col_out,
    seed_ptr,
    ROW: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    ROW_SR: tl.constexpr,
    COL: tl.constexpr,
    RHT: tl.constexpr,
    SIGNS: tl.constexpr,
    COL_SR: tl.constexpr,
    HW_CVT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Pass 2: BF16 ``code * scale`` of BLOCK_R rows and BLOCK_C columns into ``row_out``
    [R, C] and/or ``col_out`` [ceil(R/16)*16, C]; program (0, 0) writes the decode scales."""
    r0 = tl.program_id(0) * BLOCK_R
    first = (tl.program_id(0) == 0) & (tl.program_id(1) == 0)
    _qdq_program(x_ptr, stride_r, stride_c, r0, tl.minimum(r0 + BLOCK_R, R), r0, C,
                 tl.program_id(1) * BLOCK_C, first, col_scale_ptr, scale_stride, stats_ptr,
                 decode_ptr, row_out, col_out, seed_ptr, ROW, ROW_SCALE, ROW_SR, COL, RHT,
                 SIGNS, COL_SR, HW_CVT, BLOCK_C)  # fmt: skip


def rht_sign_mask(signs) -> int:
    """The kernels' constexpr for the RHT ``diag(signs) @ H16 / 4``: bit i set where
    ``signs[i]`` is -1 (16 values of +-1; ``minite_common.hadamard.RHT_SIGNS``)."""
    signs = [int(s) for s in signs]
    if len(signs) != STRIPE.value or any(s not in (1, -1) for s in signs):
        raise ValueError(f"rht_signs: need {STRIPE.value} values of +1/-1, got {signs}")
    return sum(1 << i for i, s in enumerate(signs) if s < 0)


def seed_tensor(seed: int | torch.Tensor, device: torch.device) -> torch.Tensor:
    """The kernels' seed argument: int64 [1] on ``device`` holding ``seed mod 2^31`` (the same
    random draws for a Python int and for a tensor of that value)."""
    if isinstance(seed, torch.Tensor):
        if seed.numel() != 1 or seed.dtype != torch.int64 or seed.device != device:
            raise ValueError(
                f"seed: need an int64 tensor of one element on {device}, got "
                f"{seed.dtype} {list(seed.shape)} on {seed.device}"
            )
        return seed.reshape(1)
    return torch.tensor([seed % 2**31], dtype=torch.int64, device=device)


def quantize_grad_operands(
    x: torch.Tensor,
    *,
    row: bool,
    row_scale: torch.Tensor | None = None,
    row_stochastic: bool = False,
    col: bool = False,
    rht_signs: tuple[int, ...] | None = None,
    col_stochastic: bool = False,
    seed: int | torch.Tensor = 0,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """``(row_values, col_values, decode)`` of the 2D tensor ``x`` [R, C] (see the module).

    ``row_values`` BF16 [R, C] (``row``), ``col_values`` BF16 [ceil(R/16)*16, C] (``col``),
    ``decode`` float32 [2]: the row and col operands' decode scales ``S_dec`` (0-d views are
    ``decode[0]``, ``decode[1]``). ``row_scale`` float32 [C] multiplies ``x`` for ``row``;
    ``seed`` feeds the stochastic rounding (row and col draw from two seeds derived from it):
    a Python int, or an int64 tensor of one element on ``x``'s device (read by the kernel, so
    a seed drawn on the device costs no host synchronization; see :func:`seed_tensor`).
    ``rht_signs``: the 16 signs of the random Hadamard transform ``diag(signs) @ H16 / 4`` to
    apply to the col operand's 16-token blocks (``minite_common.hadamard.RHT_SIGNS``), or None.
    """
    if x.dim() != 2 or x.shape[1] % 16:
        raise ValueError(f"quantize_grad_operands: need [R, C] with C % 16 == 0, got {x.shape}")
    if not (row or col):
        raise ValueError("quantize_grad_operands: ask for the row and/or col operand")
    r, c = x.shape
    r_pad = -(-r // 16) * 16
    dev = x.device
    stats = torch.zeros(6, dtype=torch.float32, device=dev)
    decode = stats[4:6]
    row_out = torch.empty(r, c, dtype=torch.bfloat16, device=dev) if row else None
    col_out = torch.empty(r_pad, c, dtype=torch.bfloat16, device=dev) if col else None
    if r == 0:
        stats[4:6] = 1.0
        return row_out, col_out, decode
    has_scale = row and row_scale is not None
    scale_arg = row_scale.float() if has_scale else stats
    scale_stride = scale_arg.stride(0) if has_scale and scale_arg.dim() else 0
    if has_scale and scale_arg.dim() and scale_arg.shape[0] != c:
        raise ValueError(
            f"quantize_grad_operands: row_scale has {scale_arg.shape[0]} values, not {c}"
        )
    flags = kernel_flags(row, col, rht_signs)
    block_c = flags["BLOCK_C"]
    amax_rows = BLOCK_R * AMAX_TILES
    _grad_amax_kernel[(triton.cdiv(r, amax_rows), triton.cdiv(c, block_c))](
        x, x.stride(0), x.stride(1), r, c, scale_arg, scale_stride, stats,
        ROW_SCALE=has_scale, ROWS=amax_rows, num_warps=4, **flags,
    )  # fmt: skip
    _grad_qdq_kernel[(triton.cdiv(r, BLOCK_R), triton.cdiv(c, block_c))](
        x, x.stride(0), x.stride(1), r, c, scale_arg, scale_stride, stats, decode,
        row_out if row else stats, col_out if col else stats,
        seed_tensor(seed, dev) if row_stochastic or col_stochastic else stats,
        ROW_SCALE=has_scale, ROW_SR=row_stochastic, COL_SR=col_stochastic,
        BLOCK_R=BLOCK_R, num_warps=4, enable_fp_fusion=False, **flags,
    )  # fmt: skip
    return row_out, col_out, decode


def kernel_flags(row: bool, col: bool, rht_signs) -> dict:
    """The operand kernels' shared constexpr arguments: operands, RHT and its sign mask, rounding
    to BF16 by the hardware conversion except in the interpreter, and the columns per program
    (4 warps: 256, so the col operand's loads are 4-byte pairs; 128 for the row operand alone,
    which then keeps half the registers: measured 59% -> 69% of copy bandwidth on the H200)."""
    rht = col and rht_signs is not None
    return dict(
        ROW=row,
        COL=col,
        RHT=rht,
        SIGNS=rht_sign_mask(rht_signs) if rht else 0,
        HW_CVT=not _INTERPRETED,
        BLOCK_C=256 if col else 128,
    )


@triton.jit
def _scale_rows_kernel(
    acc_ptr, scale_ptr, out_ptr, C, ROWS_PER_SCALE, BLOCK: tl.constexpr, BF16: tl.constexpr
):
    """``out[r, c] = out_dtype(acc[r, c] * scale[r // ROWS_PER_SCALE])``, one row per program
    along axis 0, BLOCK columns per program along axis 1. BF16: rounded by integer arithmetic
    first (the interpreter's casts truncate; on the GPU the same bits as the cast)."""
    r = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < C
    scale = tl.load(scale_ptr + r // ROWS_PER_SCALE)
    row = r.to(tl.int64) * C
    y = tl.load(acc_ptr + row + offs, mask=mask) * scale
    if BF16:
        y = round_to_bf16(y)
    tl.store(out_ptr + row + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def scale_rows(
    acc: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype, rows_per_scale: int = 0
) -> torch.Tensor:
    """``out_dtype(acc * scale[r // rows_per_scale])`` of a contiguous float32 accumulator
    [R, C] (one float32 product, one rounding: ``torch.mul``'s bits), ``scale`` float32 on the
    device: one value (0-d or [1]) for every row, else one per ``rows_per_scale`` rows. The
    backward GEMMs' epilogue in one pass at copy bandwidth (``torch.mul`` into a BF16 output
    takes its slow mixed-dtype path, about 3x slower)."""
    if acc.dtype != torch.float32 or acc.dim() != 2 or not acc.is_contiguous():
        raise ValueError(f"scale_rows: need a contiguous float32 [R, C], got {acc.dtype}")
    rows, cols = acc.shape
    scale = scale.reshape(-1).to(torch.float32)
    per = rows_per_scale or max(rows, 1)
    if scale.numel() != -(-rows // per):
        raise ValueError(f"scale_rows: {scale.numel()} scales for {rows} rows, {per} per scale")
    out = torch.empty(rows, cols, dtype=out_dtype, device=acc.device)
    if acc.numel():
        block = min(4096, triton.next_power_of_2(cols))
        grid = (rows, triton.cdiv(cols, block))
        bf16 = out_dtype == torch.bfloat16
        _scale_rows_kernel[grid](acc, scale, out, cols, per, BLOCK=block, BF16=bf16, num_warps=8)
    return out


_DECODED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def decoded_weight(w, cache: bool = True) -> torch.Tensor:
    """BF16 [N, K] ``code * f32(scale) * 2^-7`` of the NVFP4 weight ``w`` [N, K] in natural K
    order (exact; decode scales not applied), cached per weight version (``cache``: 2 bytes per
    weight element kept while ``w`` lives; else decoded anew and nothing kept). dgrad's cuBLAS
    operand: ``dX = (G @ decoded) * 2^7 * S_dec(G)``."""
    key = (w.codes.data_ptr(), w.codes._version, w.scales._version)
    cached = _DECODED.get(w) if cache else _DECODED.pop(w, None)
    if cache and cached is not None and cached[0] == key:
        return cached[1]
    rows, k = w.rows, w.cols
    streams = decode_operand(w.codes, w.scales, use_asm=not _INTERPRETED)  # [N, chunks*256]
    chunks = streams.shape[1] // CHUNK
    natural = streams.view(rows, chunks, STREAMS, CHUNK // STREAMS).transpose(2, 3)
    result = natural.reshape(rows, chunks * CHUNK)[:, :k].contiguous()
    if cache:
        _DECODED[w] = (key, result)
    return result
