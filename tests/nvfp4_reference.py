"""Independent NumPy float32 reference of miniTE's NVFP4 quantizer and W4A4 linear
(docs/contract.md sections 1-4).

Written from docs/contract.md alone (not from the library): every step is IEEE float32 arithmetic
(round to nearest even) on ``np.float32`` arrays/scalars, in the multiplication order
docs/contract.md prescribes. Nothing here uses torch's float8 cast; E4M3 and E2M1 rounding are
done by hand.

Recipe v1, per 16-element block along K (or 16x16 tile for 2D blocks):

    S_enc = min(f32(2688 / amax), FLT_MAX), 1 if that is 0, and 1 if amax == 0
    S_dec = f32(1 / S_enc)
    s     = e4m3_rne(min(f32(bamax * f32(S_enc * f32(1/6))), 448))        (no lower clamp)
    e     = min(f32(1 / f32(s * S_dec)), FLT_MAX)
    q     = e2m1_rne(clamp(f32(x * e), -6, 6)), sign bit for every strictly negative f32(x * e)
    dq    = f32(f32(q * s) * S_dec)

Non-finite inputs (library contract): non-finite elements count as 0 for amax, scales and codes,
and the decode scale of a row (amax="row") / tensor (amax="tensor") containing one is NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

F32 = np.float32
FLT_MAX = F32(np.finfo(np.float32).max)
ONE = F32(1.0)
ONE_SIXTH = ONE / F32(6.0)  # f32(1/6), computed by an f32 division
FP4_TIMES_FP8_MAX = F32(2688.0)  # 448 * 6
E4M3_MAX = F32(448.0)
E2M1_MAX = F32(6.0)
BLOCK = 16


# --------------------------------------------------------------------------------------------
# E4M3 (float8_e4m3fn): 1 sign, 4 exponent bits (bias 7), 3 mantissa bits, no inf, NaN = S.1111.111
# --------------------------------------------------------------------------------------------
def _e4m3_value(bits: int) -> float:
    sign = -1.0 if bits & 0x80 else 1.0
    exp, man = (bits >> 3) & 0xF, bits & 0x7
    if exp == 0xF and man == 0x7:
        return float("nan")
    if exp == 0:
        return sign * man * 2.0**-9  # subnormal: m/8 * 2^-6
    return sign * 2.0 ** (exp - 7) * (1.0 + man / 8.0)


# All 256 bit patterns decoded (exactly representable in f32: at most 4 significant bits).
E4M3_DECODE = np.array([_e4m3_value(b) for b in range(256)], dtype=np.float32)
# The 127 finite non-negative values in increasing order; index == bit pattern.
E4M3_POS = E4M3_DECODE[:127].copy()
assert np.all(np.diff(E4M3_POS) > 0) and E4M3_POS[-1] == E4M3_MAX
# Midpoints between neighbours; exact in f32 (at most 5 significant bits).
E4M3_MID = (E4M3_POS[:-1] + E4M3_POS[1:]) * F32(0.5)
# value * 2^9 as an integer (every E4M3 value is an integer multiple of 2^-9).
E4M3_INT = np.array(
    [int(v * 512) if np.isfinite(v) else 0 for v in E4M3_DECODE.astype(np.float64)], np.int64
)
assert np.all(E4M3_INT[:127].astype(np.float64) / 512 == E4M3_POS.astype(np.float64))


def e4m3_rne_bits(v: np.ndarray) -> np.ndarray:
    """Round non-negative f32 values in [0, 448] to E4M3, nearest, ties to even; bit patterns."""
    v = np.asarray(v)
    assert v.dtype == np.float32
    assert not np.any(np.isnan(v)) and np.all(v >= 0) and np.all(v <= E4M3_MAX)
    idx = np.searchsorted(E4M3_MID, v, side="left")  # number of midpoints strictly below v
    at_mid = (idx < E4M3_MID.size) & (E4M3_MID[np.minimum(idx, E4M3_MID.size - 1)] == v)
    # A tie sits between idx and idx+1; bit patterns of adjacent values are adjacent integers,
    # so "even mantissa" == even bit pattern.
    idx = np.where(at_mid & (idx % 2 == 1), idx + 1, idx)
    return idx.astype(np.uint8)


def e4m3_rne_bits_arith(v: np.ndarray) -> np.ndarray:
    """Second, arithmetic implementation of e4m3_rne_bits (used only to cross-check it)."""
    v = np.asarray(v)
    assert v.dtype == np.float32
    out = np.zeros(v.shape, np.uint8)
    flat_v, flat_o = v.reshape(-1), out.reshape(-1)
    for i, x in enumerate(flat_v):
        if x == 0:
            continue
        _, ex = np.frexp(x)  # x = m * 2^ex, m in [0.5, 1)
        e_unb = max(int(ex) - 1, -6)  # binade of x; subnormals share the 2^-6 binade's quantum
        quantum_exp = e_unb - 3
        n = np.rint(np.ldexp(x, -quantum_exp))  # exact scaling by 2^k, then RNE to integer
        r = np.ldexp(n, quantum_exp)  # rounded value, exact
        if r < 2.0**-6:
            flat_o[i] = int(np.ldexp(r, 9))
        else:
            _, ex2 = np.frexp(r)
            e2 = int(ex2) - 1
            man = int(np.ldexp(r, -e2) * 8) - 8
            flat_o[i] = ((e2 + 7) << 3) | man
    return out


# --------------------------------------------------------------------------------------------
# E2M1: codes 0..7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 = sign
# --------------------------------------------------------------------------------------------
E2M1_MAG = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
E2M1_MID = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
E2M1_DECODE = np.concatenate([E2M1_MAG, -E2M1_MAG]).astype(np.float32)  # code 8 -> -0.0
E2M1_TWICE_INT = np.array([0, 1, 2, 3, 4, 6, 8, 12] + [0, -1, -2, -3, -4, -6, -8, -12], np.int64)


def e2m1_codes(y: np.ndarray) -> np.ndarray:
    """E2M1 codes of f32 values already clamped to [-6, 6]: nearest, ties to the even code."""
    y = np.asarray(y)
    assert y.dtype == np.float32
    assert not np.any(np.isnan(y)) and np.all(np.abs(y) <= E2M1_MAX)
    a = np.abs(y)
    idx = np.searchsorted(E2M1_MID, a, side="left")  # midpoints strictly below |y|
    at_mid = (idx < E2M1_MID.size) & (E2M1_MID[np.minimum(idx, E2M1_MID.size - 1)] == a)
    idx = np.where(at_mid & (idx % 2 == 1), idx + 1, idx)
    sign = (y < 0).astype(np.int64)  # strictly negative; -0.0 < 0 is False -> code 0
    return (idx | (sign << 3)).astype(np.uint8)


def pack_codes(codes: np.ndarray) -> np.ndarray:
    """Element 2i in the low nibble, 2i+1 in the high nibble."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)


