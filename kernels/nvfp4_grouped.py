"""Grouped (MoE experts) versions of the learner's NVFP4 kernels: one launch for all experts.

- :func:`quantize_stacked_weight`: the stacked expert weights ``[S*R, K]`` (S HF tensors of R rows
  each, e.g. every expert's gate, up) quantized with 16x16 tiles, each tensor with its own amax,
  in one launch of ``nvfp4_quantize``'s kernel (per-row given amax; a tile never crosses two
  tensors since R is a multiple of 16). The same bytes as ``quantize_weight`` of each tensor.
- :func:`quantize_grouped_grad_operands`: ``nvfp4_grad.quantize_grad_operands`` for rows grouped
  by expert, in two launches for all groups: every group's operands get their own per-tensor
  amax (stats per group), the row operand its own per-channel scales (expert g's weight decode
  scales), and the column operand (wgrad) is padded to 16 tokens per group, with the RHT over
  each group's own 16-token blocks. Per group, the same function of the operand as
  ``quantize_grad_operands`` of that group's rows alone (the random draws aside).

Programs walk a tile table (group, first row, the group's end row, first padded row, first tile
of the group) built on the host from the group sizes, so no program straddles two groups.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .nvfp4_grad import (
    BLOCK_R,
    _amax_program,
    _qdq_program,
    kernel_flags,
    seed_tensor,
)
from .nvfp4_quantize import _quantize_nvfp4_kernel


@triton.jit
def _tile(tiles_ptr, BLOCK_R: tl.constexpr):
    """``(group, first row, end row, first padded row, first tile of its group)`` of this
    program's row tile (at most BLOCK_R rows, all in one group)."""
    tile = tiles_ptr + tl.program_id(0) * 5
    r0 = tl.load(tile + 1)
    r_end = tl.minimum(tl.load(tile + 2), r0 + BLOCK_R)
    return tl.load(tile), r0, r_end, tl.load(tile + 3), tl.load(tile + 4) != 0


