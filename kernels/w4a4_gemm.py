"""W4A4 GEMM on Hopper (sm_90): NVFP4 operands decoded exactly to BF16, BF16 MMA, FP32 accumulator.

``y[m, n] = out(f32(f32(f32(acc * a_dec[m]) * w_dec[n]) + bias[n]))`` (the contract's epilogue),
computed as ``Y^T = W @ A^T`` so that the weight, the operand decoded in registers, is the MMA's
left operand.

K order (contract v2, docs/contract.md "Accumulation order"): K is cut into fold chunks of
``FOLD`` = 512 elements (the last one may be shorter). Each chunk's partial sum is one chain of
16-element wgmma steps (Hopper's warpgroup MMA, m64nNk16, weight on the left) starting from zero:
per 128-element decode chunk the 8 nibble streams in order (``nvfp4_decode``). The chunk partials
are then folded in float32, ``acc = (((0 + p0) + p1) + ...)``, in chunk order. Every kernel
below computes exactly this, so a row's result depends on nothing else in the batch:

- ``_w4a4_decode_gemm_kernel`` (M up to ``LARGE_M``, and MoE groups of fewer rows on average):
  decodes both operands in
  registers. At small M it splits K across programs along chunk boundaries (more programs in
  flight): each program writes its chunks' partials to a float32 workspace, and the last program
  of a tile to finish (an atomic counter) folds all of them in chunk order and stores the tile.
  Whether and how much it splits changes the schedule, never the bits.
- ``_bf16_gemm_kernel`` (M above ``LARGE_M``, and MoE groups averaging above it, the learner's
  expert forward): both operands decoded once into BF16 scratch in the
  same element order, then a BF16 GEMM running the same wgmma chain per chunk and the same fold,
  its tiles loaded by the Tensor Memory Accelerator (TMA descriptors; plain loads in Triton's
  interpreter): the same bits either way.

Triton's fallback to the older mma.sync instruction (m16n8k16), taken where a warpgroup would get
fewer than 64 weight rows, gave different bits (measured on the H200), so configurations that
would take it are refused. (The instruction is not the cause: a CUDA C++ chain of mma.sync
m16n8k16 in the same k16 order gave wgmma's bits on every point tried, benchmarks/NOTES_kernels.md.)
Tests pin all of this bitwise.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

from . import w4a4_gemm_cuda
from .nvfp4_decode import CHUNK, CHUNK_K, code_words, decode_nvfp4_words, decode_operand
from .nvfp4_grouped import sizes_on_device

#: K elements per fold chunk: one MMA chain each, the chains folded in order (contract v2).
FOLD = 512
#: Both decoded operands carry 2^-7; the accumulator is rescaled by 2^14 (exact) in the epilogue.
ACC_SCALE = tl.constexpr(16384.0)
#: Above this many rows the GEMM decodes both operands to BF16 scratch first.
LARGE_M = 512
#: Split K only while the chunk-partials workspace stays this small (it lives in L2).
SPLIT_WORKSPACE_BYTES = 32 << 20
#: Split K until about this many programs per SM are in flight.
SPLIT_PROGRAMS_PER_SM = 4
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
def _group_tile(sizes_ptr, G, pid_m, M, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr):
    """Row tile ``pid_m`` of rows grouped by expert (group g: ``sizes[g]`` consecutive rows, each
    group's rows cut into BLOCK_M tiles): (first row, end row, group); group G: no such tile.
    Sizes on the device are not checked on the host: each is clamped to [0, M] (so a huge size
    cannot wrap the int32 sums), and rows past M are neither read nor written."""
    offs_g = tl.arange(0, BLOCK_G)
    sizes = tl.load(sizes_ptr + offs_g, mask=offs_g < G, other=0)
    sizes = tl.minimum(tl.maximum(sizes, 0), M).to(tl.int32)
    tiles = (sizes + BLOCK_M - 1) // BLOCK_M
    tiles_end = tl.cumsum(tiles, 0)
    rows_end = tl.cumsum(sizes, 0)
    g = tl.sum((tiles_end <= pid_m).to(tl.int32), 0)
    here = offs_g == g
    first_tile = tl.sum(tl.where(here, tiles_end - tiles, 0), 0)
    end_row = tl.minimum(tl.sum(tl.where(here, rows_end, 0), 0), M)
    first_row = tl.sum(tl.where(here, rows_end - sizes, 0), 0) + (pid_m - first_tile) * BLOCK_M
    return first_row, end_row, g


@triton.jit
def _row_tile(
    sizes, G, pid_m, M, N, GROUPED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr
):
    """Row tile ``pid_m``: (first row, end row, its first weight row, whether it exists), of the
    expert-grouped rows against their expert's weight rows (GROUPED) or of A."""
    if GROUPED:
        row_start, row_end, group = _group_tile(sizes, G, pid_m, M, BLOCK_M, BLOCK_G)
        return row_start, row_end, group * N, group < G
    return pid_m * BLOCK_M, M, 0, True


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
    ad,
    stride_ad,
    sizes,
    partials,
    counters,
    M,
    N,
    K,
    G,
    chunks_per_split,
    GROUPED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    USE_ASM: tl.constexpr,
    INTERPRETED: tl.constexpr,
    SPLIT: tl.constexpr,
    PARTIALS_ONLY: tl.constexpr,
    A_DECODED: tl.constexpr,
    EVEN_K: tl.constexpr,
    FOLD_SIZE: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    """Y^T tile [BLOCK_N, BLOCK_M], fold chunks [pid2*chunks_per_split, +chunks_per_split).
    GROUPED: row tile pid1 of the expert-grouped rows (``sizes`` [G] on the device), against its
    expert's weight rows; else rows pid1*BLOCK_M.. of A against weight rows 0..N-1. SPLIT: write
    chunk partials to ``partials`` [chunks, M, N]; the tile's last program folds and stores
    (PARTIALS_ONLY: nobody folds, the partials are the result). PDL: launched as a programmatic
    dependent of the previous kernel (the activation's quantizer), so wait for it first."""
    if PDL:
        gdc_wait()
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    row_start, row_end, w_row0, exists = _row_tile(sizes, G, pid_m, M, N, GROUPED, BLOCK_M, BLOCK_G)
    if not exists:
        return
    WORDS: tl.constexpr = CHUNK_K // 8
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = row_start + tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    m_ok = offs_m < row_end
    w_rows = w_row0 + offs_n
    # Loads read clamped rows (a tail tile repeats the last valid row) and need no row masks;
    # only the stores are masked. K is masked only when it is not a multiple of CHUNK.
    w_rows64 = (w_row0 + tl.minimum(offs_n, N - 1)).to(tl.int64)
    a_rows64 = tl.minimum(offs_m, row_end - 1).to(tl.int64)
    offs_w = tl.arange(0, WORDS)
    offs_b = tl.arange(0, WORDS // 2)
    n_chunks = tl.cdiv(K, FOLD_SIZE)
    first = tl.program_id(2) * chunks_per_split
    last = tl.minimum(first + chunks_per_split, n_chunks)
    part_ptrs = partials + offs_m.to(tl.int64)[None, :] * N + offs_n[:, None]
    tile_ok = n_ok[:, None] & m_ok[None, :]
    w_word_ptrs = w_words + w_rows64[:, None] * stride_ww + offs_w[None, :]
    w_scale_ptrs = w_scales + w_rows64[:, None] * stride_ws + offs_b[None, :]
    a_word_ptrs = a_words + a_rows64[:, None] * stride_aw + offs_w[None, :]
    a_scale_ptrs = a_scales + a_rows64[:, None] * stride_as + offs_b[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    part = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    # One flat loop over this program's chunks; at each fold-chunk end the chunk's chain goes to
    # the workspace (SPLIT) or joins acc.
    for k0 in range(first * FOLD_SIZE, tl.minimum(last * FOLD_SIZE, K), CHUNK_K):
        if EVEN_K:
            ww = tl.load(w_word_ptrs + k0 // 8)
            ws = tl.load(w_scale_ptrs + k0 // 16)
        else:
            w_ok = (k0 // 8 + offs_w < K // 8)[None, :]
            ww = tl.load(w_word_ptrs + k0 // 8, mask=w_ok, other=0)
            ws = tl.load(w_scale_ptrs + k0 // 16, mask=(k0 // 16 + offs_b < K // 16)[None, :],
                         other=0)  # fmt: skip
        ws = tl.reshape(tl.broadcast_to(ws[:, :, None], [BLOCK_N, WORDS // 2, 2]), [BLOCK_N, WORDS])
        w = decode_nvfp4_words(ww, ws, USE_ASM)
        if not A_DECODED:
            if EVEN_K:
                aw = tl.load(a_word_ptrs + k0 // 8)
                as_ = tl.load(a_scale_ptrs + k0 // 16)
            else:
                aw = tl.load(a_word_ptrs + k0 // 8, mask=(k0 // 8 + offs_w < K // 8)[None, :],
                             other=0)  # fmt: skip
                as_ = tl.load(a_scale_ptrs + k0 // 16,
                              mask=(k0 // 16 + offs_b < K // 16)[None, :], other=0)  # fmt: skip
            as_ = tl.reshape(
                tl.broadcast_to(as_[:, :, None], [BLOCK_M, WORDS // 2, 2]), [BLOCK_M, WORDS]
            )
            a = decode_nvfp4_words(aw, as_, USE_ASM)
        for p in tl.static_range(8):
            if A_DECODED:
                a_p = tl.load(ad + a_rows64[:, None] * stride_ad + (k0 + p * WORDS)
                              + offs_w[None, :])  # fmt: skip
            else:
                a_p = a[p]
            part = mma(w[p], a_p, part, INTERPRETED)
        if (k0 + CHUNK_K) % FOLD_SIZE == 0 or k0 + CHUNK_K >= K:
            if SPLIT:
                tl.store(part_ptrs + (k0 // FOLD_SIZE) * M * N, part, mask=tile_ok)
            else:
                acc = acc + part
            part = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    if PARTIALS_ONLY:
        return
    if SPLIT:
        # Publish this program's partials; the tile's last program folds all of them in order.
        tl.debug_barrier()
        tile = pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(counters + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == tl.num_programs(2) - 1:
            for c in range(0, n_chunks):
                part = tl.load(part_ptrs + c * M * N, mask=tile_ok, other=0.0,
                               cache_modifier=".cg")  # fmt: skip
                acc = acc + part
            epilogue_store(
                acc, ACC_SCALE, a_dec, a_dec_stride, w_dec, w_dec_stride, bias, y, stride_ym,
                stride_yn, offs_n, offs_m, w_rows, n_ok, m_ok, HAS_BIAS,
            )  # fmt: skip
            tl.atomic_xchg(counters + tile, 0, sem="relaxed", scope="gpu")
    else:
        epilogue_store(
            acc, ACC_SCALE, a_dec, a_dec_stride, w_dec, w_dec_stride, bias, y, stride_ym,
            stride_yn, offs_n, offs_m, w_rows, n_ok, m_ok, HAS_BIAS,
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
    sizes,
    M,
    N,
    K_PADDED,
    G,
    TILES_M,
    GROUPED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    INTERPRETED: tl.constexpr,
    TMA: tl.constexpr,
    FOLD_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_G: tl.constexpr,
    GROUP_N: tl.constexpr,
):
    """Y^T tile of pre-decoded operands ``wd`` [N, K_PADDED] (GROUPED: [G*N, K_PADDED]), ``ad``
    [M, K_PADDED] (BF16, the decode GEMM's element order), one MMA chain per fold chunk, chunks
    folded in order; tiles visited GROUP_N weight tiles at a time for L2 reuse. GROUPED: row
    tile pid_m of the expert-grouped rows (``sizes`` [G] on the device; TILES_M bounds the row
    tiles) against its expert's weight rows. TMA: ``wd`` / ``ad`` are TMA descriptors of blocks
    [BLOCK_N, BLOCK_K] / [BLOCK_M, BLOCK_K] (zeros outside the tensors), else pointers (strides
    ``stride_wd`` / ``stride_ad``). Rows loaded past a group's end or an expert's N rows only
    reach masked outputs."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_N * TILES_M
    first_n = (pid // per_group) * GROUP_N
    group_n = min(tiles_n - first_n, GROUP_N)
    pid_n = first_n + (pid % per_group) % group_n
    pid_m = (pid % per_group) // group_n
    row_start, row_end, w_row0, exists = _row_tile(sizes, G, pid_m, M, N, GROUPED, BLOCK_M, BLOCK_G)
    if not exists:
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = row_start + tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    m_ok = offs_m < row_end
    if not TMA:
        offs_k = tl.arange(0, BLOCK_K)
        w_rows64 = (w_row0 + tl.minimum(offs_n, N - 1)).to(tl.int64)
        a_rows64 = tl.minimum(offs_m, row_end - 1).to(tl.int64)
        w_ptrs = wd + w_rows64[:, None] * stride_wd + offs_k[None, :]
        a_ptrs = ad + a_rows64[:, None] * stride_ad + offs_k[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    part = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    # One flat (software-pipelined) loop; at each fold-chunk end the chunk's chain joins acc.
    for k in range(0, K_PADDED, BLOCK_K):
        if TMA:
            w = wd.load([w_row0 + pid_n * BLOCK_N, k])
            a = ad.load([row_start, k])
        else:
            w = tl.load(w_ptrs + k)
            a = tl.load(a_ptrs + k)
        part = mma(w, a, part, INTERPRETED)
        if (k + BLOCK_K) % FOLD_SIZE == 0:
            acc = acc + part
            part = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    acc = acc + part  # a last, shorter chunk (adding +0 to acc, which is never -0, changes nothing)
    epilogue_store(
        acc, ACC_SCALE, a_dec, a_dec_stride, w_dec, w_dec_stride, bias, y, stride_ym, stride_yn,
        offs_n, offs_m, w_row0 + offs_n, n_ok, m_ok, HAS_BIAS,
    )  # fmt: skip


@dataclass(frozen=True)
class DecodeConfig:
    """Tiles of the decode GEMM (none of them changes the K order). BLOCK_N is a multiple of 64
    and warps come in warpgroups of 4, so that the MMA is always wgmma (m64nNk16). ``split_k``:
    programs along K per tile (0: chosen from the shape; 1: no split). ``a_decoded``: decode the
    activation once to BF16 (``decode_operand``) and stream it, instead of per program."""

    block_n: int
    block_m: int
    num_warps: int
    num_stages: int
    split_k: int = 0
    a_decoded: bool = False

    def __post_init__(self) -> None:
        if self.block_n % 64 or self.num_warps % 4 or self.block_m % 8 or self.split_k < 0:
            raise ValueError(f"{self}: needs block_n % 64 == 0 and num_warps % 4 == 0 (wgmma)")


@dataclass(frozen=True)
class LargeConfig:
    """Tiles of the pre-decoded BF16 GEMM (BLOCK_K divides CHUNK: the K order is unchanged);
    ``tma``: load them through TMA descriptors (ignored in Triton's interpreter)."""

    block_n: int = 128
    block_m: int = 256
    block_k: int = 64
    group_n: int = 8
    num_warps: int = 8
    num_stages: int = 3
    tma: bool = True

    def __post_init__(self) -> None:
        if self.block_n % 64 or self.num_warps % 4 or CHUNK % self.block_k:
            raise ValueError(f"{self}: needs block_n % 64, num_warps % 4 (wgmma), CHUNK % block_k")


#: Options chosen from the H200 measurements in benchmarks/NOTES_kernels.md.
USE_ASM_DECODE = True
LARGE_CONFIG = LargeConfig()


def decode_config(rows: int) -> DecodeConfig:
    """The decode GEMM's tiles for ``rows`` rows of A (per group for MoE)."""
    if rows <= 16:
        return DecodeConfig(128, 16, 4, 2)
    if rows <= 32:
        return DecodeConfig(128, 32, 4, 2)
    if rows <= 64:
        return DecodeConfig(128, 64, 8, 3)
    return DecodeConfig(128, 128, 8, 3, split_k=1)


#: The grouped decode GEMM's tiles where groups average at most one row (MoE decode steps of up
#: to 16 tokens at top-8 of 128 experts): 8-row tiles (m64n8 wgmma), three stages, K split only
#: where it spares a program two fold chunks (:func:`_splits`). On the H200 (2026-12-04, routings
#: rotated past L2) the 8-row tiles ran 0.85-0.93x the 16-row tiles' time at 1 / 4 / 16 tokens on
#: the Qwen3-30B-A3B experts; the stages and the split rule, benchmarks/NOTES_kernels.md
#: (twentieth session). Same bits.
GROUPED_FEW_ROWS_CONFIG = DecodeConfig(128, 8, 4, 3)


def _large_wanted(m: int, k: int) -> bool:
    """Where the Triton kernels serve an M-row GEMM, whether the large-M kernel does: M above
    LARGE_M, and M above 256 where K % 128 != 0 (on Hopper the register-A CUDA C++ kernels serve
    such K where they are on; without them, on the H200 the decode GEMM's 128 x 128 tiles took
    1.5-2.5x this kernel's time at M = 384 on four such shapes, 4112 x 4112 128.6 against
    67.7 us; benchmarks/NOTES_kernels.md, 21st session)."""
    return m > LARGE_M or (m > w4a4_gemm_cuda.MAX_M and k % CHUNK != 0)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # Triton's interpreter: a few programs, so that tests split
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def _chunks_per_split(cfg: DecodeConfig, tiles: int, rows: int, n: int, k: int, device) -> int:
    """Fold chunks per program along K (all of them: no split) for a launch of ``tiles`` tiles."""
    n_chunks = triton.cdiv(k, FOLD)
    if cfg.split_k == 1 or n_chunks == 1 or tiles > w4a4_gemm_cuda.MAX_SPLIT_TILES:
        return n_chunks
    if cfg.split_k:
        splits = cfg.split_k
    else:
        if n_chunks * rows * n * 4 > SPLIT_WORKSPACE_BYTES:
            return n_chunks
        splits = _splits(cfg.block_m, tiles, n_chunks, _num_sms(device))
    return triton.cdiv(n_chunks, max(1, min(splits, n_chunks)))


def _splits(block_m: int, tiles: int, n_chunks: int, sms: int) -> int:
    """The automatic split count along K (1: none) of a launch of ``tiles`` tiles of ``block_m``
    rows over ``n_chunks`` fold chunks: about SPLIT_PROGRAMS_PER_SM programs per SM; MMA-heavy
    tiles (more than 16 rows) only when the launch is under-filled. 8-row tiles (the grouped
    decode steps) stay within that many programs per SM and split only where a program is spared
    at least two fold chunks: the split's partials, counter and fold cost about as much as one
    fold chunk of a latency-bound program (H200, 2026-12-04: 0.78-0.90x the time where this keeps
    the whole K per program, on 768 / 1024 / 1408 / 1536 -> 2048-4096 experts at 1-4 tokens)."""
    if block_m > 16 and 2 * tiles >= sms:
        return 1
    if block_m > 8:
        return triton.cdiv(SPLIT_PROGRAMS_PER_SM * sms, tiles)
    splits = min(max(1, SPLIT_PROGRAMS_PER_SM * sms // tiles), n_chunks)
    return splits if n_chunks - triton.cdiv(n_chunks, splits) >= 2 else 1


def _vector_arg(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A float32 decode scale as (pointer, stride): 0-d tensors are read with stride 0."""
    return t, (t.stride(0) if t.dim() else 0)


def _check_operands(a, w, bias: torch.Tensor | None) -> None:
    if a.cols % 16 or a.cols != w.cols:
        raise ValueError(f"W4A4 GEMM: K mismatch or not a multiple of 16 ({a.cols}, {w.cols})")
    for t in (a, w):
        if t.codes.stride(1) != 1 or t.scales.stride(1) != 1:
            raise ValueError("W4A4 GEMM: codes and scales must be row-contiguous")
    _check_bias(w, bias)


def _check_bias(w, bias: torch.Tensor | None) -> None:
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != w.rows):
        raise ValueError(f"W4A4 GEMM: bias must be [{w.rows}], got {list(bias.shape)}")


def _launch_decode_gemm(
    a,
    w,
    bias,
    y,
    n: int,
    tiles_m: int,
    sizes,
    cfg: DecodeConfig,
    use_asm: bool,
    partials: torch.Tensor | None = None,
) -> None:
    """One launch of the decode GEMM over ``tiles_m`` row tiles (grouped when ``sizes``); with
    ``partials`` ([chunks, M, N] float32) it writes every fold chunk's partial there instead."""
    m, k = a.rows, a.cols
    tiles_n = triton.cdiv(n, cfg.block_n)
    per_split = _chunks_per_split(cfg, tiles_n * tiles_m, m, n, k, a.device)
    splits = triton.cdiv(triton.cdiv(k, FOLD), per_split)
    partials_only = partials is not None
    a_dec, a_dec_stride = _vector_arg(a.decode_scale)
    w_dec, w_dec_stride = _vector_arg(w.decode_scale)
    ad = decode_operand(a.codes, a.scales, use_asm=use_asm) if cfg.a_decoded else a.decode_scale
    if ad.dim() == 0:
        ad = ad.reshape(1)
    if partials_only:
        counters = a_dec
    elif splits > 1:
        partials = torch.empty(triton.cdiv(k, FOLD), m, n, dtype=torch.float32, device=a.device)
        counters = w4a4_gemm_cuda.split_counters(a.device)
    else:
        partials = counters = a_dec
    groups = sizes.numel() if sizes is not None else 1
    aw, ww = code_words(a.codes), code_words(w.codes)
    # programmatic dependent launch on the GPU: the programs start (launch, set-up) while the
    # activation's quantizer, which triggers it at its start, still runs
    pdl = a.codes.is_cuda
    launch = {"launch_pdl": True} if pdl else {}
    _w4a4_decode_gemm_kernel[(tiles_n, tiles_m, splits)](
        aw, aw.stride(0), a.scales.view(torch.uint8), a.scales.stride(0), a_dec, a_dec_stride,
        ww, ww.stride(0), w.scales.view(torch.uint8), w.scales.stride(0), w_dec, w_dec_stride,
        bias if bias is not None else a_dec, y, y.stride(0), y.stride(1), ad, ad.stride(0),
        sizes if sizes is not None else a_dec, partials, counters, m, n, k, groups, per_split,
        GROUPED=sizes is not None, HAS_BIAS=bias is not None, USE_ASM=use_asm,
        INTERPRETED=_INTERPRETED, SPLIT=splits > 1 or partials_only,
        PARTIALS_ONLY=partials_only, A_DECODED=cfg.a_decoded,
        EVEN_K=k % CHUNK == 0, FOLD_SIZE=FOLD, PDL=pdl,
        BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m,
        BLOCK_G=triton.next_power_of_2(groups), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, enable_fp_fusion=False, **launch,
    )  # fmt: skip


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
    m, n = a.rows, w.rows
    use_asm = USE_ASM_DECODE if use_asm is None else use_asm
    y = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return y
    if config is None:
        if w4a4_gemm_cuda.serves(a, w, y):
            w4a4_gemm_cuda.gemm(a, w, bias, y, _num_sms(a.device))
            return y
        config = LARGE_CONFIG if _large_wanted(m, a.cols) else decode_config(m)
    if isinstance(config, DecodeConfig):
        _launch_decode_gemm(a, w, bias, y, n, triton.cdiv(m, config.block_m), None, config, use_asm)
        return y
    _launch_bf16_gemm(a, w, bias, y, n, None, config, use_asm)
    return y


def quantized_rows_gemm_sm90(
    x: torch.Tensor, w, bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor | None:
    """``quantize(x) @ w.T`` (the contract's activation quantizer, per-row amax) for BF16 rows
    ``x`` [M, K] where the CUDA C++ GEMM's activation pass quantizes them itself, one launch
    instead of the quantizer's and the image's (``w4a4_gemm_cuda.rows_plan``: 16 < M <= 256 on
    the register-A and warp-specialized wide-M and the mid-M kernels, 8 < M <= 16 on the streamed
    kernel for a weight with its unit layout, and M = 1 at K <= 4096 on the streamed kernel,
    which then quantizes the row itself); None elsewhere, where the
    caller quantizes and calls :func:`nvfp4_gemm_sm90`. The same bits either way."""
    if x.dim() != 2 or x.shape[1] != w.cols:
        raise ValueError(f"W4A4 GEMM: x must be [M, {w.cols}], got {list(x.shape)}")
    _check_bias(w, bias)
    how = w4a4_gemm_cuda.rows_plan(x, w, out_dtype)
    if how is None:
        return None
    y = torch.empty(x.shape[0], w.rows, dtype=out_dtype, device=x.device)
    w4a4_gemm_cuda.gemm_rows(x, w, bias, y, how)
    return y


def _launch_bf16_gemm(a, w, bias, y, n: int, sizes, cfg: LargeConfig, use_asm: bool) -> None:
    """Both operands decoded into BF16 scratch, then one launch of the pre-decoded GEMM (grouped
    by expert when ``sizes``, a device tensor)."""
    m = a.rows
    groups = sizes.numel() if sizes is not None else 1
    tiles_m = triton.cdiv(m, cfg.block_m) + (groups if sizes is not None else 0)
    a_dec, a_dec_stride = _vector_arg(a.decode_scale)
    w_dec, w_dec_stride = _vector_arg(w.decode_scale)
    wd = decode_operand(w.codes, w.scales, use_asm=use_asm)
    ad = decode_operand(a.codes, a.scales, use_asm=use_asm)
    tma = cfg.tma and not _INTERPRETED
    if tma:
        w_src = TensorDescriptor.from_tensor(wd, [cfg.block_n, cfg.block_k])
        a_src = TensorDescriptor.from_tensor(ad, [cfg.block_m, cfg.block_k])
    else:
        w_src, a_src = wd, ad
    grid = (triton.cdiv(n, cfg.block_n) * tiles_m,)
    _bf16_gemm_kernel[grid](
        w_src, wd.stride(0), a_src, ad.stride(0), a_dec, a_dec_stride, w_dec, w_dec_stride,
        bias if bias is not None else a_dec, y, y.stride(0), y.stride(1),
        sizes if sizes is not None else a_dec, m, n, wd.shape[1], groups, tiles_m,
        GROUPED=sizes is not None, HAS_BIAS=bias is not None, INTERPRETED=_INTERPRETED,
        TMA=tma, FOLD_SIZE=FOLD, BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m,
        BLOCK_K=cfg.block_k, BLOCK_G=triton.next_power_of_2(groups), GROUP_N=cfg.group_n,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False,
    )  # fmt: skip


def nvfp4_gemm_partials_sm90(
    a, w, *, config: DecodeConfig | None = None, use_asm: bool | None = None
) -> torch.Tensor:
    """The fold-chunk partial sums of ``a @ w.T`` (float32 [ceil(K/FOLD), M, N], in the kernels'
    units): each the chunk's MMA chain from zero, exactly what :func:`nvfp4_gemm_sm90` folds. A
    shard of K that starts on a multiple of ``FOLD`` gives bitwise the full GEMM's partials of
    its chunks, so :func:`fold_partials` over the shards' partials in order equals the full GEMM
    (the deterministic tensor-parallel combine)."""
    _check_operands(a, w, None)
    m, n, k = a.rows, w.rows, a.cols
    partials = torch.empty(triton.cdiv(k, FOLD), m, n, dtype=torch.float32, device=a.device)
    if m == 0 or n == 0:
        return partials
    cfg = config or decode_config(min(m, LARGE_M))
    use_asm = USE_ASM_DECODE if use_asm is None else use_asm
    _launch_decode_gemm(
        a, w, None, partials, n, triton.cdiv(m, cfg.block_m), None, cfg, use_asm, partials
    )
    return partials


def fold_partials(
    partials: torch.Tensor,
    a_decode_scale: torch.Tensor,
    w_decode_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``out(f32(f32(f32(fold * 2^14) * a_dec[m]) * w_dec[n]) + bias[n])`` where ``fold`` adds
    the ``partials`` [C, M, N] to a zero float32 accumulator in order: the GEMM kernels' fold and
    epilogue, one IEEE operation at a time (bitwise the same)."""
    acc = torch.zeros(partials.shape[1:], dtype=torch.float32, device=partials.device)
    for part in partials:
        acc = acc + part
    y = acc * float(ACC_SCALE.value)
    a_dec = a_decode_scale.float()
    y = y * (a_dec[:, None] if a_dec.dim() else a_dec)
    y = y * w_decode_scale.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def grouped_nvfp4_gemm_sm90(
    a,
    w,
    sizes: torch.Tensor | list[int],
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    config: DecodeConfig | LargeConfig | None = None,
    use_asm: bool | None = None,
) -> torch.Tensor:
    """MoE experts: ``a`` [T, K] rows grouped by expert (``sizes`` [G], summing to T: a device
    tensor, read only by the kernel, so the call never synchronizes and can be captured in a CUDA
    graph; or a host list), ``w`` [G*N, K] stacked; row t of group g gets bitwise what the dense
    GEMM gives it against expert g's rows."""
    _check_operands(a, w, None)
    if not isinstance(sizes, torch.Tensor):
        sizes = sizes_on_device(tuple(int(s) for s in sizes), a.device)
    groups = sizes.numel()
    n, t = w.rows // groups, a.rows
    use_asm = USE_ASM_DECODE if use_asm is None else use_asm
    y = torch.empty(t, n, dtype=out_dtype, device=a.device)
    if t == 0 or n == 0:
        return y
    sizes = sizes.to(torch.int32)
    if config is None:
        per_group = triton.cdiv(2 * t, groups)  # twice the mean rows per group
        if t > LARGE_M * groups:
            config = LARGE_CONFIG
        else:
            config = GROUPED_FEW_ROWS_CONFIG if per_group <= 2 else decode_config(per_group)
    if isinstance(config, LargeConfig):
        _launch_bf16_gemm(a, w, None, y, n, sizes, config, use_asm)
        return y
    # Every row tile that exists holds at least one row: at most min(T, T/BLOCK_M + G) tiles.
    tiles_m = min(t, triton.cdiv(t, config.block_m) + groups)
    _launch_decode_gemm(a, w, None, y, n, tiles_m, sizes, config, use_asm)
    return y


def gemm_path_sm90() -> str:
    """Kernel family and the configuration that fixes its K order (for execution fingerprints)."""
    return f"triton-sm90-bf16mma-fold{FOLD}-chunk{CHUNK}-8streams-k16"
