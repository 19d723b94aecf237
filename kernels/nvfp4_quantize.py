"""NVFP4 quantization on the GPU: the contract's quantizer (docs/contract.md sections 1-3), the
same bytes as the torch reference ``minite_common.nvfp4.quantize_nvfp4``.

One kernel covers per-row amax (activations, 1x16 blocks) and per-tensor amax (weights, 16x16
blocks); a small reduction kernel computes the per-tensor amax first. Every step is float32 with
IEEE division (``div_rn``), in the contract's order; no step adds to a product, so no FMA
contraction can merge two roundings (the launch also disables contraction).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from ._fp import (
    FLT_MAX,
    INF,
    SIXTH_F32,
    e4m3_to_f32,
    f32_to_e4m3_rne,
    global_scales,
    nan_like,
)


@triton.jit
def e2m1_magic(a):
    """Bits of ``step * 2^23`` for ``a`` in [0, 6]: ``step`` is the E2M1 grid step at ``a``
    (0.5 below 2, 1 below 4, 2 up to 6), i.e. half the power of two at or below ``max(a, 1)``.
    ``a + magic`` (float32, round to nearest even) rounds ``a`` to that grid, ties to even."""
    return (tl.maximum(a, 1.0).to(tl.int32, bitcast=True) & 0x7F800000) + 0x0B000000


@triton.jit
def e2m1_code_rne(a):
    """E2M1 magnitude code (int32 0..7) of float32 ``a`` in [0, 6]: nearest, ties to the even
    code (the contract's rounding). With ``magic`` = :func:`e2m1_magic`, the low bits of
    ``a + magic`` hold ``round(a / step)`` and the code is that plus 0, 2, 4 for steps 0.5, 1,
    2, which is ``(magic >> 22) - 298``: about 6 integer/float operations instead of a chain of
    7 compares and adds."""
    magic = e2m1_magic(a)
    rounded = (a + magic.to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True)
    return rounded - magic + ((magic >> 22) - 298)


@triton.jit
def _block_scales(bamax, s_enc, s_dec):
    """The contract's block scales of block amaxes ``bamax`` under the global scales ``s_enc``,
    ``s_dec`` (shaped to broadcast against ``bamax``: one per row of blocks, or scalars): (E4M3
    scale codes, float32 encode factors 1 / decoded block scale)."""
    scale_f32 = tl.minimum(bamax * (s_enc * SIXTH_F32), 448.0, propagate_nan=tl.PropagateNan.ALL)
    scale_code = f32_to_e4m3_rne(scale_f32)
    block_dec = e4m3_to_f32(scale_code) * s_dec
    encode = tl.minimum(
        tl.math.div_rn(tl.full(block_dec.shape, 1.0, tl.float32), block_dec),
        FLT_MAX,
        propagate_nan=tl.PropagateNan.ALL,
    )
    return scale_code, encode


@triton.jit
def _load_finite(x_rows, stride_xk, row_ok, k0, K, BLOCK_K: tl.constexpr):
    """A float32 tile with NaN/Inf replaced by 0, and a 0/1 mask of the non-finite elements."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask = row_ok[:, None] & (offs_k < K)[None, :]
    x = tl.load(x_rows + offs_k[None, :] * stride_xk, mask=mask, other=0.0).to(tl.float32)
    finite = tl.abs(x) < INF
    return tl.where(finite, x, 0.0), (~finite).to(tl.int32)


@triton.jit
def _quantize_tile(
    x,
    s_enc,
    s_dec,
    codes_ptr,
    scales_ptr,
    offs_m,
    row_ok,
    k0,
    K,
    BLOCK_2D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Quantize a finite float32 tile [BLOCK_M, BLOCK_K] at column k0 and store codes and scales."""
    NB: tl.constexpr = BLOCK_K // 16
    mag = tl.abs(x)
    if BLOCK_2D:
        tiles = tl.max(tl.max(tl.reshape(mag, [BLOCK_M // 16, 16, NB, 16]), axis=3), axis=1)
        bamax = tl.reshape(
            tl.broadcast_to(tiles[:, None, :], [BLOCK_M // 16, 16, NB]), [BLOCK_M, NB]
        )
    else:
        bamax = tl.max(tl.reshape(mag, [BLOCK_M, NB, 16]), axis=2)
    scale_code, encode = _block_scales(bamax, s_enc[:, None], s_dec[:, None])
    scaled = tl.reshape(x, [BLOCK_M, NB, 16]) * encode[:, :, None]
    # x is finite and encode in (0, FLT_MAX]: scaled is never NaN, so a plain min clamps it.
    code = e2m1_code_rne(tl.minimum(tl.abs(scaled), 6.0)) | tl.where(scaled < 0, 8, 0)
    even, odd = tl.split(tl.reshape(code, [BLOCK_M, BLOCK_K // 2, 2]))
    packed = (even | (odd << 4)).to(tl.uint8)

    half_k = K // 2
    offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    row64 = offs_m.to(tl.int64)
    tl.store(
        codes_ptr + row64[:, None] * half_k + offs_b[None, :],
        packed,
        mask=row_ok[:, None] & (offs_b < half_k)[None, :],
    )
    n_blocks = K // 16
    offs_s = k0 // 16 + tl.arange(0, NB)
    tl.store(
        scales_ptr + row64[:, None] * n_blocks + offs_s[None, :],
        scale_code.to(tl.uint8),
        mask=row_ok[:, None] & (offs_s < n_blocks)[None, :],
    )


@triton.jit(do_not_specialize=["rows"])
def _quantize_nvfp4_kernel(
    x_ptr,
    stride_xr,
    stride_xk,
    codes_ptr,
    scales_ptr,
    decode_ptr,
    amax_ptr,
    amax_stride,
    nonfinite_ptr,
    rows,
    K,
    ROW_AMAX: tl.constexpr,
    GIVEN_AMAX: tl.constexpr,
    BLOCK_2D: tl.constexpr,
    SINGLE_PASS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    LAUNCH_DEPENDENTS: tl.constexpr,
):
    """Quantize rows [pid*BLOCK_M, +BLOCK_M). ROW_AMAX: amax and non-finite flag per row (from
    the data, or amax given per row); else both are device scalars. SINGLE_PASS: K <= BLOCK_K."""
    if LAUNCH_DEPENDENTS:  # a GEMM launched as a programmatic dependent may start (it waits)
        gdc_launch_dependents()
    pid = tl.program_id(0)
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < rows
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xr
    if SINGLE_PASS:
        x, bad = _load_finite(x_rows, stride_xk, row_ok, 0, K, BLOCK_K)
        amax = tl.max(tl.abs(x), axis=1)
        nonfinite = tl.max(bad, axis=1)
    elif ROW_AMAX:
        amax = tl.zeros([BLOCK_M], tl.float32)
        nonfinite = tl.zeros([BLOCK_M], tl.int32)
        for k0 in range(0, K, BLOCK_K):
            xk, badk = _load_finite(x_rows, stride_xk, row_ok, k0, K, BLOCK_K)
            amax = tl.maximum(amax, tl.max(tl.abs(xk), axis=1))
            nonfinite = tl.maximum(nonfinite, tl.max(badk, axis=1))
    else:
        amax = tl.load(amax_ptr + offs_m * 0)
        nonfinite = tl.load(nonfinite_ptr + offs_m * 0)
    if GIVEN_AMAX:
        amax = tl.load(amax_ptr + offs_m * amax_stride, mask=row_ok, other=1.0)
    s_enc, s_dec = global_scales(amax)
    decode = tl.where(nonfinite != 0, nan_like(s_dec), s_dec)
    if ROW_AMAX:
        tl.store(decode_ptr + offs_m, decode, mask=row_ok)
    else:
        tl.store(decode_ptr + offs_m * 0, decode, mask=offs_m == 0)
    if SINGLE_PASS:
        _quantize_tile(
            x, s_enc, s_dec, codes_ptr, scales_ptr, offs_m, row_ok, 0, K, BLOCK_2D, BLOCK_M, BLOCK_K
        )
    else:
        for k0 in range(0, K, BLOCK_K):
            xk, _ = _load_finite(x_rows, stride_xk, row_ok, k0, K, BLOCK_K)
            _quantize_tile(
                xk, s_enc, s_dec, codes_ptr, scales_ptr, offs_m, row_ok, k0, K,
                BLOCK_2D, BLOCK_M, BLOCK_K,
            )  # fmt: skip


@triton.jit
def _quantize_bf16_rows_kernel(
    w_ptr,
    stride_wr,
    codes_ptr,
    scales_ptr,
    decode_ptr,
    amax_ptr,
    amax_stride,
    K,
    GIVEN_AMAX: tl.constexpr,
    NB: tl.constexpr,
    LAUNCH_DEPENDENTS: tl.constexpr,
):
    """Row ``program_id`` with its own amax, 1x16 blocks, BF16 input read as int32 words (two
    elements each, the even one in the low half): the same bytes as ``_quantize_nvfp4_kernel``
    with ROW_AMAX and SINGLE_PASS. The row is a tile [NB blocks, 8 words]: a block's two halves
    of 8 elements are two threads' vector loads, an element pair gives one code byte without any
    even/odd split. Non-finite elements are detected per block from the integer max of the
    magnitudes' bits and zeroed only in rows that hold one (a scalar branch)."""
    if LAUNCH_DEPENDENTS:  # a GEMM launched as a programmatic dependent may start (it waits)
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    offs_b = tl.arange(0, NB)
    n_blocks = K // 16
    blk_ok = offs_b < n_blocks
    word = offs_b[:, None] * 8 + tl.arange(0, 8)[None, :]
    w = tl.load(w_ptr + row * stride_wr + word, mask=blk_ok[:, None], other=0)
    lo = (w << 16).to(tl.float32, bitcast=True)
    hi = (w & -65536).to(tl.float32, bitcast=True)
    # Block max of the magnitudes' bits: integer order is float order, with Inf and NaN on top.
    bmax_bits = tl.maximum(tl.max(w & 0x7FFF, axis=1) << 16, tl.max(w & 0x7FFF0000, axis=1))
    bmax = bmax_bits.to(tl.float32, bitcast=True)
    finite_blk = bmax_bits < 0x7F800000
    if tl.min(finite_blk.to(tl.int32), axis=0) == 0:
        lo = tl.where(tl.abs(lo) < INF, lo, 0.0)
        hi = tl.where(tl.abs(hi) < INF, hi, 0.0)
        bmax = tl.max(tl.maximum(tl.abs(lo), tl.abs(hi)), axis=1)
    nonfinite = tl.max((~finite_blk).to(tl.int32), axis=0)
    amax = tl.load(amax_ptr + row * amax_stride) if GIVEN_AMAX else tl.max(bmax, axis=0)
    s_enc, s_dec = global_scales(amax)
    tl.store(decode_ptr + row, tl.where(nonfinite != 0, nan_like(s_dec), s_dec))
    scale_code, encode = _block_scales(bmax, s_enc, s_dec)
    encode = encode[:, None]
    # lo, hi finite and encode in (0, FLT_MAX]: the products are never NaN.
    p_lo = lo * encode
    p_hi = hi * encode
    c_lo = e2m1_code_rne(tl.minimum(tl.abs(p_lo), 6.0)) | tl.where(p_lo < 0, 8, 0)
    c_hi = e2m1_code_rne(tl.minimum(tl.abs(p_hi), 6.0)) | tl.where(p_hi < 0, 8, 0)
    packed = (c_lo | (c_hi << 4)).to(tl.uint8)
    tl.store(codes_ptr + row * (K // 2) + word, packed, mask=blk_ok[:, None])
    tl.store(scales_ptr + row * n_blocks + offs_b, scale_code.to(tl.uint8), mask=blk_ok)


@triton.jit(do_not_specialize=["rows"])
def _absmax_kernel(
    x_ptr,
    stride_xr,
    stride_xk,
    rows,
    K,
    part_amax_ptr,
    part_nonfinite_ptr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Per program: max |x| over the finite elements of BLOCK_M rows, and whether any is not."""
    pid = tl.program_id(0)
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < rows
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xr
    amax = tl.zeros([BLOCK_M], tl.float32)
    nonfinite = tl.zeros([BLOCK_M], tl.int32)
    for k0 in range(0, K, BLOCK_K):
        xk, badk = _load_finite(x_rows, stride_xk, row_ok, k0, K, BLOCK_K)
        amax = tl.maximum(amax, tl.max(tl.abs(xk), axis=1))
        nonfinite = tl.maximum(nonfinite, tl.max(badk, axis=1))
    tl.store(part_amax_ptr + pid, tl.max(amax, axis=0))
    tl.store(part_nonfinite_ptr + pid, tl.max(nonfinite, axis=0))


#: The longest rows the one-pass kernels hold in registers: the generic kernel's tile, and the
#: BF16-rows kernel's, whose warps grow with K so that a thread holds at most 64 elements (32 warps
#: at 65536). Longer rows take two passes over tiles.
_SINGLE_PASS_MAX_K = 16384
_BF16_ROWS_MAX_K = 65536


def _bf16_words(x: torch.Tensor) -> bool:
    """Whether BF16 ``x`` [rows, K] can be read as int32 words of two elements (row-contiguous,
    even row stride and offset), which :func:`_quantize_bf16_rows_kernel` needs."""
    return (
        x.dtype == torch.bfloat16
        and x.stride(1) == 1
        and x.stride(0) % 2 == 0
        and x.storage_offset() % 2 == 0
    )


_TILE_ELEMENTS = 8192
_ONE_ROW_PROGRAMS = 256


def quantize_nvfp4_triton(
    x: torch.Tensor,
    *,
    amax: str,
    block_2d: bool,
    global_amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes uint8 [rows, K/2], scales float8_e4m3fn [rows, K/16], decode_scale f32)`` of a
    2D float tensor ``x`` (any strides), bit-identical to the torch reference.

    ``amax`` is ``"row"`` or ``"tensor"``; ``global_amax`` (already validated: a 0-d tensor for
    ``"tensor"``, ``[rows]`` for ``"row"``) replaces the computed amax.
    """
    rows, k = x.shape
    if block_2d and amax != "tensor":
        raise ValueError("16x16 blocks need amax='tensor' (one global scale per tile)")
    dev = x.device
    codes = torch.empty(rows, k // 2, dtype=torch.uint8, device=dev)
    scales = torch.empty(rows, k // 16, dtype=torch.uint8, device=dev)
    row_amax = amax == "row"
    decode = torch.empty(rows if row_amax else (), dtype=torch.float32, device=dev)
    if rows == 0:
        return codes, scales.view(torch.float8_e4m3fn), decode

    given = global_amax is not None
    amax_arg = global_amax.float() if given else codes  # a placeholder pointer when unused
    amax_stride = amax_arg.stride(0) if given and amax_arg.dim() else 0
    nonfinite = codes
    if not row_amax:
        block_m, block_k = 16, 512
        n_prog = triton.cdiv(rows, block_m)
        parts = torch.empty(n_prog, dtype=torch.float32, device=dev)
        flags = torch.empty(n_prog, dtype=torch.int32, device=dev)
        _absmax_kernel[(n_prog,)](
            x, x.stride(0), x.stride(1), rows, k, parts, flags,
            BLOCK_M=block_m, BLOCK_K=block_k, num_warps=8,
        )  # fmt: skip
        nonfinite = flags.amax()
        if not given:
            amax_arg = parts.amax()
        single = False
    elif k <= _BF16_ROWS_MAX_K and not block_2d and _bf16_words(x):
        block_k = triton.next_power_of_2(k)
        # one row per program; at least 8 warps for a few rows (decode steps: the shortest
        # per-row chain), and at most 64 elements per thread (H200, 2026-12-04: 2.0-2.8 TB/s at
        # K = 2048-16384, 1.1-1.3x the previous tiles of 16384 elements at 8 warps)
        warps = min(32, max(8 if rows <= _ONE_ROW_PROGRAMS else 4, block_k // 2048))
        _quantize_bf16_rows_kernel[(rows,)](
            x.view(torch.int32), x.stride(0) // 2, codes, scales, decode, amax_arg, amax_stride,
            k,
            GIVEN_AMAX=given, NB=block_k // 16, LAUNCH_DEPENDENTS=x.is_cuda,
            num_warps=warps, enable_fp_fusion=False,
        )  # fmt: skip
        return codes, scales.view(torch.float8_e4m3fn), decode
    elif k <= _SINGLE_PASS_MAX_K and not block_2d:
        block_k = triton.next_power_of_2(k)
        # a few rows (decode steps): one row per program, so that they run side by side
        block_m = 1 if rows <= _ONE_ROW_PROGRAMS else max(1, _TILE_ELEMENTS // block_k)
        single = True
    else:  # two passes over tiles: a few rows one per program, so that they run side by side
        block_m, block_k = (1, 4096) if rows <= _ONE_ROW_PROGRAMS else (4, 512)
        single = False
    _quantize_nvfp4_kernel[(triton.cdiv(rows, block_m),)](
        x, x.stride(0), x.stride(1), codes, scales, decode, amax_arg, amax_stride, nonfinite,
        rows, k,
        ROW_AMAX=row_amax, GIVEN_AMAX=given and row_amax, BLOCK_2D=block_2d, SINGLE_PASS=single,
        BLOCK_M=block_m, BLOCK_K=block_k, LAUNCH_DEPENDENTS=x.is_cuda, num_warps=8,
        enable_fp_fusion=False,
    )  # fmt: skip
    return codes, scales.view(torch.float8_e4m3fn), decode