def unpack_codes(packed: np.ndarray) -> np.ndarray:
    packed = np.asarray(packed, np.uint8)
    out = np.empty((packed.shape[0], packed.shape[1] * 2), np.uint8)
    out[:, 0::2] = packed & 0xF
    out[:, 1::2] = packed >> 4
    return out


# --------------------------------------------------------------------------------------------
# Quantizer
# --------------------------------------------------------------------------------------------
@dataclass
class RefNVFP4:
    codes: np.ndarray  # uint8 [rows, K/2]
    scale_bits: np.ndarray  # uint8 [rows, K/16]
    decode_scale: np.ndarray  # f32 [rows] (row) or 0-d (tensor)
    amax_mode: str


def encode_scale(amax: np.ndarray) -> np.ndarray:
    """S_enc = min(f32(2688 / amax), FLT_MAX), 1 where that is 0, and 1 where amax == 0."""
    amax = np.asarray(amax)
    assert amax.dtype == np.float32
    with np.errstate(divide="ignore", over="ignore"):
        s = FP4_TIMES_FP8_MAX / np.where(amax == 0, ONE, amax)
    s = np.minimum(s, FLT_MAX)
    s = np.where(s == 0, ONE, s)
    s = np.where(amax == 0, ONE, s)
    return np.asarray(s, np.float32)


