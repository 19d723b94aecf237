"""Property-based tests of the NVFP4 quantizer (recipe v1, docs/contract.md sections 1-3) against
the independent reference in tests/nvfp4_reference.py, plus algebraic properties the contract
implies.
"""

from __future__ import annotations

import numpy as np
import nvfp4_reference as ref
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from minite_common import dequantize_nvfp4, quantize_nvfp4, w4a4_linear

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Binary exponent ranges of generated magnitudes: normal numbers, far from overflow, so that the
# algebraic properties below hold exactly (see each test). f16: its normal range.
EXP_RANGE = {torch.float32: (-60, 60), torch.bfloat16: (-60, 60), torch.float16: (-14, 14)}
SETTINGS = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=False,
)


def _signed_pow2_element(lo: int, hi: int):
    """+-m * 2^e with m in [1, 2) (f32), e in [lo, hi], or +-0."""
    mant = st.floats(1.0, 2.0, exclude_max=True, width=32)
    nonzero = st.builds(
        lambda m, e, neg: float(np.float32(-m if neg else m) * np.float32(2.0**e)),
        mant,
        st.integers(lo, hi),
        st.booleans(),
    )
    return st.one_of(st.sampled_from([0.0, -0.0]), nonzero, nonzero, nonzero)


@st.composite
def inputs(draw, dtype=None, wide=False, nonfinite=False, max_rows=20, max_blocks=4):
    """A 2D tensor [rows, 16*blocks] of the given (or a drawn) dtype.

    wide=False: finite values +-m*2^e (e in EXP_RANGE[dtype]) or zero.
    wide=True: any float32 (subnormals, values near FLT_MAX), then cast to the dtype.
    nonfinite: some NaN / +-Inf elements and rows may be injected.
    """
    dtype = draw(st.sampled_from(DTYPES)) if dtype is None else dtype
    lo, hi = EXP_RANGE[dtype]
    rows = draw(st.integers(1, max_rows))
    k = 16 * draw(st.integers(1, max_blocks))
    if rows * k <= 256 and draw(st.booleans()):
        if wide:
            elem = st.floats(width=32, allow_nan=False, allow_infinity=False)
        else:
            elem = _signed_pow2_element(lo, hi)
        x = draw(hnp.arrays(np.float32, (rows, k), elements=elem))
    else:
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        e_lo = draw(st.integers(lo, hi))
        e_hi = draw(st.integers(e_lo, hi))
        blk_e = rng.integers(e_lo, e_hi + 1, (rows, k // 16, 1))
        spread = draw(st.integers(0, 12))  # in-block dynamic range, in binary orders
        e = np.maximum(blk_e - rng.integers(0, spread + 1, (rows, k // 16, 16)), lo)
        m = rng.uniform(1, 2, e.shape) * rng.choice([-1.0, 1.0], e.shape)
        x = np.ldexp(m, e).reshape(rows, k).astype(np.float32)
        zero_frac = draw(st.sampled_from([0.0, 0.05, 0.5]))
        x[rng.random(x.shape) < zero_frac] = 0.0
        if wide:
            x = (x * np.float32(2.0 ** draw(st.integers(-80, 60)))).astype(np.float32)
    if nonfinite:
        spots = draw(
            st.lists(
                st.tuples(
                    st.integers(0, rows - 1),
                    st.integers(-1, k - 1),  # -1: the whole row
                    st.sampled_from([np.nan, np.inf, -np.inf]),
                ),
                max_size=4,
            )
        )
        for r, c, v in spots:
            if c < 0:
                x[r, :] = v
            else:
                x[r, c] = v
    with np.errstate(over="ignore"):
        return torch.from_numpy(x).to(dtype)


# 2D blocks with a per-row amax are not pinned by docs/contract.md: only used by the properties that
# hold under any reading of it (negation, power-of-two scaling).
AMAX_BLOCK = st.sampled_from([("row", False), ("tensor", False), ("tensor", True)])


@settings(max_examples=150, **SETTINGS)
@given(x=inputs(wide=True, nonfinite=True), ab=AMAX_BLOCK)
def test_quantize_matches_reference(x, ab):
    amax, block_2d = ab
    t = quantize_nvfp4(x, amax=amax, block_2d=block_2d)
    ref.assert_ref_equal(t, ref.quantize_torch(x, amax, block_2d))


@settings(max_examples=60, **SETTINGS)
@given(x=inputs(), ab=AMAX_BLOCK, data=st.data())
def test_quantize_with_global_amax_matches_reference(x, ab, data):
    amax, block_2d = ab
    shape = (x.shape[0],) if amax == "row" else ()
    g = data.draw(
        hnp.arrays(np.float32, shape, elements=st.floats(0, float(np.float32(1e30)), width=32))
    )
    g = torch.from_numpy(np.asarray(g, np.float32))
    t = quantize_nvfp4(x, amax=amax, block_2d=block_2d, global_amax=g)
    ref.assert_ref_equal(t, ref.quantize_torch(x, amax, block_2d, global_amax=g))


@settings(max_examples=60, **SETTINGS)
@given(x=inputs(wide=True, nonfinite=True), out=st.sampled_from(DTYPES))
def test_dequantize_matches_reference(x, out):
    for amax in ["row", "tensor"]:
        t = quantize_nvfp4(x, amax=amax)
        codes, bits, dec = ref.lib_fields(t)
        want = ref.f32_to_torch(ref.dequantize(codes, bits, dec), out)
        got = dequantize_nvfp4(t, out)
        zero = torch.zeros((), dtype=out)
        ref.assert_bits_equal(got + zero, want + zero, "dequantized (sign of zero ignored)")


def _nibble_xor_mask(nonzero: np.ndarray) -> np.ndarray:
    m = nonzero.astype(np.uint8) * 8
    return (m[:, 0::2] | (m[:, 1::2] << 4)).astype(np.uint8)


@settings(max_examples=80, **SETTINGS)
@given(x=inputs(), ab=AMAX_BLOCK)
def test_negation_flips_exactly_the_sign_bits(x, ab):
    """q(-x) = q(x) with bit 3 flipped for every nonzero element: |f32(x*e)| is symmetric, and
    a nonzero x gives a nonzero x*e here (|x|/amax >= 2^-121, so |x*e| >= ~6*2^-121 is normal),
    so small values keep their sign as code 0 / code 8. Exact zeros of either sign give code 0."""
    amax, block_2d = ab
    a = quantize_nvfp4(x, amax=amax, block_2d=block_2d)
    b = quantize_nvfp4(-x, amax=amax, block_2d=block_2d)
    mask = torch.from_numpy(_nibble_xor_mask(ref.torch_to_f32(x) != 0))
    ref.assert_bits_equal(b.codes, a.codes ^ mask, "codes of -x")
    ref.assert_bits_equal(b.scales.view(torch.uint8), a.scales.view(torch.uint8), "scales")
    ref.assert_bits_equal(b.decode_scale, a.decode_scale, "decode_scale")


def _block_max_code(t, block_2d: bool) -> np.ndarray:
    """max |E2M1 value| per 1x16 block (or per 16x16 tile, repeated over its rows)."""
    mag = np.abs(ref.E2M1_DECODE[ref.unpack_codes(t.codes.numpy())])
    return ref.block_amax(mag, block_2d)


@settings(max_examples=80, **SETTINGS)
@given(x=inputs(), block_2d=st.booleans())
def test_requantizing_dequantized_values_with_same_global_amax(x, block_2d):
    """Quantize, dequantize to f32, quantize again with the original amax (tensor amax).

    What the contract implies (S_enc and S_dec are unchanged; values are normal floats):
    * a block whose scale s is a normal E4M3 number always contains a +-6 code: s = rne(v) is
      within v/16 of v, so its max element has |x*e| ~ 6*v/s >= 6*16/17 > 5;
    * a block with s > 0 and a +-6 code: its new amax is f32(f32(6s)*S_dec), so the new
      v = s*(1 + a few 2^-24) rounds back to s, and every y*e = q*(1 + a few 2^-24) rounds back to
      q; except code 8 (-0), which dequantizes to a zero and comes back as code 0;
    * a block with s = 0 dequantizes to zeros: scale 0 and codes 0 again.
    Blocks with a subnormal s and no +-6 code may legitimately get another scale: not asserted.
    """
    amax = x.float().abs().max()
    a = quantize_nvfp4(x, amax="tensor", block_2d=block_2d)
    y = dequantize_nvfp4(a, torch.float32)
    b = quantize_nvfp4(y, amax="tensor", block_2d=block_2d, global_amax=amax)
    ref.assert_bits_equal(b.decode_scale, a.decode_scale, "decode_scale")

    sa = a.scales.view(torch.uint8).numpy()
    sb = b.scales.view(torch.uint8).numpy()
    qmax = _block_max_code(a, block_2d)
    assert np.all(qmax[sa >= 8] == 6), "a block with a normal E4M3 scale has no +-6 code"

    ca, cb = ref.unpack_codes(a.codes.numpy()), ref.unpack_codes(b.codes.numpy())
    ca = np.where(ca == 8, 0, ca)
    full = np.repeat((sa > 0) & (qmax == 6), 16, axis=1)
    zero = np.repeat(sa == 0, 16, axis=1)
    assert np.array_equal(sb[(sa > 0) & (qmax == 6)], sa[(sa > 0) & (qmax == 6)])
    assert np.all(sb[sa == 0] == 0)
    assert np.array_equal(cb[full], ca[full]), "codes changed in a block with a full-range code"
    assert np.all(cb[zero] == 0)


@settings(max_examples=80, **SETTINGS)
@given(x=inputs(), ab=AMAX_BLOCK, data=st.data())
def test_power_of_two_scaling(x, ab, data):
    """x -> x * 2^j: S_enc, f32(S_enc/6-ish) and S_dec scale exactly by 2^-j / 2^j, bamax*c and
    x*e are the same real products, so scales and codes are unchanged and decode_scale is
    multiplied by 2^j exactly, as long as every intermediate is a normal float (amax and the
    scaled amax in [2^-80, 2^80], every nonzero element normal before and after). Exception:
    blocks whose scale is 0 use e = FLT_MAX (not scaled), so their codes are not compared; rows
    of zeros keep S_enc = 1 (decode_scale 1)."""
    amax, block_2d = ab
    xf = ref.torch_to_f32(x)
    nz = np.abs(xf[xf != 0])
    assume(nz.size > 0)
    _, e_min = np.frexp(nz.min())
    _, e_max = np.frexp(nz.max())
    lo_dt, hi_dt = EXP_RANGE[x.dtype]
    row_amax = np.abs(xf).max(axis=1)
    # A zero row keeps S_enc = 1 while its tile's amax scales: not scale-free.
    _, e_rmin = np.frexp(row_amax[row_amax > 0].min())
    j_lo = max(lo_dt - (int(e_min) - 1), -80 - (int(e_rmin) - 1))
    j_hi = min(hi_dt - int(e_max), 80 - int(e_max))
    assume(j_lo <= j_hi)
    j = data.draw(st.integers(j_lo, j_hi))
    xs = torch.from_numpy(np.ldexp(xf, j).astype(np.float32)).to(x.dtype)
    assert torch.equal(xs.float(), torch.from_numpy(np.ldexp(xf, j).astype(np.float32)))

    a = quantize_nvfp4(x, amax=amax, block_2d=block_2d)
    b = quantize_nvfp4(xs, amax=amax, block_2d=block_2d)
    sa = a.scales.view(torch.uint8).numpy()
    ref.assert_bits_equal(b.scales.view(torch.uint8), a.scales.view(torch.uint8), "scales")
    live = np.repeat(sa > 0, 16, axis=1)
    ca, cb = ref.unpack_codes(a.codes.numpy()), ref.unpack_codes(b.codes.numpy())
    assert np.array_equal(ca[live], cb[live]), "codes changed under scaling by 2^j"
    dec = a.decode_scale.numpy()
    if amax == "row":
        want = np.where(row_amax == 0, np.float32(1), np.ldexp(dec, j)).astype(np.float32)
    else:
        want = np.asarray(np.ldexp(dec, j), np.float32)
    ref.assert_bits_equal(b.decode_scale, torch.from_numpy(want), "decode_scale * 2^j")


@settings(max_examples=60, **SETTINGS)
@given(x=inputs(), ab=AMAX_BLOCK)
def test_dequantization_error_bound(x, ab):
    """|x - dq| <= D + 6U*max(v/16, 2^-10) (+ 2^-20 relative), D = s*S_dec the block's decode
    scale, U = S_dec, v = bamax/(6U); derivation in test_nvfp4_contract.test_dequantize_error_bound.
    """
    amax, block_2d = ab
    t = quantize_nvfp4(x, amax=amax, block_2d=block_2d)
    x64 = x.double()
    dq = dequantize_nvfp4(t, torch.float32).double()
    u = t.decode_scale.double()
    u = u.reshape(-1, 1) if amax == "row" else u
    s = torch.from_numpy(ref.E4M3_DECODE[t.scales.view(torch.uint8).numpy()]).double()
    d = s.repeat_interleave(16, dim=1) * u
    bamax = torch.from_numpy(ref.block_amax(np.abs(ref.torch_to_f32(x)), block_2d)).double()
    v = bamax.repeat_interleave(16, dim=1) / (6 * u)
    bound = d + 6 * u * torch.maximum(v / 16, torch.tensor(2.0**-10))
    bound = bound * (1 + 2.0**-20) + 2.0**-20 * (x64.abs() + dq.abs())
    assert torch.all((x64 - dq).abs() <= bound)


@settings(max_examples=40, **SETTINGS)
@given(
    x=inputs(dtype=torch.bfloat16, max_rows=12, max_blocks=3),
    wseed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 24),
    data=st.data(),
)
def test_w4a4_linear_exact_and_row_independent(x, wseed, n, data):
    k = x.shape[1]
    rng = np.random.default_rng(wseed)
    w = torch.from_numpy((rng.standard_normal((n, k)) * 0.05).astype(np.float32))
    wq = quantize_nvfp4(w.to(torch.bfloat16), amax="tensor", block_2d=True)
    y = w4a4_linear(x, wq)
    zero = torch.zeros((), dtype=y.dtype)
    ref.assert_bits_equal(y + zero, ref.w4a4_linear_ref(x, wq) + zero, "w4a4 vs exact ref")
    i = data.draw(st.integers(0, x.shape[0] - 1))
    ref.assert_bits_equal(w4a4_linear(x[i : i + 1], wq), y[i : i + 1], f"row {i} alone")
