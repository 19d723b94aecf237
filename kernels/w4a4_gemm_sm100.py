"""W4A4 GEMM for Blackwell (sm_100+): ``tl.dot_scaled`` on E2M1 operands with E4M3 scales in
groups of 16 (the FP4 tensor cores), the same epilogue as the Hopper kernel.

UNMEASURED: no Blackwell GPU was available; this path has never run. It is taken only on compute
capability >= 10 (``minite_kernels.dispatch``); Hopper and the CPU never reach it. Its K order is
the hardware's block-scaled MMA order over BLOCK_K chunks (``gemm_path_sm100``), fixed for every M.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .w4a4_gemm import epilogue_store

BLOCK_K = 128


@triton.jit
def _w4a4_dot_scaled_kernel(
    a_codes,
    stride_ac,
    a_scales,
    stride_as,
    a_dec,
    a_dec_stride,
    w_codes,
    stride_wc,
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Y tile [BLOCK_M, BLOCK_N] from packed codes and E4M3 scales (tiles as in sm_90's kernel)."""
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
    offs_m = row_start + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < row_end
    n_ok = offs_n < N
    w_rows = w_row0 + offs_n
    offs_b = tl.arange(0, BLOCK_K // 2)
    offs_s = tl.arange(0, BLOCK_K // 16)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        b_ok = (k0 // 2 + offs_b) < K // 2
        s_ok = (k0 // 16 + offs_s) < K // 16
        a = tl.load(
            a_codes + offs_m.to(tl.int64)[:, None] * stride_ac + (k0 // 2 + offs_b)[None, :],
            mask=m_ok[:, None] & b_ok[None, :],
            other=0,
        )
        sa = tl.load(
            a_scales + offs_m.to(tl.int64)[:, None] * stride_as + (k0 // 16 + offs_s)[None, :],
            mask=m_ok[:, None] & s_ok[None, :],
            other=0,
        )
        w = tl.load(
            w_codes + w_rows.to(tl.int64)[:, None] * stride_wc + (k0 // 2 + offs_b)[None, :],
            mask=n_ok[:, None] & b_ok[None, :],
            other=0,
        )
        sw = tl.load(
            w_scales + w_rows.to(tl.int64)[:, None] * stride_ws + (k0 // 16 + offs_s)[None, :],
            mask=n_ok[:, None] & s_ok[None, :],
            other=0,
        )
        acc = tl.dot_scaled(
            a,
            sa.to(tl.float8e4nv, bitcast=True),
            "e2m1",
            tl.trans(w),
            sw.to(tl.float8e4nv, bitcast=True),
            "e2m1",
            acc,
        )
    epilogue_store(
        tl.trans(acc), 1.0, a_dec, a_dec_stride, w_dec, w_dec_stride, bias, y, stride_ym,
        stride_yn, offs_n, offs_m, w_rows, n_ok, m_ok, HAS_BIAS,
    )  # fmt: skip


def _launch(a, w, bias, y, tiles, rows_per_tile: int, n_tiles_m: int, n: int) -> None:
    a_dec, w_dec = a.decode_scale, w.decode_scale
    block_n = 128
    _w4a4_dot_scaled_kernel[(triton.cdiv(n, block_n), n_tiles_m)](
        a.codes, a.codes.stride(0), a.scales.view(torch.uint8), a.scales.stride(0),
        a_dec, a_dec.stride(0) if a_dec.dim() else 0,
        w.codes, w.codes.stride(0), w.scales.view(torch.uint8), w.scales.stride(0),
        w_dec, w_dec.stride(0) if w_dec.dim() else 0,
        bias if bias is not None else a_dec, y, y.stride(0), y.stride(1),
        tiles if tiles is not None else a_dec, a.rows, n, a.cols,
        GROUPED=tiles is not None, HAS_BIAS=bias is not None,
        BLOCK_M=rows_per_tile, BLOCK_N=block_n, BLOCK_K=BLOCK_K, num_warps=4,
        enable_fp_fusion=False,
    )  # fmt: skip


#: The block-scaled FP4 MMA (tcgen05 mxf4nvf4) needs 128-row tiles (Triton 3.6 refuses 64).
BLOCK_M = 128


def nvfp4_gemm_sm100(a, w, bias=None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``a @ w.T`` with the contract's epilogue on Blackwell (unmeasured; see module docstring)."""
    y = torch.empty(a.rows, w.rows, dtype=out_dtype, device=a.device)
    if a.rows and w.rows:
        _launch(a, w, bias, y, None, BLOCK_M, triton.cdiv(a.rows, BLOCK_M), w.rows)
    return y


def _group_tiles(
    sizes: list[int], n: int, block_m: int, total: int, device: torch.device
) -> torch.Tensor:
    """int32 [tiles, 3]: (first row, end row, first weight row) of each expert's row tile. As on
    Hopper, a negative size counts as 0 and rows past ``total`` get no tile."""
    rows: list[int] = []
    start = 0
    for g, size in enumerate(sizes):
        end = min(start + max(size, 0), total)
        for r in range(start, end, block_m):
            rows += [r, end, g * n]
        start = end
    return torch.tensor(rows, dtype=torch.int32).view(-1, 3).to(device)


def grouped_nvfp4_gemm_sm100(a, w, sizes, out_dtype=torch.bfloat16) -> torch.Tensor:
    """The grouped (MoE) variant of :func:`nvfp4_gemm_sm100` (unmeasured); ``sizes`` a list or a
    tensor (read on the host here: this path synchronizes)."""
    sizes = [int(s) for s in (sizes.tolist() if isinstance(sizes, torch.Tensor) else sizes)]
    n = w.rows // len(sizes)
    y = torch.empty(a.rows, n, dtype=out_dtype, device=a.device)
    if a.rows and n:
        tiles = _group_tiles(sizes, n, BLOCK_M, a.rows, a.device)
        _launch(a, w, None, y, tiles, BLOCK_M, tiles.shape[0], n)
    return y


def gemm_path_sm100() -> str:
    """Kernel family and K-order configuration of the Blackwell path."""
    return f"triton-sm100-dot-scaled-e2m1-e4m3g16-bk{BLOCK_K}"