def block_amax(ax: np.ndarray, block_2d: bool) -> np.ndarray:
    """|x| max per 1x16 block, or per 16x16 tile (zero-padded rows) repeated over its rows."""
    rows, k = ax.shape
    if not block_2d:
        return ax.reshape(rows, k // BLOCK, BLOCK).max(axis=2)
    rows_p = -(-rows // BLOCK) * BLOCK
    padded = np.zeros((rows_p, k), np.float32)
    padded[:rows] = ax
    tiles = padded.reshape(rows_p // BLOCK, BLOCK, k // BLOCK, BLOCK).max(axis=(1, 3))
    return np.repeat(tiles, BLOCK, axis=0)[:rows]


def quantize(x: np.ndarray, amax: str = "row", block_2d: bool = False, global_amax=None):
    """Reference quantize_nvfp4 on an f32 [rows, K] array."""
    x = np.asarray(x)
    assert x.dtype == np.float32 and x.ndim == 2 and x.shape[1] % BLOCK == 0
    rows, k = x.shape
    finite = np.isfinite(x)
    x0 = np.where(finite, x, F32(0.0)).astype(np.float32)
    ax = np.abs(x0)
    if global_amax is not None:
        g = np.asarray(global_amax, np.float32)
        g_amax = np.broadcast_to(g, (rows,)).copy() if amax == "row" else g.reshape(())
    elif amax == "row":
        g_amax = ax.max(axis=1) if k else np.zeros(rows, np.float32)
    elif amax == "tensor":
        g_amax = np.asarray(ax.max() if ax.size else F32(0.0), np.float32)
    else:
        raise ValueError(amax)
    s_enc = encode_scale(g_amax)
    s_dec = ONE / s_enc
    c = s_enc * ONE_SIXTH  # f32(S_enc * f32(1/6))
    if amax == "row":
        s_dec_b, c_b = s_dec[:, None], c[:, None]
    else:
        s_dec_b, c_b = s_dec, c

    bamax = block_amax(ax, block_2d)
    with np.errstate(over="ignore"):  # an overflow to inf is clamped like any v > 448
        v = np.minimum(bamax * c_b, E4M3_MAX)  # f32(bamax * c), clamp max=448 only
    scale_bits = e4m3_rne_bits(v)
    s = E4M3_DECODE[scale_bits]
    with np.errstate(divide="ignore", over="ignore"):
        e = ONE / (s * s_dec_b)  # f32(1 / f32(s * S_dec)); s == 0 -> inf
    e = np.minimum(e, FLT_MAX)
    with np.errstate(over="ignore"):
        xe = x0.reshape(rows, k // BLOCK, BLOCK) * e[:, :, None]
    xe = np.clip(xe, -E2M1_MAX, E2M1_MAX)
    codes = e2m1_codes(xe.reshape(rows, k))

    dec = np.array(s_dec, np.float32)
    if amax == "row":
        dec[~finite.all(axis=1)] = np.nan
    elif not finite.all():
        dec = np.array(np.nan, np.float32)
    for arr in (s_enc, s_dec, c, v, s, e, xe, dec):
        assert np.asarray(arr).dtype == np.float32
    return RefNVFP4(pack_codes(codes), scale_bits, dec, amax)


def dequantize(codes: np.ndarray, scale_bits: np.ndarray, decode_scale: np.ndarray) -> np.ndarray:
    """f32(f32(code_value * f32(scale)) * decode_scale) as f32 [rows, K]."""
    vals = E2M1_DECODE[unpack_codes(codes)]
    s = np.repeat(E4M3_DECODE[np.asarray(scale_bits, np.uint8)], BLOCK, axis=1)
    dec = np.asarray(decode_scale, np.float32)
    dec_b = dec[:, None] if dec.ndim == 1 else dec
    out = (vals * s) * dec_b
    assert out.dtype == np.float32
    return out


# --------------------------------------------------------------------------------------------
# W4A4 linear with an exact accumulator
# --------------------------------------------------------------------------------------------
def round_scaled_int_to_f32(n: np.ndarray, exp2: int) -> np.ndarray:
    """f32 nearest-even rounding of the exact value n * 2^exp2 (n int64)."""
    n = np.asarray(n, np.int64)
    out = np.empty(n.shape, np.float32)
    small = np.abs(n) < 2**53
    # |n| < 2^53: n -> float64 and * 2^exp2 are exact, so astype(float32) is the only rounding.
    out[small] = (n[small].astype(np.float64) * 2.0**exp2).astype(np.float32)
    for idx in zip(*np.nonzero(~small), strict=True):
        out[idx] = _round_int_f32(int(n[idx]), exp2)
    return out


def _round_int_f32(n: int, exp2: int) -> np.float32:
    sign, a = (-1 if n < 0 else 1), abs(n)
    shift = max(a.bit_length() - 24, 0)
    q, r = divmod(a, 1 << shift)
    half = (1 << (shift - 1)) if shift else 0
    if shift and (r > half or (r == half and q & 1)):
        q += 1
    return np.float32(sign * q * 2.0 ** (shift + exp2))  # q <= 2^24: exact


def scaled_code_ints(codes: np.ndarray, scale_bits: np.ndarray) -> np.ndarray:
    """code_value * scale * 2^10 as exact int64 [rows, K]."""
    twice = E2M1_TWICE_INT[unpack_codes(codes)]
    s512 = np.repeat(E4M3_INT[np.asarray(scale_bits, np.uint8)], BLOCK, axis=1)
    return twice * s512


def exact_acc(a_codes, a_bits, w_codes, w_bits) -> np.ndarray:
    """acc[m, n] = exact sum_k (a_code*a_scale)*(w_code*w_scale), rounded once to f32."""
    a = scaled_code_ints(a_codes, a_bits)
    w = scaled_code_ints(w_codes, w_bits)
    bound = int(np.abs(a).max(initial=0)) * int(np.abs(w).max(initial=0)) * a.shape[1]
    assert bound < 2**62, "int64 accumulator could overflow"
    return round_scaled_int_to_f32(a @ w.T, -20)


def w4a4_linear_f32(x2d: np.ndarray, w_codes, w_bits, w_dec, bias=None) -> np.ndarray:
    """f32( f32(acc * a_dec[m]) * w_dec[n] ) + f32(bias[n]), in f32, before the output cast."""
    qa = quantize(x2d, amax="row", block_2d=False)
    acc = exact_acc(qa.codes, qa.scale_bits, w_codes, w_bits)
    w_dec = np.asarray(w_dec, np.float32)
    y = acc * qa.decode_scale[:, None]
    y = y * (w_dec[None, :] if w_dec.ndim == 1 else w_dec)
    if bias is not None:
        y = y + np.asarray(bias, np.float32)[None, :]
    assert y.dtype == np.float32
    return y


# --------------------------------------------------------------------------------------------
# Output casts (own RNE for bf16; numpy's float16 cast is IEEE RNE) and torch helpers
# --------------------------------------------------------------------------------------------
def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x, np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    r = np.where(np.isnan(x), 0x7FC0, r)
    return r.astype(np.uint16)


def f32_to_torch(x: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    x = np.ascontiguousarray(x, np.float32)
    if dtype == torch.float32:
        return torch.from_numpy(x.copy())
    if dtype == torch.bfloat16:
        return torch.from_numpy(f32_to_bf16_bits(x).view(np.int16)).view(torch.bfloat16)
    if dtype == torch.float16:
        with np.errstate(over="ignore"):  # overflow to +-inf is the IEEE result
            return torch.from_numpy(x.astype(np.float16))
    raise TypeError(dtype)


def torch_to_f32(x: torch.Tensor) -> np.ndarray:
    """Exact upcast of an f32/bf16/f16 tensor to an f32 numpy array."""
    return x.detach().to(torch.float32).cpu().numpy().astype(np.float32, copy=True)


def quantize_torch(x: torch.Tensor, amax="row", block_2d=False, global_amax=None) -> RefNVFP4:
    g = None if global_amax is None else torch_to_f32(torch.as_tensor(global_amax))
    return quantize(torch_to_f32(x), amax=amax, block_2d=block_2d, global_amax=g)


def dequantize_torch(ref: RefNVFP4, dtype: torch.dtype) -> torch.Tensor:
    return f32_to_torch(dequantize(ref.codes, ref.scale_bits, ref.decode_scale), dtype)


def lib_fields(t) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes, scale bit patterns, decode_scale) of a library NVFP4Tensor as numpy arrays."""
    codes = t.codes.detach().cpu().numpy().astype(np.uint8)
    bits = t.scales.detach().cpu().view(torch.uint8).numpy().astype(np.uint8)
    dec = t.decode_scale.detach().cpu().numpy().astype(np.float32)
    return codes, bits, dec


def w4a4_linear_ref(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Reference w4a4_linear: x [..., K] torch, w a library NVFP4Tensor [N, K]."""
    k = x.shape[-1]
    w_codes, w_bits, w_dec = lib_fields(w)
    b = None if bias is None else torch_to_f32(bias)
    y = w4a4_linear_f32(torch_to_f32(x.reshape(-1, k)), w_codes, w_bits, w_dec, b)
    return f32_to_torch(y, x.dtype).reshape(*x.shape[:-1], w_codes.shape[0])


# --------------------------------------------------------------------------------------------
# Comparison helpers
# --------------------------------------------------------------------------------------------
_INT_VIEW = {
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float8_e4m3fn: torch.uint8,
    torch.uint8: torch.uint8,
}


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor, what: str = "", nan_ok=True):
    """Bitwise equality; with nan_ok, NaN positions must match but NaN payloads may differ."""
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    got, want = got.detach().cpu().contiguous(), want.detach().cpu().contiguous()
    iv = _INT_VIEW[got.dtype]
    if nan_ok and got.dtype.is_floating_point and got.dtype != torch.float8_e4m3fn:
        gn, wn = torch.isnan(got), torch.isnan(want)
        assert torch.equal(gn, wn), f"{what}: NaN positions differ: got {got}, want {want}"
        got = torch.where(gn, torch.zeros_like(got), got)
        want = torch.where(wn, torch.zeros_like(want), want)
    gb, wb = got.view(iv), want.view(iv)
    if not torch.equal(gb, wb):
        bad = (gb != wb).nonzero()
        first = tuple(bad[0].tolist())
        raise AssertionError(
            f"{what}: {bad.shape[0]} of {gb.numel()} elements differ; first at {first}: "
            f"got {got[first].item()!r} (bits {gb[first].item():#x}), "
            f"want {want[first].item()!r} (bits {wb[first].item():#x})"
        )


def assert_ref_equal(t, ref: RefNVFP4, what: str = ""):
    """The library NVFP4Tensor t has exactly the reference codes, scales and decode_scale."""
    assert t.codes.dtype == torch.uint8
    assert t.scales.dtype == torch.float8_e4m3fn
    assert t.decode_scale.dtype == torch.float32
    assert_bits_equal(t.codes, torch.from_numpy(ref.codes), f"{what} codes")
    assert_bits_equal(
        t.scales.view(torch.uint8), torch.from_numpy(ref.scale_bits), f"{what} scales"
    )
    assert_bits_equal(t.decode_scale, torch.from_numpy(ref.decode_scale), f"{what} decode_scale")
