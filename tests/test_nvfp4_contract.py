"""Contract tests of miniTE's NVFP4 quantizer (docs/contract.md sections 1-3) against an independent
NumPy-float32 reference (tests/nvfp4_reference.py) and hand-computed values.

Codes, block scales and decode scales are compared bit for bit; dequantized values and W4A4
outputs are compared bit for bit up to the sign of zero and NaN payloads.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import nvfp4_reference as ref
import pytest
import torch

from minite_common import (
    DEFAULT_RECIPE,
    NVFP4Recipe,
    NVFP4Tensor,
    dequantize_nvfp4,
    quantize_nvfp4,
    w4a4_linear,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["f32", "bf16", "f16"]
F32 = np.float32
# 2D blocks with a per-row amax are not pinned by docs/contract.md: see test_block_2d_with_row_amax.
AMAX_BLOCK = [("row", False), ("tensor", False), ("tensor", True)]
AMAX_BLOCK_IDS = ["row-1x16", "tensor-1x16", "tensor-16x16"]


def _rng(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _to_torch(x: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """An input tensor of the given dtype (inputs may be made with torch's casts)."""
    x = np.asarray(x, np.float32)
    if dtype == torch.float16:  # keep finite values finite (non-finite ones stay as they are)
        x = np.where(np.isfinite(x), np.clip(x, -60000, 60000), x).astype(np.float32)
    return torch.from_numpy(x.copy()).to(dtype)


def _make(kind: str, rows: int, k: int, rng: np.random.Generator, scale: float = 1.0):
    """Random f32 inputs of several shapes of distribution."""
    if kind == "normal":
        x = rng.standard_normal((rows, k)) * scale
    elif kind == "heavy":  # Student-t, df=1.5: rare huge outliers
        x = rng.standard_t(1.5, (rows, k)) * scale
    elif kind == "blocks":  # every 16-block its own magnitude, 1e-6 .. 1e6, some zero blocks
        mag = 10.0 ** rng.uniform(-6, 6, (rows, k // 16, 1))
        mag[rng.random(mag.shape) < 0.1] = 0.0
        x = (rng.standard_normal((rows, k // 16, 16)) * mag).reshape(rows, k)
    elif kind == "logu":  # every element its own magnitude, 1e-6 .. 1e6
        x = rng.choice([-1.0, 1.0], (rows, k)) * 10.0 ** rng.uniform(-6, 6, (rows, k))
    else:
        raise ValueError(kind)
    x = x.astype(np.float32)
    zeros = rng.random(x.shape) < 0.05
    x[zeros] = rng.choice(np.array([0.0, -0.0], np.float32), zeros.sum())
    return x


def _norm_zero(t: torch.Tensor) -> torch.Tensor:
    """-0.0 -> +0.0 (the sign of a zero output is not part of the contract)."""
    return t + torch.zeros((), dtype=t.dtype)


def _assert_values_equal(got: torch.Tensor, want: torch.Tensor, what: str = ""):
    ref.assert_bits_equal(_norm_zero(got), _norm_zero(want), what)


def _lib_dequant_ref(t: NVFP4Tensor, dtype: torch.dtype) -> torch.Tensor:
    codes, bits, dec = ref.lib_fields(t)
    return ref.f32_to_torch(ref.dequantize(codes, bits, dec), dtype)


# --------------------------------------------------------------------------------------------
# The reference itself (so that a failure below points at the library, not at the reference)
# --------------------------------------------------------------------------------------------
def test_reference_e4m3_rounding_is_rne():
    rng = _rng("e4m3")
    mids = ref.E4M3_MID
    v = np.concatenate(
        [
            ref.E4M3_POS,
            mids,
            np.nextafter(mids, F32(0)),
            np.nextafter(mids, F32(1000)),
            rng.uniform(0, 448, 20000).astype(np.float32),
            (2.0 ** rng.uniform(-40, -5, 5000)).astype(np.float32),
        ]
    ).astype(np.float32)
    v = np.minimum(v, F32(448))
    bits = ref.e4m3_rne_bits(v)
    assert np.array_equal(bits, ref.e4m3_rne_bits_arith(v))
    # A sanity check of the reference against torch's (RNE) cast; the reference never uses it.
    torch_bits = torch.from_numpy(v).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(bits, torch_bits)
    # Ties to even, hand-checked: subnormals, zero, normals, top of the range.
    hand = {0.5 * 2**-9: 0, 1.5 * 2**-9: 2, 2.5 * 2**-9: 2, 17.0: 88, 19.0: 90, 432.0: 126}
    for value, want in hand.items():
        assert ref.e4m3_rne_bits(np.array([value], np.float32))[0] == want, value


def test_reference_e2m1_rounding():
    y = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -5.0, -0.0, 0.0, -6.0])
    got = ref.e2m1_codes(y.astype(np.float32))
    assert got.tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 8, 10, 14, 0, 0, 15]
    assert ref.pack_codes(np.array([[1, 2, 15, 0]], np.uint8)).tolist() == [[0x21, 0x0F]]


# --------------------------------------------------------------------------------------------
# Quantizer versus the reference, random inputs
# --------------------------------------------------------------------------------------------
KINDS_SCALES = [
    ("normal", 1.0),
    ("normal", 1e-6),
    ("normal", 1e6),
    ("heavy", 1e-3),
    ("heavy", 1e3),
    ("blocks", 1.0),
    ("logu", 1.0),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(("amax", "block_2d"), AMAX_BLOCK, ids=AMAX_BLOCK_IDS)
def test_quantize_random_matches_reference(dtype, amax, block_2d):
    for rows, k in [(37, 128), (48, 64), (1, 16)]:
        for kind, scale in KINDS_SCALES:
            rng = _rng(kind, scale, rows, k, str(dtype), amax, block_2d)
            x = _to_torch(_make(kind, rows, k, rng, scale), dtype)
            t = quantize_nvfp4(x, amax=amax, block_2d=block_2d)
            what = f"{kind}*{scale} {rows}x{k}"
            ref.assert_ref_equal(t, ref.quantize_torch(x, amax, block_2d), what)
            assert t.shape == torch.Size((rows, k)) and t.dtype == dtype
            assert t.codes.shape == (rows, k // 2) and t.scales.shape == (rows, k // 16)
            assert t.decode_scale.shape == ((rows,) if amax == "row" else ())


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_block_2d_with_row_amax_is_refused(dtype):
    """A 16x16 tile needs one global scale (weights use a tensor amax): row amax is refused."""
    x = _to_torch(_make("normal", 32, 64, _rng("2d-row", str(dtype)), 1.0), dtype)
    with pytest.raises(ValueError, match="amax='tensor'"):
        quantize_nvfp4(x, amax="row", block_2d=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("amax", ["row", "tensor"])
def test_quantize_extreme_magnitudes_match_reference(dtype, amax):
    """Denormal inputs, amax so small that S_enc saturates at FLT_MAX (denormal S_dec), huge
    values near FLT_MAX."""
    rng = _rng("extreme", str(dtype), amax)
    for mag in [1e-44, 1e-40, 1e-38, 1e-36, 1e-30, 1e30, 1e36, 3e38]:
        x = np.clip(_make("normal", 8, 64, rng, 1.0), -1.1, 1.1) * F32(mag)
        xt = _to_torch(x, dtype)
        for block_2d in [False, True] if amax == "tensor" else [False]:
            t = quantize_nvfp4(xt, amax=amax, block_2d=block_2d)
            ref.assert_ref_equal(t, ref.quantize_torch(xt, amax, block_2d), f"mag {mag}")
    # Mixed: one row near FLT_MAX, one row of denormals, in one tensor.
    x = np.zeros((2, 32), np.float32)
    x[0, :16] = 3e38
    x[0, 16] = -1.0
    x[1, :] = np.float32(1e-45) * np.arange(32, dtype=np.float32)
    xt = _to_torch(x, torch.float32)
    t = quantize_nvfp4(xt, amax=amax)
    ref.assert_ref_equal(t, ref.quantize_torch(xt, amax), "mixed extremes")


# --------------------------------------------------------------------------------------------
# Edge cases
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(("amax", "block_2d"), AMAX_BLOCK, ids=AMAX_BLOCK_IDS)
def test_all_zero_and_negative_zero(dtype, amax, block_2d):
    for fill in [0.0, -0.0]:
        x = torch.full((18, 32), fill, dtype=dtype)
        t = quantize_nvfp4(x, amax=amax, block_2d=block_2d)
        # amax = 0 -> S_enc = 1 -> S_dec = 1; every scale 0; every code 0 (exact +-0 -> code 0).
        assert torch.equal(t.codes, torch.zeros(18, 16, dtype=torch.uint8))
        assert torch.equal(t.scales.view(torch.uint8), torch.zeros(18, 2, dtype=torch.uint8))
        want_dec = torch.ones(18) if amax == "row" else torch.tensor(1.0)
        ref.assert_bits_equal(t.decode_scale, want_dec, "decode_scale")
        ref.assert_ref_equal(t, ref.quantize_torch(x, amax, block_2d))
        dq = dequantize_nvfp4(t)
        assert dq.dtype == dtype and torch.equal(dq, torch.zeros(18, 32, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_zero_blocks_and_negative_zero_in_nonzero_rows(dtype):
    x = _make("normal", 5, 64, _rng("zero-blocks"))
    x[:, 16:32] = 0.0
    x[1, 32:48] = -0.0
    x[2, ::3] = -0.0
    xt = _to_torch(x, dtype)
    for amax in ["row", "tensor"]:
        t = quantize_nvfp4(xt, amax=amax)
        ref.assert_ref_equal(t, ref.quantize_torch(xt, amax), amax)
        codes = ref.unpack_codes(t.codes.numpy())
        assert np.all(t.scales.view(torch.uint8).numpy()[:, 1] == 0)
        assert np.all(codes[:, 16:32] == 0) and np.all(codes[1, 32:48] == 0)
        assert np.all(codes[2, ::3] == 0)  # -0.0 gives code 0, not 8


# Row amax 336 gives S_enc = f32(2688/336) = 8 and S_dec = 1/8 exactly, and
# f32(S_enc * f32(1/6)) = 8 * f32(1/6) = 1.33333337306976318359375. A block whose amax is 1.5
# then gets v = f32(1.5 * 1.3333333731) = 2.0, s = 2 and e = f32(1 / (2 * 1/8)) = 4 exactly, so
# x * e = 4 * x exactly and the E2M1 ties can be hit on purpose.
TIE_BLOCK = [0.0625, 0.1875, 0.3125, 0.4375, 0.625, 0.875, 1.25]  # * 4 = 0.25 ... 5 (ties)


def _tie_row() -> np.ndarray:
    row = [336.0] + [0.0] * 15 + [1.5] + TIE_BLOCK + [-v for v in TIE_BLOCK] + [-0.0]
    return np.array([row], np.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("amax", ["row", "tensor"])
def test_hand_known_codes_ties_and_nibble_order(dtype, amax):
    x = _to_torch(_tie_row(), dtype)
    t = quantize_nvfp4(x, amax=amax)
    # x*e = 6, .25, .75, 1.25, 1.75, 2.5, 3.5, 5, -.25, ..., -5, -0
    # codes  7,  0,   2,    2,    4,   4,   6, 6,   8, 10, 10, 12, 12, 14, 14, 0
    want_codes = [0x07, 0, 0, 0, 0, 0, 0, 0, 0x07, 0x22, 0x44, 0x66, 0xA8, 0xCA, 0xEC, 0x0E]
    assert t.codes.tolist() == [want_codes]
    # 336: v = f32(336 * 1.3333333731) > 448 -> clamped -> 448 = 0x7E; 1.5 -> 2.0 = 0x40
    assert t.scales.view(torch.uint8).tolist() == [[0x7E, 0x40]]
    assert t.decode_scale.reshape(-1).tolist() == [0.125]
    dq = dequantize_nvfp4(t)
    q = [1.5, 0, 0.25, 0.25, 0.5, 0.5, 1, 1]
    want = [336.0] + [0.0] * 15 + q + [0.0] + [-v for v in q[2:]] + [0.0]
    _assert_values_equal(dq, torch.tensor([want], dtype=dtype), "dequantized ties")
    ref.assert_ref_equal(t, ref.quantize_torch(x, amax))


def test_near_ties_round_to_nearest():
    up = [np.nextafter(F32(v), F32(10)) for v in TIE_BLOCK]
    down = [np.nextafter(F32(v), F32(0)) for v in TIE_BLOCK]
    block = [1.5, up[0], down[1], up[1], down[2], up[2], down[3], up[3], down[4], up[4]]
    block += [down[5], up[5], down[6], up[6], -up[0], -down[0]]
    x = np.array([[336.0] + [0.0] * 15 + block], np.float32)
    t = quantize_nvfp4(torch.from_numpy(x))
    codes = ref.unpack_codes(t.codes.numpy())[0, 16:]
    # -(0.25 - ulp) rounds to zero but is strictly negative: code 8; -(0.25 + ulp): code 9
    assert codes.tolist() == [7, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 9, 8]


def test_nibble_order_on_grid_values():
    # amax 6: S_enc = 448, the block scale saturates at 448 and e = f32(1/f32(448*f32(1/448)))
    # is 1 up to an ulp, so every on-grid value keeps its own code.
    row = [6, 0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -1, -1.5, -2, -3, -4, -6, 0]
    for dtype in DTYPES:
        t = quantize_nvfp4(torch.tensor([row], dtype=dtype))
        assert t.codes.tolist() == [[0x17, 0x32, 0x54, 0x76, 0xA9, 0xCB, 0xED, 0x0F]]
        assert t.scales.view(torch.uint8).tolist() == [[0x7E]]


# Block amaxes (row amax 336, so v = f32(bamax * 1.3333333731)) and their hand-derived E4M3 scale
# bits and the code of the block's max element.
SCALE_CASES = [
    (336.0, 0x7E, 7),  # v > 448: saturates at 448
    (1.5, 0x40, 7),  # v = 2
    (12.75, 88, 7),  # v = 17, tie between 16 and 18 -> 16 (even mantissa); 12.75*0.5 -> 6
    (14.25, 90, 7),  # v = 19, tie between 18 and 20 -> 20; 14.25 * 0.4 = 5.7 -> 6
    (2.25 * 2**-9, 3, 7),  # v = 3 * 2^-9: subnormal E4M3
    (1.125 * 2**-9, 2, 6),  # v = 1.5 * 2^-9: subnormal tie -> 2 * 2^-9; x*e = 4.5 -> 4
    (0.375 * 2**-9, 0, 7),  # v = 0.5 * 2^-9: tie between 0 and 2^-9 -> 0: zero scale
    (2.0**-12, 0, 7),  # v < 2^-10: zero scale; e = FLT_MAX so the element saturates to 6
    (0.0, 0, 0),  # all-zero block
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_hand_known_scales_saturated_subnormal_zero(dtype):
    k = 16 * len(SCALE_CASES)
    x = np.zeros((2, k), np.float32)
    for j, (bamax, _, _) in enumerate(SCALE_CASES):
        x[0, 16 * j] = bamax
        x[1, 16 * j + 3] = -bamax
    x[1, 16 * 7 + 5] = 2.0**-13  # zero-scale block: small nonzero elements saturate too
    xt = _to_torch(x, dtype)
    for amax in ["row", "tensor"]:
        t = quantize_nvfp4(xt, amax=amax)
        bits = t.scales.view(torch.uint8)
        want_bits = [b for _, b, _ in SCALE_CASES]
        assert bits.tolist() == [want_bits, want_bits], amax
        codes = ref.unpack_codes(t.codes.numpy())
        want_pos = [c for _, _, c in SCALE_CASES]
        assert codes[0, 0::16].tolist() == want_pos
        assert codes[1, 3::16].tolist() == [c | 8 if c else 0 for c in want_pos]
        assert codes[1, 16 * 7 + 5] == 7
        ref.assert_ref_equal(t, ref.quantize_torch(xt, amax), amax)
        # Zero-scale blocks dequantize to zero although their codes are +-6.
        dq = dequantize_nvfp4(t, torch.float32)
        assert torch.all(dq[:, 16 * 6 : 16 * 8] == 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_block_2d_scale_layout_with_partial_tile(dtype):
    x = np.zeros((20, 32), np.float32)
    x[0, 0] = 336.0  # tile (0, 0): sets the tensor amax; scale 448
    x[3, 2] = 28.0  # 28 * f32(1/56) ~ 0.5 -> code 1
    x[5, 16] = 1.5  # tile (0, 1): scale 2
    x[16, 0] = 1.0  # tile (1, 0), rows 16..19 only (zero-padded): amax 12.75 -> scale 16
    x[17, 1] = 12.75
    xt = _to_torch(x, dtype)
    t = quantize_nvfp4(xt, amax="tensor", block_2d=True)
    want = [[0x7E, 0x40]] * 16 + [[88, 0]] * 4
    assert t.scales.view(torch.uint8).tolist() == want
    codes = ref.unpack_codes(t.codes.numpy())
    assert codes[0, 0] == 7 and codes[3, 2] == 1 and codes[5, 16] == 7
    assert t.codes[16, 0] == 0x01 and t.codes[17, 0] == 0x70  # element 2i low, 2i+1 high
    assert int(np.count_nonzero(codes)) == 5
    ref.assert_ref_equal(t, ref.quantize_torch(xt, "tensor", True))
    # The same tensor with 1x16 blocks: every row its own scales.
    t1 = quantize_nvfp4(xt, amax="tensor", block_2d=False)
    assert t1.scales.view(torch.uint8)[1].tolist() == [0, 0]
    ref.assert_ref_equal(t1, ref.quantize_torch(xt, "tensor", False))


@pytest.mark.parametrize("rows", [1, 15, 17, 31, 33])
def test_block_2d_rows_not_multiple_of_16(rows):
    for kind in ["normal", "blocks"]:
        x = _to_torch(_make(kind, rows, 48, _rng("2d-rows", rows, kind)), torch.bfloat16)
        t = quantize_nvfp4(x, amax="tensor", block_2d=True)
        ref.assert_ref_equal(t, ref.quantize_torch(x, "tensor", True), f"{kind} rows={rows}")


def test_small_negatives_round_to_code_8():
    rng = _rng("small-neg")
    x = np.zeros((4, 32), np.float32)
    x[:, 0] = 100.0
    x[:, 1:16] = -rng.uniform(1e-4, 4e-3, (4, 15))  # |x*e| < 0.25 with e ~ 6/100
    x[:, 16] = 1.0
    x[:, 17:32] = -rng.uniform(1e-6, 0.04, (4, 15))
    t = quantize_nvfp4(torch.from_numpy(x))
    codes = ref.unpack_codes(t.codes.numpy())
    assert np.all(codes[:, 1:16] == 8)
    ref.assert_ref_equal(t, ref.quantize_torch(torch.from_numpy(x), "row"))


# --------------------------------------------------------------------------------------------
# global_amax (tensor-parallel shards)
# --------------------------------------------------------------------------------------------
def test_global_amax_override_matches_reference():
    x = _to_torch(_make("blocks", 24, 64, _rng("gamax")), torch.bfloat16)
    x32 = x.float()
    amax_t = x32.abs().max()
    amax_r = x32.abs().amax(dim=1)
    same = quantize_nvfp4(x, amax="tensor", global_amax=amax_t)
    ref.assert_ref_equal(same, ref.quantize_torch(x, "tensor"))
    same_r = quantize_nvfp4(x, amax="row", global_amax=amax_r)
    ref.assert_ref_equal(same_r, ref.quantize_torch(x, "row"))
    # Smaller than the true amax: block scales saturate at 448 (and x*e clamps at 6).
    for g in [amax_t * 0.01, amax_t * 1e-30, amax_t * 4, torch.tensor(0.0)]:
        g = g.to(torch.float32)
        t = quantize_nvfp4(x, amax="tensor", global_amax=g)
        ref.assert_ref_equal(t, ref.quantize_torch(x, "tensor", global_amax=g), f"g={g}")
        t2 = quantize_nvfp4(x, amax="tensor", block_2d=True, global_amax=g)
        ref.assert_ref_equal(t2, ref.quantize_torch(x, "tensor", True, global_amax=g))
    assert (quantize_nvfp4(x, amax="tensor", global_amax=amax_t * 0.01).scales.float() == 448).any()
    g_r = (amax_r * torch.linspace(0.05, 3, 24)).to(torch.float32)
    t = quantize_nvfp4(x, amax="row", global_amax=g_r)
    ref.assert_ref_equal(t, ref.quantize_torch(x, "row", global_amax=g_r), "row override")


@pytest.mark.parametrize("block_2d", [False, True], ids=["1x16", "16x16"])
def test_tensor_parallel_shards_match_unsharded(block_2d):
    w = _to_torch(_make("heavy", 64, 128, _rng("tp"), 0.02), torch.bfloat16)
    g = w.float().abs().max()
    full = quantize_nvfp4(w, amax="tensor", block_2d=block_2d)
    codes, bits = full.codes, full.scales.view(torch.uint8)
    for r0, r1 in [(0, 32), (32, 64), (16, 48)]:  # row (column-parallel) shards
        s = quantize_nvfp4(w[r0:r1], amax="tensor", block_2d=block_2d, global_amax=g)
        assert torch.equal(s.codes, codes[r0:r1]) and torch.equal(
            s.scales.view(torch.uint8), bits[r0:r1]
        )
        ref.assert_bits_equal(s.decode_scale, full.decode_scale)
    for c0, c1 in [(0, 64), (64, 128), (32, 96)]:  # K (row-parallel) shards
        s = quantize_nvfp4(
            w[:, c0:c1].contiguous(), amax="tensor", block_2d=block_2d, global_amax=g
        )
        assert torch.equal(s.codes, codes[:, c0 // 2 : c1 // 2])
        assert torch.equal(s.scales.view(torch.uint8), bits[:, c0 // 16 : c1 // 16])


# --------------------------------------------------------------------------------------------
# Dequantize
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("amax", ["row", "tensor"])
def test_dequantize_matches_reference(dtype, amax):
    for kind, scale in KINDS_SCALES:
        x = _to_torch(_make(kind, 19, 64, _rng("dq", kind, scale, str(dtype), amax), scale), dtype)
        for block_2d in [False, True] if amax == "tensor" else [False]:
            t = quantize_nvfp4(x, amax=amax, block_2d=block_2d)
            dq = dequantize_nvfp4(t)
            assert dq.dtype == dtype and dq.shape == x.shape
            _assert_values_equal(dq, _lib_dequant_ref(t, dtype), f"{kind} {scale}")
            for out in DTYPES:
                got = dequantize_nvfp4(t, out)
                _assert_values_equal(got, _lib_dequant_ref(t, out), f"{kind} -> {out}")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("amax", ["row", "tensor"])
def test_dequantize_error_bound(dtype, amax):
    """Per element, with U = S_dec, s the block's E4M3 scale, D = s*U (the block's decode scale)
    and v = bamax*S_enc/6 ~ bamax/(6U) the unrounded block scale:

      * no clamp (|x*e| <= 6): |x - q*D| <= (half the largest E2M1 step = 1) * D;
      * clamp (|x| > 6D, only when s rounded below v): |x - 6D| <= bamax - 6D = 6U(v - s), and
        E4M3 rounding moves v by at most max(v/16, 2^-10) (half an ulp: 3 mantissa bits for
        normals, 2^-9 spacing for subnormals; a zero scale means v <= 2^-10).

    So |x - dq| <= D + 6U*max(v/16, 2^-10), plus float32 rounding of e, x*e and dq, covered by a
    relative 2^-20 slack (those are a handful of 2^-24 relative errors). Needs S_dec normal.
    """
    for kind, scale in KINDS_SCALES:
        x = _to_torch(_make(kind, 21, 64, _rng("bound", kind, scale, str(dtype)), scale), dtype)
        x64 = x.double()
        for block_2d in [False, True] if amax == "tensor" else [False]:
            t = quantize_nvfp4(x, amax=amax, block_2d=block_2d)
            dq = dequantize_nvfp4(t, torch.float32).double()
            u = t.decode_scale.double().reshape(-1, 1) if amax == "row" else t.decode_scale.double()
            s = ref.E4M3_DECODE[t.scales.view(torch.uint8).numpy()]
            d = torch.from_numpy(s).double().repeat_interleave(16, dim=1) * u
            bamax = torch.from_numpy(ref.block_amax(np.abs(ref.torch_to_f32(x)), block_2d))
            v = bamax.double().repeat_interleave(16, dim=1) / (6 * u)
            bound = d + 6 * u * torch.maximum(v / 16, torch.tensor(2.0**-10))
            bound = bound * (1 + 2.0**-20) + 2.0**-20 * (x64.abs() + dq.abs())
            err = (x64 - dq).abs()
            assert torch.all(err <= bound), f"{kind} {scale}: worst {(err - bound).max()}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_block_2d_transpose_gives_identical_values(dtype):
    for kind in ["normal", "heavy", "blocks"]:
        w = _to_torch(_make(kind, 48, 80, _rng("wt", kind, str(dtype))), dtype)
        a = dequantize_nvfp4(quantize_nvfp4(w, amax="tensor", block_2d=True))
        b = dequantize_nvfp4(quantize_nvfp4(w.T.contiguous(), amax="tensor", block_2d=True))
        ref.assert_bits_equal(a.T.contiguous(), b, f"{kind}: dq(W).T vs dq(W.T)", nan_ok=False)


def test_block_2d_transpose_of_noncontiguous_input():
    w = _to_torch(_make("normal", 32, 64, _rng("wt-nc")), torch.bfloat16)
    a = quantize_nvfp4(w.T, amax="tensor", block_2d=True)  # a non-contiguous view
    b = quantize_nvfp4(w.T.contiguous(), amax="tensor", block_2d=True)
    assert torch.equal(a.codes, b.codes)
    assert torch.equal(a.scales.view(torch.uint8), b.scales.view(torch.uint8))
    ref.assert_bits_equal(a.decode_scale, b.decode_scale)
    # A column slice (non-contiguous, with a storage offset), 1x16 blocks, row amax.
    c = quantize_nvfp4(w[:, 16:48], amax="row")
    ref.assert_ref_equal(c, ref.quantize_torch(w[:, 16:48].contiguous(), "row"), "slice")


# --------------------------------------------------------------------------------------------
# W4A4 linear
# --------------------------------------------------------------------------------------------
def _weight(n: int, k: int, key, dtype=torch.bfloat16, amax="tensor", block_2d=True):
    w = _to_torch(_make("heavy", n, k, _rng("w", n, k, key), 0.02), dtype)
    return quantize_nvfp4(w, amax=amax, block_2d=block_2d)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("wmode", ["tensor2d", "row1d"])
def test_w4a4_linear_matches_exact_reference(dtype, with_bias, wmode):
    amax, block_2d = ("tensor", True) if wmode == "tensor2d" else ("row", False)
    for m, k, n in [(9, 96, 40), (3, 1024, 24)]:
        w = _weight(n, k, (dtype, with_bias, wmode), amax=amax, block_2d=block_2d)
        for kind, scale in [("normal", 1.0), ("blocks", 1.0), ("heavy", 1e3)]:
            x = _to_torch(_make(kind, m, k, _rng("x", m, k, kind, str(dtype)), scale), dtype)
            bias = None
            if with_bias:
                bias = _to_torch(_make("normal", 1, n, _rng("b", n))[0] * F32(0.1), dtype)
            y = w4a4_linear(x, w, bias)
            assert y.dtype == dtype and y.shape == (m, n)
            _assert_values_equal(y, ref.w4a4_linear_ref(x, w, bias), f"{kind} {m}x{k}x{n}")


def test_w4a4_linear_leading_dims():
    w = _weight(32, 64, "lead")
    x = _to_torch(_make("normal", 6, 64, _rng("lead")), torch.bfloat16).reshape(2, 3, 64)
    y = w4a4_linear(x, w)
    assert y.shape == (2, 3, 32) and y.dtype == torch.bfloat16
    _assert_values_equal(y, ref.w4a4_linear_ref(x, w), "3D input")
    _assert_values_equal(y.reshape(6, 32), w4a4_linear(x.reshape(6, 64), w), "3D vs 2D")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_w4a4_linear_batch_invariance(dtype):
    k, n = 256, 48
    w = _weight(n, k, ("inv", str(dtype)))
    bias = _to_torch(_make("normal", 1, n, _rng("inv-b"))[0], dtype)
    rng = _rng("inv", str(dtype))
    for trial in range(3):
        target = _to_torch(_make("blocks" if trial else "normal", 1, k, rng), dtype)
        alone = w4a4_linear(target, w, bias)
        _assert_values_equal(alone, ref.w4a4_linear_ref(target, w, bias), "alone vs ref")
        for m in [1, 2, 7, 16, 33, 100] + ([700] if trial == 0 else []):
            others = _make("normal", m, k, rng) * (10.0 ** rng.uniform(-30, 30, (m, 1)))
            batch = _to_torch(others.astype(np.float32), dtype)
            pos = int(rng.integers(m))
            if m > 2:  # an all-zero row (amax 0 -> S_enc 1) among the others
                batch[(pos + 1) % m] = 0.0
            batch[pos] = target[0]
            y = w4a4_linear(batch, w, bias)
            ref.assert_bits_equal(y[pos : pos + 1], alone, f"m={m} pos={pos}", nan_ok=False)
            _assert_values_equal(y, ref.w4a4_linear_ref(batch, w, bias), f"batch m={m}")


# --------------------------------------------------------------------------------------------
# Non-finite inputs
# --------------------------------------------------------------------------------------------
def _nonfinite_input(dtype) -> tuple[torch.Tensor, list[int]]:
    x = _make("normal", 7, 64, _rng("nan"))
    x[1, 5] = np.nan
    x[3, 40] = np.inf
    x[4, 0] = -np.inf
    x[4, 17] = np.nan
    x[5, :] = np.nan
    x[6, 20] = 1e3  # a finite row with an outlier
    return _to_torch(x, dtype), [1, 3, 4, 5]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_nonfinite_rows_row_amax(dtype):
    x, bad = _nonfinite_input(dtype)
    good = [r for r in range(x.shape[0]) if r not in bad]
    t = quantize_nvfp4(x, amax="row")
    ref.assert_ref_equal(t, ref.quantize_torch(x, "row"), "row amax")
    assert torch.isnan(t.decode_scale[bad]).all() and torch.isfinite(t.decode_scale[good]).all()
    # Non-finite elements count as 0: code 0; the rest of a row is quantized as if they were 0.
    clean = torch.where(torch.isfinite(x), x, torch.zeros_like(x))
    tc = quantize_nvfp4(clean, amax="row")
    assert torch.equal(t.codes, tc.codes)
    assert torch.equal(t.scales.view(torch.uint8), tc.scales.view(torch.uint8))
    for out in DTYPES:
        dq = dequantize_nvfp4(t, out)
        assert torch.isnan(dq[bad]).all(), "rows with a non-finite input must dequantize to NaN"
        assert torch.isfinite(dq[good]).all()
        _assert_values_equal(dq, _lib_dequant_ref(t, out))


@pytest.mark.parametrize("block_2d", [False, True], ids=["1x16", "16x16"])
def test_nonfinite_tensor_amax(block_2d):
    x, _ = _nonfinite_input(torch.bfloat16)
    t = quantize_nvfp4(x, amax="tensor", block_2d=block_2d)
    ref.assert_ref_equal(t, ref.quantize_torch(x, "tensor", block_2d))
    assert t.decode_scale.shape == () and torch.isnan(t.decode_scale)
    assert torch.isnan(dequantize_nvfp4(t)).all()
    # A single inf anywhere poisons the whole tensor.
    y = torch.ones(4, 32)
    y[2, 31] = -torch.inf
    t = quantize_nvfp4(y, amax="tensor", block_2d=block_2d)
    ref.assert_ref_equal(t, ref.quantize_torch(y, "tensor", block_2d))
    assert torch.isnan(dequantize_nvfp4(t)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_nonfinite_rows_w4a4_linear(dtype):
    x, bad = _nonfinite_input(dtype)
    good = [r for r in range(x.shape[0]) if r not in bad]
    w = _weight(24, 64, "nan-w")
    bias = torch.ones(24, dtype=dtype)
    y = w4a4_linear(x, w, bias)
    assert torch.isnan(y[bad]).all(), "rows with a non-finite input must give NaN outputs"
    assert torch.isfinite(y[good]).all()
    _assert_values_equal(y, ref.w4a4_linear_ref(x, w, bias))
    # ... and the finite rows are not affected by the NaN rows in the batch.
    ref.assert_bits_equal(y[good], w4a4_linear(x[good], w, bias), nan_ok=False)
    # A non-finite weight tensor (tensor amax) gives NaN everywhere.
    wbad = torch.ones(24, 64, dtype=torch.bfloat16)
    wbad[3, 3] = torch.nan
    yw = w4a4_linear(x[good], quantize_nvfp4(wbad, amax="tensor", block_2d=True))
    assert torch.isnan(yw).all()
    # A weight quantized with a per-row amax: a non-finite weight row gives a NaN column.
    wq_rows = quantize_nvfp4(wbad, amax="row")
    yc = w4a4_linear(x[good], wq_rows)
    assert (
        torch.isnan(yc[:, 3]).all()
        and torch.isfinite(yc[:, [n for n in range(24) if n != 3]]).all()
    )
    _assert_values_equal(yc, ref.w4a4_linear_ref(x[good], wq_rows))


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [8, 24, 33, 100])
def test_k_not_multiple_of_16(k):
    for block_2d in [False, True]:
        with pytest.raises(ValueError, match="16"):
            quantize_nvfp4(torch.randn(16, k), block_2d=block_2d, amax="tensor")
    with pytest.raises(ValueError, match="16"):
        quantize_nvfp4(torch.randn(4, k))


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.int64, torch.uint8])
def test_integer_input_is_type_error(dtype):
    with pytest.raises(TypeError):
        quantize_nvfp4(torch.ones(4, 32, dtype=dtype))


@pytest.mark.parametrize("shape", [(32,), (2, 4, 32), ()])
def test_non_2d_input_is_value_error(shape):
    with pytest.raises(ValueError):
        quantize_nvfp4(torch.ones(shape))


# --------------------------------------------------------------------------------------------
# Recipe fingerprint
# --------------------------------------------------------------------------------------------
_FP_SCRIPT = "from minite_common import DEFAULT_RECIPE, NVFP4Recipe; " + (
    "print(DEFAULT_RECIPE.fingerprint()); print(NVFP4Recipe().fingerprint())"
)


def test_fingerprint_stable_in_process():
    fp = DEFAULT_RECIPE.fingerprint()
    assert isinstance(fp, str) and fp
    assert NVFP4Recipe().fingerprint() == fp
    assert DEFAULT_RECIPE.fingerprint() == fp


def test_fingerprint_stable_across_processes():
    outs = []
    for seed in ["0", "12345"]:  # different str-hash seeds: hash() must not leak in
        env = dict(os.environ, PYTHONHASHSEED=seed)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
        out = subprocess.run(
            [sys.executable, "-c", _FP_SCRIPT],
            capture_output=True,
            text=True,
            check=True,
            cwd=REPO_ROOT,
            env=env,
            timeout=120,
        ).stdout.split()
        assert len(out) == 2 and out[0] == out[1]
        outs.append(out[0])
    assert outs[0] == outs[1] == DEFAULT_RECIPE.fingerprint()


def _perturb(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, enum.Enum):
        others = [m for m in type(value) if m != value]
        return others[0] if others else None
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 2 if value else 1.0
    if isinstance(value, str):
        return value + "_x"
    if isinstance(value, torch.dtype):
        return torch.float16 if value != torch.float16 else torch.float32
    if isinstance(value, tuple):
        return value + (value[-1],) if value else None
    if isinstance(value, frozenset):
        return value | {"_x"}
    return None


def test_fingerprint_changes_with_every_field():
    assert dataclasses.is_dataclass(NVFP4Recipe)
    base = NVFP4Recipe()
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(base, dataclasses.fields(NVFP4Recipe)[0].name, None)
    changed = 0
    for f in dataclasses.fields(NVFP4Recipe):
        new = _perturb(getattr(base, f.name))
        if new is None:
            continue
        try:
            other = dataclasses.replace(base, **{f.name: new})
        except (ValueError, TypeError):
            continue  # the recipe refuses this value: nothing to fingerprint
        assert other.fingerprint() != base.fingerprint(), f"field {f.name} not in fingerprint"
        assert dataclasses.replace(other, **{f.name: getattr(base, f.name)}).fingerprint() == (
            base.fingerprint()
        )
        changed += 1
    assert changed >= 1