@triton.jit
def _grouped_grad_amax_kernel(
    x_ptr,
    stride_r,
    stride_c,
    C,
    tiles_ptr,
    col_scale_ptr,
    stats_ptr,
    ROW: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    COL: tl.constexpr,
    RHT: tl.constexpr,
    SIGNS: tl.constexpr,
    HW_CVT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Pass 1: per group g, atomic max of each output's amax and non-finite flag into
    ``stats[4g:4g+4]`` (row: +0, +1; col: +2, +3); ``stats`` starts at zero."""
    g, r0, r_end, _, _ = _tile(tiles_ptr, BLOCK_R)
    _amax_program(x_ptr, stride_r, stride_c, r0, r_end, C, tl.program_id(1) * BLOCK_C,
                  col_scale_ptr + g * C, 1, stats_ptr + g * 4, ROW, ROW_SCALE, COL, RHT, SIGNS,
                  HW_CVT, BLOCK_C)  # fmt: skip


@triton.jit
def _grouped_grad_qdq_kernel(
    x_ptr,
    stride_r,
    stride_c,
    C,
    tiles_ptr,
    col_scale_ptr,
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
    """Pass 2: BF16 ``code * scale`` of the tile into ``row_out`` [R, C] and/or ``col_out``
    [R16, C] (row-major, each group's rows padded to 16); the first program of each group
    writes its decode scales to ``decode[2g:2g+2]``."""
    g, r0, r_end, p0, first = _tile(tiles_ptr, BLOCK_R)
    _qdq_program(x_ptr, stride_r, stride_c, r0, r_end, p0, C, tl.program_id(1) * BLOCK_C,
                 first & (tl.program_id(1) == 0), col_scale_ptr + g * C, 1, stats_ptr + g * 4,
                 decode_ptr + g * 2, row_out, col_out, seed_ptr, ROW, ROW_SCALE, ROW_SR, COL,
                 RHT, SIGNS, COL_SR, HW_CVT, BLOCK_C)  # fmt: skip


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor copied to ``device`` without blocking the host: through pinned memory
    on CUDA (a pageable copy would wait for all the work queued on the stream). While a CUDA
    graph is being captured it takes the plain copy, which refuses loudly (a captured copy from
    a temporary pinned buffer would replay whatever that memory holds later)."""
    if torch.device(device).type != "cuda" or torch.cuda.is_current_stream_capturing():
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@functools.lru_cache(maxsize=256)
def sizes_on_device(sizes: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Group sizes as a cached int32 device tensor (a repeated routing is copied once)."""
    return host_to_device(torch.tensor(sizes, dtype=torch.int32), device)


@functools.lru_cache(maxsize=8)
def group_layout(
    sizes: tuple[int, ...], device: torch.device
) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """``(tiles int32 [n, 5] on device, row starts, padded row starts)`` of groups of ``sizes``
    rows: tiles of BLOCK_R rows inside each group (see the module docstring); padded starts
    place each group's rows, rounded up to 16, one after the other (the column operands)."""
    sizes_t = torch.tensor(sizes, dtype=torch.int64)
    padded_t = (sizes_t + 15) // 16 * 16
    starts_t = torch.cumsum(sizes_t, 0) - sizes_t
    pstarts_t = torch.cumsum(padded_t, 0) - padded_t
    per_group = (sizes_t + BLOCK_R - 1) // BLOCK_R
    group = torch.repeat_interleave(torch.arange(len(sizes)), per_group)
    first_tile = torch.cumsum(per_group, 0) - per_group
    inner = torch.arange(group.numel()) - first_tile[group]
    tiles = torch.stack(
        [
            group,
            starts_t[group] + inner * BLOCK_R,
            (starts_t + sizes_t)[group],
            pstarts_t[group] + inner * BLOCK_R,
            (inner == 0).long(),
        ],
        dim=1,
    )
    return (
        host_to_device(tiles.to(torch.int32), device),
        tuple(starts_t.tolist()),
        tuple(pstarts_t.tolist()),
    )


def quantize_grouped_grad_operands(
    x: torch.Tensor,
    sizes: tuple[int, ...],
    *,
    row: bool,
    row_scale: torch.Tensor | None = None,
    row_stochastic: bool = False,
    col: bool = False,
    rht_signs: tuple[int, ...] | None = None,
    col_stochastic: bool = False,
    seed: int | torch.Tensor = 0,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """``(row_values, col_values, decode)`` of ``x`` [R, C] whose rows are ``len(sizes)`` groups.

    ``row_values`` BF16 [R, C] (``row``; ``row_scale`` float32 [G*C] multiplies group g's rows by
    ``row_scale[g*C:(g+1)*C]``), ``col_values`` BF16 [sum of sizes rounded up to 16, C]
    (``col``; group g at its padded start, see :func:`group_layout`), ``decode`` float32 [G, 2]:
    each group's row and col decode scales (1 for empty groups). Each group's operands are what
    ``nvfp4_grad.quantize_grad_operands`` gives for that group's rows alone.
    """
    if x.dim() != 2 or x.shape[1] % 16:
        raise ValueError(f"quantize_grouped_grad_operands: need [R, C], C % 16 == 0, got {x.shape}")
    if not (row or col):
        raise ValueError("quantize_grouped_grad_operands: ask for the row and/or col operand")
    r, c = x.shape
    if sum(sizes) != r:
        raise ValueError(f"quantize_grouped_grad_operands: groups {sizes} do not sum to {r} rows")
    dev = x.device
    tiles, _, _ = group_layout(tuple(sizes), dev)
    r_pad = sum(-(-s // 16) * 16 for s in sizes)
    groups = len(sizes)
    stats = torch.zeros(groups * 4, dtype=torch.float32, device=dev)
    decode = torch.ones(groups, 2, dtype=torch.float32, device=dev)
    row_out = torch.empty(r, c, dtype=torch.bfloat16, device=dev) if row else None
    col_out = torch.empty(r_pad, c, dtype=torch.bfloat16, device=dev) if col else None
    if r == 0:
        return row_out, col_out, decode
    has_scale = row and row_scale is not None
    if has_scale and (row_scale.dim() != 1 or row_scale.shape[0] != groups * c):
        raise ValueError(
            f"quantize_grouped_grad_operands: row_scale must be [{groups * c}], got "
            f"{list(row_scale.shape)}"
        )
    scale_arg = row_scale.float().contiguous() if has_scale else stats
    flags = kernel_flags(row, col, rht_signs)
    grid = (tiles.shape[0], triton.cdiv(c, flags["BLOCK_C"]))
    _grouped_grad_amax_kernel[grid](
        x, x.stride(0), x.stride(1), c, tiles, scale_arg, stats,
        ROW_SCALE=has_scale, BLOCK_R=BLOCK_R, num_warps=4, **flags,
    )  # fmt: skip
    _grouped_grad_qdq_kernel[grid](
        x, x.stride(0), x.stride(1), c, tiles, scale_arg, stats, decode,
        row_out if row else stats, col_out if col else stats,
        seed_tensor(seed, dev) if row_stochastic or col_stochastic else stats,
        ROW_SCALE=has_scale, ROW_SR=row_stochastic, COL_SR=col_stochastic,
        BLOCK_R=BLOCK_R, num_warps=4, enable_fp_fusion=False, **flags,
    )  # fmt: skip
    return row_out, col_out, decode


def quantize_stacked_weight(
    x: torch.Tensor, row_amax: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes uint8 [rows, K/2], scales float8_e4m3fn [rows, K/16], decode float32 [rows])`` of
    ``x`` [rows, K] in 16x16 tiles, row r scaled by the global amax ``row_amax[r]`` (float32
    [rows]; equal on the 16 rows of a tile). One launch; with one amax per HF tensor these are
    the bytes of ``quantize_nvfp4(tensor, amax="tensor", block_2d=True)`` of each tensor."""
    rows, k = x.shape
    if rows % 16 or k % 16:
        raise ValueError(f"quantize_stacked_weight: need rows and K multiples of 16, got {x.shape}")
    dev = x.device
    codes = torch.empty(rows, k // 2, dtype=torch.uint8, device=dev)
    scales = torch.empty(rows, k // 16, dtype=torch.uint8, device=dev)
    decode = torch.empty(rows, dtype=torch.float32, device=dev)
    if rows == 0:
        return codes, scales.view(torch.float8_e4m3fn), decode
    amax = row_amax.float().contiguous()
    _quantize_nvfp4_kernel[(rows // 16,)](
        x, x.stride(0), x.stride(1), codes, scales, decode, amax, 1, codes, rows, k,
        ROW_AMAX=True, GIVEN_AMAX=True, BLOCK_2D=True, SINGLE_PASS=False,
        BLOCK_M=16, BLOCK_K=512, LAUNCH_DEPENDENTS=False, num_warps=8, enable_fp_fusion=False,
    )  # fmt: skip
    return codes, scales.view(torch.float8_e4m3fn), decode
