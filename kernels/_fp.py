"""Bit-exact float helpers shared by the NVFP4 kernels (Triton ``@jit`` functions).

Conversions are written with integer and exact float32 arithmetic, so they give the same bits on
every GPU and in Triton's CPU interpreter (whose native float8 casts do not round to nearest even).
"""

from __future__ import annotations

import triton
import triton.language as tl

FLT_MAX = tl.constexpr(3.4028234663852886e38)
INF = tl.constexpr(float("inf"))
#: float32(1/6), written as the exact double of that float32.
SIXTH_F32 = tl.constexpr(0.1666666716337204)


@triton.jit
def nan_like(x):
    """A float32 NaN tensor of ``x``'s shape (a NaN constexpr global would never equal itself)."""
    return tl.full(x.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def f32_to_e4m3_rne(v):
    """Nonnegative float32 in [0, 448] (or NaN) -> E4M3 byte (int32), round to nearest even."""
    bits = v.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - (120 << 3)
    # Below 2^-6 the E4M3 step is 2^-9: v * 2^9 is exact, and adding 2^23 rounds it to an integer
    # with round-to-nearest-even; the result's low bits hold that integer (8 means 2^-6, code 8).
    subnormal = (v * 512.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
    code = tl.where(v < 0.015625, subnormal, normal)
    return tl.where(v != v, 0x7F, code)


@triton.jit
def e4m3_to_f32(code):
    """E4M3 byte (any integer type, sign bit ignored) -> its exact float32 value (0x7F: NaN)."""
    c = code.to(tl.int32) & 0x7F
    exponent = c >> 3
    mantissa = c & 7
    normal = ((exponent + 120) << 23 | mantissa << 20).to(tl.float32, bitcast=True)
    subnormal = mantissa.to(tl.float32) * 0.001953125
    value = tl.where(exponent == 0, subnormal, normal)
    return tl.where(c == 0x7F, nan_like(value), value)


@triton.jit
def global_scales(amax):
    """``S_enc = min(2688 / amax, FLT_MAX)`` (1 where amax or the result is 0) and
    ``S_dec = 1 / S_enc``, IEEE divisions, NaN propagated (the contract's global scales)."""
    s_enc = tl.minimum(
        tl.math.div_rn(tl.full(amax.shape, 2688.0, tl.float32), amax),
        FLT_MAX,
        propagate_nan=tl.PropagateNan.ALL,
    )
    s_enc = tl.where((amax == 0) | (s_enc == 0), 1.0, s_enc)
    s_dec = tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), s_enc)
    return s_enc, s_dec


@triton.jit
def round_to_bf16(v):
    """float32 -> the nearest BF16 value (ties to even), kept in float32; integer arithmetic, so
    the interpreter (whose casts truncate) gives the GPU's bits. Inf stays Inf; NaN is passed
    through (the GPU's NaN, bits 0x7FFFFFFF, would carry into the sign bit: -0.0)."""
    bits = v.to(tl.int32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    return tl.where(v != v, v, rounded)
