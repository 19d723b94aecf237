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
  transform over 16-token blocks (rounded to BF16, as ``random_hadamard_transform``), tokens
  zero-padded to a multiple of 16; output [ceil(R/16)*16, C].

Each output has one per-tensor amax (first pass: atomic max of the tiles' amax, non-finite flag
alongside), then the recipe-v1 block scales of :func:`minite_common.quantize_nvfp4` (same
float32 formula and order) and codes rounded to nearest even, or stochastically with the torch
path's rule (the upper neighbour with probability ``(|v| - lo) / (hi - lo)``; 24-bit uniform
random numbers from an integer hash of the element index and a seed). The decode scale (NaN
when the operand holds NaN/Inf, as the torch path gives) is written to a two-element vector.

Compared with the torch path, the codes and scales are the same function of the operand; only
the RHT's float32 sum order before its BF16 rounding may differ (rarely one BF16 ulp), and the
stochastic rounding draws other random numbers of the same distribution.

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
#: Tile of the input per program: BLOCK_R tokens x BLOCK_C features (both multiples of 16).
BLOCK_R = 64
BLOCK_C = 64
#: Row tiles per program of the amax pass (one cross-thread reduction for all of them).
AMAX_TILES = 4


SIGN = tl.constexpr(-(2**31))


@triton.jit
def _uniform(seed, index):
    """Uniform float32 in [0, 1) (24 random bits) for each int32 ``index``: Chris Wellons'
    lowbias32 integer hash of the index mixed with ``seed``, a bijection with full avalanche
    (about 10 integer operations, against about 70 for ``tl.rand``'s 10-round Philox)."""
    x = index.to(tl.uint32, bitcast=True) * 0x9E3779B9 + seed.to(tl.uint32)
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    x = x ^ (x >> 16)
    return (x >> 8).to(tl.float32) * 5.960464477539063e-08  # 2^-24


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
def _load_tile(x_ptr, stride_r, stride_c, offs_r, offs_c, R, C):
    """The input tile [BLOCK_R, BLOCK_C] as stored (zeros outside the tensor)."""
    mask = (offs_r < R)[:, None] & (offs_c < C)[None, :]
    ptrs = x_ptr + offs_r[:, None].to(tl.int64) * stride_r + offs_c[None, :].to(tl.int64) * stride_c
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _row_values(x, col_scale_ptr, scale_stride, offs_c, C, ROW_SCALE: tl.constexpr):
    """float32 ``x * col_scale[c]`` [BLOCK_R, BLOCK_C] (blocks of 16 along the last axis)."""
    v = x.to(tl.float32)
    if ROW_SCALE:
        scale = tl.load(col_scale_ptr + offs_c * scale_stride, mask=offs_c < C, other=1.0)
        v = v * scale[None, :]
    return v


