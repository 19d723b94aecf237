"""W4A4 GEMM on Hopper (sm_90): NVFP4 operands decoded exactly to BF16, BF16 MMA, FP32 accumulator.

``y[m, n] = out(f32(f32(f32(acc * a_dec[m]) * w_dec[n]) + bias[n]))`` (the contract's epilogue),
computed as ``Y^T = W @ A^T`` so that the weight, the operand decoded in registers, is the MMA's
left operand. Two kernels, one K order (``nvfp4_decode.CHUNK``):

- ``_w4a4_decode_gemm_kernel`` (M up to ``LARGE_M``, and MoE groups): loads code words and
  scales of both operands and decodes them in registers; per 256-element chunk one MMA chain per
  stream of nibbles (stream p: elements 8j + p), streams 0..7 in order.
- ``_bf16_gemm_kernel`` (M above ``LARGE_M``): both operands decoded once into BF16 scratch laid
  out in that same order, then a plain BF16 GEMM whose 16-wide MMA steps run through K in the
  same sequence.

Batch invariance: every configuration issues the same sequence of 16-element wgmma steps (Hopper's
warpgroup MMA, m64nNk16, weight on the left) into the accumulator of an output element: no
split-K, nothing chosen by M changes the K order, and an MMA output element depends only on its
own row and column. The older mma.sync instruction (m16n8k16) gives different bits (measured on
the H200), so configurations that would fall back to it are refused. Tests pin this bitwise.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .nvfp4_decode import CHUNK, CHUNK_K, code_words, decode_nvfp4_words, decode_operand

#: Both decoded operands carry 2^-7; the accumulator is rescaled by 2^14 (exact) in the epilogue.
ACC_SCALE = tl.constexpr(16384.0)
#: Above this many rows the GEMM decodes both operands to BF16 scratch first.
LARGE_M = 512
#: Triton's CPU interpreter keeps BF16 as raw uint16 and cannot multiply it: there the kernels
#: feed float32 copies of the (exact) BF16 operands to an IEEE float32 dot (kernel-logic tests).
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def mma(w, a, acc, INTERPRETED: tl.constexpr):
    """``acc + w @ a^T`` (BF16 MMA steps of 16 along K, in order, FP32 accumulator)."""
    if INTERPRETED:
        return tl.dot(w.to(tl.float32), tl.trans(a.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(w, tl.trans(a), acc)


@triton.jit
def epilogue_store(
    acc,
    acc_scale,
    a_dec_ptr,
    a_dec_stride,
    w_dec_ptr,
    w_dec_stride,
    bias_ptr,
    y_ptr,
    stride_ym,
    stride_yn,
    offs_n,
    offs_m,
    w_rows,
    n_ok,
    m_ok,
    HAS_BIAS: tl.constexpr,
):
    """Store ``out(f32(f32(f32(acc*acc_scale) * a_dec[m]) * w_dec[n]) + bias[n])`` for the tile
    ``acc`` [BLOCK_N, BLOCK_M] (rows of Y^T); the launch disables FMA contraction."""
    a_dec = tl.load(a_dec_ptr + offs_m * a_dec_stride, mask=m_ok, other=1.0)
    w_dec = tl.load(w_dec_ptr + w_rows * w_dec_stride, mask=n_ok, other=1.0)
    y = acc * acc_scale
    y = y * a_dec[None, :]
    y = y * w_dec[:, None]
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    out = y_ptr + offs_m[None, :].to(tl.int64) * stride_ym + offs_n[:, None] * stride_yn
    tl.store(out, y.to(y_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


@triton.jit
def _w4a4_decode_gemm_kernel(
    a_words,
    stride_aw,
    a_scales,
    stride_as,
    a_dec,
    a_dec_stride,
    w_words,
    stride_ww,
    w_scales,
    stride_ws,
    w_dec,
    w_dec_stride,
    bias,
    y,
    stride_ym,
    stride_yn,
    tiles,
    M,
    N,
    K,
    GROUPED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    USE_ASM: tl.constexpr,
    INTERPRETED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Y^T tile [BLOCK_N, BLOCK_M]. GROUPED: ``tiles[pid1]`` = (first row, end row, first weight
    row) of one expert's row tile; else rows pid1*BLOCK_M.. of A against weight rows 0..N-1."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    if GROUPED:
        row_start = tl.load(tiles + 3 * pid_m)
        row_end = tl.load(tiles + 3 * pid_m + 1)
        w_row0 = tl.load(tiles + 3 * pid_m + 2)
    else:
        row_start = pid_m * BLOCK_M
        row_end = M
        w_row0 = 0
    WORDS: tl.constexpr = CHUNK_K // 8
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = row_start + tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    m_ok = offs_m < row_end
    w_rows = w_row0 + offs_n
    w_rows64 = w_rows.to(tl.int64)
    a_rows64 = offs_m.to(tl.int64)
    offs_w = tl.arange(0, WORDS)
    offs_b = tl.arange(0, WORDS // 2)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(0, K, CHUNK_K):
        word = k0 // 8 + offs_w
        w_ok = n_ok[:, None] & (word < K // 8)[None, :]
        a_ok = m_ok[:, None] & (word < K // 8)[None, :]
        ww = tl.load(w_words + w_rows64[:, None] * stride_ww + word[None, :], mask=w_ok, other=0)
        blk = k0 // 16 + offs_b
        ws = tl.load(w_scales + w_rows64[:, None] * stride_ws + blk[None, :],
                     mask=n_ok[:, None] & (blk < K // 16)[None, :], other=0)  # fmt: skip
        ws = tl.reshape(tl.broadcast_to(ws[:, :, None], [BLOCK_N, WORDS // 2, 2]), [BLOCK_N, WORDS])
        aw = tl.load(a_words + a_rows64[:, None] * stride_aw + word[None, :], mask=a_ok, other=0)
        as_ = tl.load(a_scales + a_rows64[:, None] * stride_as + blk[None, :],
                      mask=m_ok[:, None] & (blk < K // 16)[None, :], other=0)  # fmt: skip
        as_ = tl.reshape(
            tl.broadcast_to(as_[:, :, None], [BLOCK_M, WORDS // 2, 2]), [BLOCK_M, WORDS]
        )
        w = decode_nvfp4_words(ww, ws, USE_ASM)
        a = decode_nvfp4_words(aw, as_, USE_ASM)
        for p in tl.static_range(8):
            acc = mma(w[p], a[p], acc, INTERPRETED)
    epilogue_store(
        acc, ACC_SCALE, a_dec, a_dec_stride, w_dec, w_dec_stride, bias, y, stride_ym, stride_yn,
        offs_n, offs_m, w_rows, n_ok, m_ok, HAS_BIAS,
    )  # fmt: skip


@triton.jit
def _bf16_gemm_kernel(
    wd,
    stride_wd,
    ad,
    stride_ad,
    a_dec,
    a_dec_stride,
    w_dec,
    w_dec_stride,
    bias,
    y,
    stride_ym,
    stride_yn,
    M,
    N,
    K_PADDED,
    HAS_BIAS: tl.constexpr,
    INTERPRETED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_N: tl.constexpr,
):
    """Y^T tile of pre-decoded operands ``wd`` [N, K_PADDED], ``ad`` [M, K_PADDED] (BF16, the
    decode GEMM's K order), tiles visited GROUP_N weight tiles at a time for L2 reuse."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles_m = tl.cdiv(M, BLOCK_M)
    per_group = GROUP_N * tiles_m
    first_n = (pid // per_group) * GROUP_N
    group_n = min(tiles_n - first_n, GROUP_N)
    pid_n = first_n + (pid % per_group) % group_n
    pid_m = (pid % per_group) // group_n
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    m_ok = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = wd + offs_n[:, None].to(tl.int64) * stride_wd + offs_k[None, :]
    a_ptrs = ad + offs_m[:, None].to(tl.int64) * stride_ad + offs_k[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for _ in range(0, K_PADDED, BLOCK_K):
        w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        a = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
        acc = mma(w, a, acc, INTERPRETED)
        w_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    epilogue_store(
        acc, ACC_SCALE, a_dec, a_dec_stride, w_dec, w_dec_stride, bias, y, stride_ym, stride_yn,
        offs_n, offs_m, offs_n, n_ok, m_ok, HAS_BIAS,
    )  # fmt: skip


@dataclass(frozen=True)
class DecodeConfig:
    """Tiles of the decode GEMM (none of them changes the K order). BLOCK_N is a multiple of 64
    and warps come in warpgroups of 4, so that the MMA is always wgmma (m64nNk16)."""

    block_n: int
    block_m: int
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        if self.block_n % 64 or self.num_warps % 4 or self.block_m % 8:
            raise ValueError(f"{self}: needs block_n % 64 == 0 and num_warps % 4 == 0 (wgmma)")


@dataclass(frozen=True)
class LargeConfig:
    """Tiles of the pre-decoded BF16 GEMM (BLOCK_K divides CHUNK: the K order is unchanged)."""

    block_n: int = 128
    block_m: int = 256
    block_k: int = 64
    group_n: int = 8
    num_warps: int = 8
    num_stages: int = 3

    def __post_init__(self) -> None:
        if self.block_n % 64 or self.num_warps % 4 or CHUNK % self.block_k:
            raise ValueError(f"{self}: needs block_n % 64, num_warps % 4 (wgmma), CHUNK % block_k")


#: Options chosen from the H200 measurements in benchmarks/NOTES_kernels.md.
USE_ASM_DECODE = True
LARGE_CONFIG = LargeConfig()


def decode_config(rows: int) -> DecodeConfig:
    """The decode GEMM's tiles for ``rows`` rows of A (per group for MoE)."""
    if rows <= 16:
        return DecodeConfig(64, 16, 4, 4)
    if rows <= 64:
        return DecodeConfig(64, 64, 4, 3)
    return DecodeConfig(128, 128, 8, 3)


def _vector_arg(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A float32 decode scale as (pointer, stride): 0-d tensors are read with stride 0."""
    return t, (t.stride(0) if t.dim() else 0)


def _check_operands(a, w, bias: torch.Tensor | None) -> None:
    if a.cols % 16 or a.cols != w.cols:
        raise ValueError(f"W4A4 GEMM: K mismatch or not a multiple of 16 ({a.cols}, {w.cols})")
    for t in (a, w):
        if t.codes.stride(1) != 1 or t.scales.stride(1) != 1:
            raise ValueError("W4A4 GEMM: codes and scales must be row-contiguous")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != w.rows):
        raise ValueError(f"W4A4 GEMM: bias must be [{w.rows}], got {list(bias.shape)}")


def nvfp4_gemm_sm90(
    a,
    w,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    config: DecodeConfig | LargeConfig | None = None,
    use_asm: bool | None = None,
) -> torch.Tensor:
    """``a @ w.T`` for NVFP4Tensors ``a`` [M, K], ``w`` [N, K] on an sm_90 GPU, the contract's
    epilogue, ``out_dtype`` [M, N]. ``config``/``use_asm`` override the defaults (tests,
    benchmarks); every choice gives the same bits."""
    _check_operands(a, w, bias)
    m, n, k = a.rows, w.rows, a.cols
    use_asm = USE_ASM_DECODE if use_asm is None else use_asm
    y = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return y
    a_dec, a_dec_stride = _vector_arg(a.decode_scale)
    w_dec, w_dec_stride = _vector_arg(w.decode_scale)
    bias_arg = bias if bias is not None else a_dec
    if config is None:
        config = LARGE_CONFIG if m > LARGE_M else decode_config(m)
    if isinstance(config, LargeConfig):
        wd = decode_operand(w.codes, w.scales, use_asm=use_asm)
        ad = decode_operand(a.codes, a.scales, use_asm=use_asm)
        c = config
        grid = (triton.cdiv(n, c.block_n) * triton.cdiv(m, c.block_m),)
        _bf16_gemm_kernel[grid](
            wd, wd.stride(0), ad, ad.stride(0), a_dec, a_dec_stride, w_dec, w_dec_stride,
            bias_arg, y, y.stride(0), y.stride(1), m, n, wd.shape[1],
            HAS_BIAS=bias is not None, INTERPRETED=_INTERPRETED,
            BLOCK_N=c.block_n, BLOCK_M=c.block_m, BLOCK_K=c.block_k,
            GROUP_N=c.group_n, num_warps=c.num_warps, num_stages=c.num_stages,
            enable_fp_fusion=False,
        )  # fmt: skip
        return y
    c = config
    aw, ww = code_words(a.codes), code_words(w.codes)
    grid = (triton.cdiv(n, c.block_n), triton.cdiv(m, c.block_m))
    _w4a4_decode_gemm_kernel[grid](
        aw, aw.stride(0), a.scales.view(torch.uint8), a.scales.stride(0), a_dec, a_dec_stride,
        ww, ww.stride(0), w.scales.view(torch.uint8), w.scales.stride(0),
        w_dec, w_dec_stride, bias_arg, y, y.stride(0), y.stride(1), a_dec, m, n, k,
        GROUPED=False, HAS_BIAS=bias is not None, USE_ASM=use_asm,
        INTERPRETED=_INTERPRETED, BLOCK_N=c.block_n, BLOCK_M=c.block_m,
        num_warps=c.num_warps, num_stages=c.num_stages,
        enable_fp_fusion=False,
    )  # fmt: skip
    return y


@functools.lru_cache(maxsize=256)
def group_tiles(sizes: tuple[int, ...], n: int, block_m: int, device: torch.device) -> torch.Tensor:
    """int32 [tiles, 3]: (first row, end row, first weight row) of each expert's row tile.

    Cached, so that a repeated routing (CUDA-graph capture, replays) copies nothing to the GPU."""
    rows: list[int] = []
    start = 0
    for g, size in enumerate(sizes):
        for r in range(start, start + size, block_m):
            rows += [r, start + size, g * n]
        start += size
    return torch.tensor(rows, dtype=torch.int32).view(-1, 3).to(device)


def grouped_nvfp4_gemm_sm90(
    a,
    w,
    sizes: list[int],
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    config: DecodeConfig | None = None,
    use_asm: bool | None = None,
) -> torch.Tensor:
    """MoE experts: ``a`` [T, K] rows grouped by expert (``sizes``), ``w`` [G*N, K] stacked; row t
    of group g gets bitwise what the dense GEMM gives it against expert g's rows."""
    _check_operands(a, w, None)
    n, k = w.rows // len(sizes), a.cols
    use_asm = USE_ASM_DECODE if use_asm is None else use_asm
    y = torch.empty(a.rows, n, dtype=out_dtype, device=a.device)
    if a.rows == 0 or n == 0:
        return y
    c = config or decode_config(max(sizes))
    tiles = group_tiles(tuple(sizes), n, c.block_m, a.device)
    a_dec, a_dec_stride = _vector_arg(a.decode_scale)
    w_dec, w_dec_stride = _vector_arg(w.decode_scale)
    aw, ww = code_words(a.codes), code_words(w.codes)
    grid = (triton.cdiv(n, c.block_n), tiles.shape[0])
    _w4a4_decode_gemm_kernel[grid](
        aw, aw.stride(0), a.scales.view(torch.uint8), a.scales.stride(0), a_dec, a_dec_stride,
        ww, ww.stride(0), w.scales.view(torch.uint8), w.scales.stride(0),
        w_dec, w_dec_stride, a_dec, y, y.stride(0), y.stride(1), tiles, a.rows, n, k,
        GROUPED=True, HAS_BIAS=False, USE_ASM=use_asm,
        INTERPRETED=_INTERPRETED, BLOCK_N=c.block_n, BLOCK_M=c.block_m,
        num_warps=c.num_warps, num_stages=c.num_stages,
        enable_fp_fusion=False,
    )  # fmt: skip
    return y


def gemm_path_sm90() -> str:
    """Kernel family and the configuration that fixes its K order (for execution fingerprints)."""
    return f"triton-sm90-bf16mma-chunk{CHUNK}-8streams-k16"