@triton.jit
def _col_values(x, h_ptr, RHT: tl.constexpr, DOT_BF16: tl.constexpr, BLOCK_R: tl.constexpr):
    """float32 tile [BLOCK_R, BLOCK_C] in place (blocks of 16 tokens along the first axis), after
    the RHT rounded to BF16 if RHT: ``y[16b + j, c] = sum_i h[i, j] * x[16b + i, c]``, one dot of
    the block-diagonal ``diag(h^T, ...)`` [BLOCK_R, BLOCK_R] with the tile. Each output's 16
    nonzero products sit in one MMA step of 16 (the other steps add exact zeros), so the sum is
    the 16-wide dot of the transposed layout. DOT_BF16: the input is BF16, whose products with
    the +-1/4 entries are exact, so a BF16 MMA with float32 accumulation computes the transform."""
    if RHT:
        i = tl.arange(0, BLOCK_R)[:, None]
        j = tl.arange(0, BLOCK_R)[None, :]
        hbd = tl.load(h_ptr + (j % 16) * 16 + i % 16, mask=i // 16 == j // 16, other=0.0)
        if DOT_BF16:
            y = tl.dot(hbd.to(tl.bfloat16), x.to(tl.bfloat16))
        else:
            y = tl.dot(hbd, x.to(tl.float32), input_precision="ieee")
        return round_to_bf16(y)
    return x.to(tl.float32)


@triton.jit
def _finite_amax(v):
    """(max |v| over the finite elements, 1.0 if any element is NaN/Inf else 0.0). The integer
    max of the magnitudes' bits (Inf and NaN above every finite value) decides; only a tile
    that holds a non-finite element takes the masked reduction."""
    top = tl.max(tl.max(v.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1), axis=0)
    amax = top.to(tl.float32, bitcast=True)
    bad = 0.0
    if top >= 0x7F800000:
        finite = tl.abs(v) < INF
        amax = tl.max(tl.max(tl.where(finite, tl.abs(v), 0.0), axis=1), axis=0)
        bad = 1.0
    return amax, bad


@triton.jit
def e2m1_round_nearest(a):
    """float32 ``a`` in [0, 6] rounded to the E2M1 grid (steps 1/2 below 2, 1 below 4, 2 up to
    6), ties to the even code: ``a + step * 2^23`` rounds to a multiple of ``step``."""
    magic = e2m1_magic(a).to(tl.float32, bitcast=True)
    return (a + magic) - magic


@triton.jit
def e2m1_round_stochastic(a, u):
    """float32 ``a`` in [0, 6] rounded to an E2M1 neighbour: the upper one when
    ``u * (hi - lo) < a - lo`` (the torch path's rule; ``u`` uniform in [0, 1)), computed
    divided by the step (a power of two, so exactly). Never above 6 since ``a <= 6``."""
    magic = e2m1_magic(a)
    step = (magic - 0x0B800000).to(tl.float32, bitcast=True)
    per_step = (-0x75800000 - magic).to(tl.float32, bitcast=True)  # bits 0x8A800000 - magic
    t = a * per_step
    below = tl.floor(t)
    return tl.where(u < t - below, below + 1.0, below) * step


@triton.jit
def _qdq_tile(
    v,
    s_enc,
    s_dec,
    offsets,
    seed,
    nonfinite,
    STOCHASTIC: tl.constexpr,
    P: tl.constexpr,
    Q: tl.constexpr,
    AXIS: tl.constexpr,
):
    """BF16 ``code * f32(scale)`` of a float32 tile [P, Q] quantized in blocks of 16 along axis
    ``AXIS`` (1: 16 consecutive elements of a row, the row operand; 0: 16 consecutive rows of a
    column, the col operand), recipe v1 (non-finite elements as 0, masked only when the
    operand's flag ``nonfinite`` from pass 1 is set); ``offsets`` [P, Q] index the random draws."""
    if nonfinite != 0:
        v = tl.where(tl.abs(v) < INF, v, 0.0)
    if AXIS == 1:
        v3 = tl.reshape(v, [P, Q // 16, 16])
        offsets = tl.reshape(offsets, [P, Q // 16, 16])
    else:
        v3 = tl.reshape(v, [P // 16, 16, Q])
        offsets = tl.reshape(offsets, [P // 16, 16, Q])
    bamax = tl.max(tl.abs(v3), axis=AXIS + 1)  # [blocks...]: the 16 elements' axis removed
    scale_f32 = tl.minimum(bamax * (s_enc * SIXTH_F32), 448.0, propagate_nan=tl.PropagateNan.ALL)
    scale = e4m3_to_f32(f32_to_e4m3_rne(scale_f32))
    block_dec = scale * s_dec
    encode = tl.minimum(
        tl.math.div_rn(tl.full(block_dec.shape, 1.0, tl.float32), block_dec),
        FLT_MAX,
        propagate_nan=tl.PropagateNan.ALL,
    )
    # v is finite and encode in (0, FLT_MAX]: the product is never NaN, so a plain min clamps.
    scaled = v3 * tl.expand_dims(encode, AXIS + 1)
    a = tl.minimum(tl.abs(scaled), 6.0)
    if STOCHASTIC:
        magnitude = e2m1_round_stochastic(a, _uniform(seed, offsets))
    else:
        magnitude = e2m1_round_nearest(a)
    signed = magnitude.to(tl.int32, bitcast=True) | (scaled.to(tl.int32, bitcast=True) & SIGN)
    q = signed.to(tl.float32, bitcast=True) * tl.expand_dims(scale, AXIS + 1)
    return tl.reshape(q, [P, Q]).to(tl.bfloat16)


@triton.jit
def _tile_values(
    x, col_scale_ptr, scale_stride, h_ptr, offs_c, C,
    COL_OUT: tl.constexpr, ROW_SCALE: tl.constexpr, RHT: tl.constexpr, DOT_BF16: tl.constexpr,
    BLOCK_R: tl.constexpr,
):  # fmt: skip
    """The row (``COL_OUT`` False) or col operand's float32 values of the tile ``x``."""
    if COL_OUT:
        v = _col_values(x, h_ptr, RHT, DOT_BF16, BLOCK_R)
    else:
        v = _row_values(x, col_scale_ptr, scale_stride, offs_c, C, ROW_SCALE)
    return v


@triton.jit
def _magnitude_bits(v):
    """int32 bits of ``|v|``: their integer order is the float order, Inf and NaN on top."""
    return v.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _publish_amax(
    top_bits, stats, x_ptr, stride_r, stride_c, R, C, col_scale_ptr, scale_stride, h_ptr, pid_r,
    offs_c, COL_OUT: tl.constexpr, ROW_SCALE: tl.constexpr, RHT: tl.constexpr,
    DOT_BF16: tl.constexpr, TILES: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """Atomic max into ``stats[0]`` of the row (``COL_OUT`` False) or col operand's amax over the
    program's TILES row tiles, and into ``stats[1]`` of its non-finite flag, from ``top_bits``
    (the elementwise max of the magnitudes' bits over the tiles). Only where those hold NaN/Inf
    are the tiles read again for the max over the finite elements (the slow path)."""
    top = tl.max(tl.max(top_bits, axis=1), axis=0)
    amax = top.to(tl.float32, bitcast=True)
    bad = 0.0
    if top >= 0x7F800000:
        amax = 0.0
        for i in range(TILES):
            offs_r = (pid_r * TILES + i) * BLOCK_R + tl.arange(0, BLOCK_R)
            x = _load_tile(x_ptr, stride_r, stride_c, offs_r, offs_c, R, C)
            v = _tile_values(
                x, col_scale_ptr, scale_stride, h_ptr, offs_c, C, COL_OUT, ROW_SCALE, RHT,
                DOT_BF16, BLOCK_R,
            )  # fmt: skip
            finite = tl.abs(v) < INF
            amax = tl.maximum(amax, tl.max(tl.max(tl.where(finite, tl.abs(v), 0.0), 1), 0))
        bad = 1.0
    tl.atomic_max(stats + 0, amax)
    tl.atomic_max(stats + 1, bad)


@triton.jit(do_not_specialize=["R"])
def _grad_amax_kernel(
    x_ptr,
    stride_r,
    stride_c,
    R,
    C,
    col_scale_ptr,
    scale_stride,
    h_ptr,
    stats_ptr,
    ROW: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    COL: tl.constexpr,
    RHT: tl.constexpr,
    DOT_BF16: tl.constexpr,
    TILES: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Pass 1: atomic max of each output's amax and non-finite flag into ``stats``
    (row: [0], [1]; col: [2], [3]); ``stats`` starts at zero. A program reads TILES tiles of
    BLOCK_R rows once for both operands: an elementwise max of the magnitudes' bits in
    registers, one reduction and one atomic per operand at the end; only when it finds a
    non-finite element are the tiles read again with a masked maximum."""
    pid_r = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    top_row = tl.zeros([BLOCK_R, BLOCK_C], tl.int32)
    top_col = tl.zeros([BLOCK_R, BLOCK_C], tl.int32)
    for i in range(TILES):
        offs_r = (pid_r * TILES + i) * BLOCK_R + tl.arange(0, BLOCK_R)
        x = _load_tile(x_ptr, stride_r, stride_c, offs_r, offs_c, R, C)
        if ROW:
            v = _row_values(x, col_scale_ptr, scale_stride, offs_c, C, ROW_SCALE)
            top_row = tl.maximum(top_row, _magnitude_bits(v))
        if COL:
            v = _col_values(x, h_ptr, RHT, DOT_BF16, BLOCK_R)
            top_col = tl.maximum(top_col, _magnitude_bits(v))
    args = (x_ptr, stride_r, stride_c, R, C, col_scale_ptr, scale_stride, h_ptr, pid_r, offs_c)
    if ROW:
        _publish_amax(top_row, stats_ptr, *args, False, ROW_SCALE, RHT, DOT_BF16, TILES, BLOCK_R)
    if COL:
        _publish_amax(top_col, stats_ptr + 2, *args, True, ROW_SCALE, RHT, DOT_BF16, TILES, BLOCK_R)


@triton.jit(do_not_specialize=["R", "R_PAD"])
def _grad_qdq_kernel(
    x_ptr,
    stride_r,
    stride_c,
    R,
    C,
    R_PAD,
    col_scale_ptr,
    scale_stride,
    h_ptr,
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
    COL_SR: tl.constexpr,
    DOT_BF16: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Pass 2: BF16 ``code * scale`` of the tile into ``row_out`` [R, C] and/or ``col_out``
    [R_PAD, C] (both row-major); program (0, 0) writes the decode scales to ``decode``."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    first = (pid_r == 0) & (pid_c == 0)
    x = _load_tile(x_ptr, stride_r, stride_c, offs_r, offs_c, R, C)
    index = offs_r[:, None] * C + offs_c[None, :]  # int32: random streams repeat past 2^31
    seed_row, seed_col = _seeds(seed_ptr, ROW_SR | COL_SR)
    if ROW:
        s_enc, s_dec = global_scales(tl.load(stats_ptr + 0))
        bad = tl.load(stats_ptr + 1)
        if first:
            tl.store(decode_ptr + 0, tl.where(bad != 0, nan_like(s_dec), s_dec))
        v = _row_values(x, col_scale_ptr, scale_stride, offs_c, C, ROW_SCALE)
        q = _qdq_tile(v, s_enc, s_dec, index, seed_row, bad, ROW_SR, BLOCK_R, BLOCK_C, 1)
        ok = (offs_r < R)[:, None] & (offs_c < C)[None, :]
        out = row_out + offs_r[:, None].to(tl.int64) * C + offs_c[None, :]
        tl.store(out, q, mask=ok)
    if COL:
        s_enc, s_dec = global_scales(tl.load(stats_ptr + 2))
        bad = tl.load(stats_ptr + 3)
        if first:
            tl.store(decode_ptr + 1, tl.where(bad != 0, nan_like(s_dec), s_dec))
        v = _col_values(x, h_ptr, RHT, DOT_BF16, BLOCK_R)
        q = _qdq_tile(v, s_enc, s_dec, index, seed_col, bad, COL_SR, BLOCK_R, BLOCK_C, 0)
        ok = (offs_r < R_PAD)[:, None] & (offs_c < C)[None, :]
        out = col_out + offs_r[:, None].to(tl.int64) * C + offs_c[None, :]
        tl.store(out, q, mask=ok)


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
    rht: torch.Tensor | None = None,
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
    ``rht``: the 16x16 random Hadamard matrix to apply to the col operand's 16-token blocks
    (``minite_common.hadamard.rht_matrix``), or None for none.
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
    h = rht.to(dev, torch.float32).contiguous() if col and rht is not None else stats
    dot_bf16 = x.dtype == torch.bfloat16 and not _INTERPRETED
    grid = (triton.cdiv(r_pad, BLOCK_R), triton.cdiv(c, BLOCK_C))
    flags = dict(ROW=row, COL=col, RHT=col and rht is not None, DOT_BF16=dot_bf16)
    amax_grid = (triton.cdiv(r_pad, BLOCK_R * AMAX_TILES), grid[1])
    _grad_amax_kernel[amax_grid](
        x, x.stride(0), x.stride(1), r, c, scale_arg, scale_stride, h, stats,
        ROW_SCALE=has_scale, TILES=AMAX_TILES, BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, num_warps=4,
        **flags,
    )  # fmt: skip
    _grad_qdq_kernel[grid](
        x, x.stride(0), x.stride(1), r, c, r_pad, scale_arg, scale_stride, h, stats, decode,
        row_out if row else stats, col_out if col else stats,
        seed_tensor(seed, dev) if row_stochastic or col_stochastic else stats,
        ROW_SCALE=has_scale, ROW_SR=row_stochastic, COL_SR=col_stochastic,
        BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, num_warps=4, enable_fp_fusion=False, **flags,
    )  # fmt: skip
    return row_out, col_out, decode


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
