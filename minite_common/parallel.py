"""Tensor parallelism for both engines: amaxes that must cover a whole tensor or row, and the
deterministic reduction that makes a row-parallel W4A4 linear equal its TP=1 result bitwise.

A row-parallel linear splits K: rank r holds the columns ``K_r`` of the activation and of the
weight. Its activation slice is quantized with the amax of the whole row (:func:`tp_row_amax`),
so every block gets TP=1's codes and scales; the weight shard with the amax of the whole HF
tensor (:func:`quantize_weight_shards`). What remains is the sum over K, which a plain
all-reduce of the ranks' rounded outputs changes. The deterministic reduction instead combines
each rank's *partial accumulator* (:func:`gemm_partials`) and applies the epilogue once
(:func:`combine_partials`):

- CPU (torch path): the partial is the exact int64 block sum ``acc_r * 2^20`` of the rank's K
  slice; the ranks' partials are summed with an int64 all-reduce (exact in any order), rounded
  once to float32 and put through the epilogue: TP=1's bits for any K slice (multiple of 16).
- GPU (Hopper, contract v2): the partial is the rank's FP32 fold-chunk sums ``[C_r, M, N]``
  (``minite_kernels.nvfp4_gemm_partials``); they are all-gathered in rank order and folded in
  chunk order with the epilogue (``minite_kernels.fold_partials``): TP=1's bits when every
  rank's K slice is a multiple of :data:`FOLD_CHUNK` (then its chunks are TP=1's chunks).

Every rank ends with the whole output, so the engine's own all-reduce must not run after it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import minite_kernels
import torch
import torch.distributed as dist
from minite_kernels.dispatch import kernel_arch

from .linear import (
    MAX_K,
    exact_block_sum,
    gemm_epilogue,
    quantize_weight,
    round_exact_sum,
    row_amax,
)
from .nvfp4 import BLOCK, NVFP4Tensor, quantize_nvfp4
from .recipe import NVFP4Recipe

#: K elements per fold chunk of the Hopper GEMM (docs/contract.md section 6).
FOLD_CHUNK = 512

ProcessGroup = dist.ProcessGroup


def group_size(group: ProcessGroup | None) -> int:
    """Ranks in ``group`` (1 for None or without an initialized ``torch.distributed``)."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def reduce_max(t: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """``t`` MAX-reduced in place over ``group`` (no-op for one rank); returns ``t``."""
    if group_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t


def whole_row_stats(
    x: torch.Tensor, group: ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(amax, nonfinite)`` of the whole rows of which ``x`` [..., K_r] holds this rank's slices:
    float32 per-row amax of the finite elements (:func:`~minite_common.row_amax`) and whether the
    row holds NaN/Inf anywhere, in one MAX all-reduce over ``group``."""
    x2 = x.reshape(-1, x.shape[-1])
    bad = (~torch.isfinite(x2)).any(dim=-1).float()
    stats = reduce_max(torch.stack([row_amax(x2), bad]), group)
    return stats[0], stats[1] > 0


def tp_row_amax(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor | None:
    """The per-row amax of the whole row of which ``x`` [..., K_r] is this rank's slice: the
    local :func:`~minite_common.row_amax` MAX-reduced over ``group`` (None for one rank: the
    slice is the row). Pass it as ``w4a4_linear(..., row_amax=)``."""
    if group_size(group) == 1:
        return None
    return reduce_max(row_amax(x), group)


def quantize_row_slices(
    x2: torch.Tensor,
    recipe: NVFP4Recipe,
    group: ProcessGroup | None,
    given_amax: torch.Tensor | None = None,
) -> NVFP4Tensor:
    """Quantize this rank's K slices ``x2`` [M, K_r] of whole rows exactly as the whole rows are
    quantized, then sliced: with the whole row's amax (``given_amax``, else reduced over
    ``group``), and a NaN decode scale for a row holding NaN/Inf on any rank (so its output is
    NaN on every rank, as at TP=1)."""
    amax, nonfinite = whole_row_stats(x2, group)
    if given_amax is not None:
        amax = given_amax
    a = quantize_nvfp4(x2, amax="row", recipe=recipe, global_amax=amax)
    nan = torch.full_like(a.decode_scale, float("nan"))
    return dataclasses.replace(a, decode_scale=torch.where(nonfinite, nan, a.decode_scale))


def weight_amax(tensors: Sequence[torch.Tensor], group: ProcessGroup | None = None) -> torch.Tensor:
    """float32 ``[len(tensors)]``: max |t| of each tensor, MAX-reduced over ``group`` in one
    collective, i.e. the amax of each whole HF tensor when the tensors are this rank's shards."""
    amax = torch.stack([t.detach().abs().amax().float() for t in tensors])
    return reduce_max(amax, group)


def quantize_weight_shards(
    shards: Sequence[tuple[str, torch.Tensor]],
    recipe: NVFP4Recipe,
    group: ProcessGroup | None = None,
) -> list[NVFP4Tensor]:
    """Quantize named rank-local weight shards (one per HF tensor, all ranks calling with the same
    names in the same order) with the amax of each whole HF tensor over ``group``, so every rank
    holds the tiles :func:`~minite_common.quantize_weight` gives the full tensor. NaN/Inf is
    refused, naming the tensor, before the collective (which a failing rank would not join)."""
    for name, shard in shards:
        if not bool(torch.isfinite(shard).all()):
            raise ValueError(f"{name}: holds NaN/Inf values; refusing to quantize it")
    amax = weight_amax([s for _, s in shards], group)
    return [
        quantize_weight(shard, recipe=recipe, name=name, global_amax=a)
        for (name, shard), a in zip(shards, amax, strict=True)
    ]


# -- the deterministic row-parallel reduction ----------------------------------------------------


def combine_granule(device: torch.device | str) -> int:
    """The K granule of the deterministic reduction on ``device``: every rank's K slice must be a
    multiple of it (16 on the CPU path, :data:`FOLD_CHUNK` on Hopper)."""
    arch = kernel_arch(device)
    if arch is None:
        return BLOCK
    if arch == "sm90":
        return FOLD_CHUNK
    raise NotImplementedError(
        f"the TP-invariant reduction is defined for the CPU path and Hopper (sm_90), not {arch}: "
        "run the row-parallel layers with the plain all-reduce (a recipe without tp_invariant "
        "and strict_ops) on this GPU"
    )


def tp_invariant_degrees(k: int, device: torch.device | str) -> list[int]:
    """The tensor-parallel degrees at which a row-parallel linear of input size ``k`` on
    ``device`` reproduces TP=1 bitwise (each rank's K slice a multiple of the granule)."""
    granule = combine_granule(device)
    return [t for t in range(1, k // granule + 1) if k % (t * granule) == 0] or [1]


def check_tp_split(k_local: int, tp: int, device: torch.device | str, where: str) -> None:
    """Raise naming ``where`` unless a row-parallel K slice of ``k_local`` at degree ``tp`` can
    reproduce TP=1 on ``device``."""
    granule = combine_granule(device)
    if tp > 1 and granule == FOLD_CHUNK and not hasattr(minite_kernels, "fold_partials"):
        raise NotImplementedError(
            f"{where}: the TP-invariant reduction on this GPU needs the kernels' "
            "nvfp4_gemm_partials / fold_partials, which this minite_kernels lacks; run TP=1 or "
            "the plain all-reduce (a recipe without tp_invariant and strict_ops)"
        )
    if tp > 1 and k_local % granule:
        k = k_local * tp
        raise ValueError(
            f"{where}: a TP-invariant row-parallel linear needs each rank's K slice to be a "
            f"multiple of {granule} on {torch.device(device).type} (the contract's fold chunk); "
            f"K={k} at TP={tp} gives {k_local}. Supported TP degrees for K={k}: "
            f"{tp_invariant_degrees(k, device)}; pick one of them, or run this layer with the "
            "plain all-reduce (a recipe without tp_invariant and strict_ops)"
        )
    if tp > 1 and granule == BLOCK and k_local * tp > MAX_K:
        raise ValueError(f"{where}: K={k_local * tp} exceeds the exact torch GEMM's limit {MAX_K}")


def gemm_partials(a: NVFP4Tensor, w: NVFP4Tensor) -> torch.Tensor:
    """This rank's partial accumulator of ``a @ w.T`` over its K slice: int64 ``[M, N]``
    (``acc * 2^20``, exact) on the CPU path, float32 ``[C, M, N]`` fold-chunk sums on Hopper."""
    if kernel_arch(a.device):
        combine_granule(a.device)
        return minite_kernels.nvfp4_gemm_partials(a, w)
    return exact_block_sum(a, w)


def reduce_partials(partials: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Every rank's :func:`gemm_partials` brought together (collective over ``group``, rank
    order = K order): CPU, their int64 sum (an all-reduce, exact in any order); GPU, their
    fold-chunk sums concatenated in rank order ``[size*C, M, N]`` (an all-gather)."""
    size = group_size(group)
    if partials.dtype == torch.int64:
        total = partials.clone()
        if size > 1:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total
    if size == 1:
        return partials
    gathered = partials.new_empty(size * partials.shape[0], *partials.shape[1:])
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # < 2.13
    all_gather(gathered, partials.contiguous(), group=group)
    return gathered


def finish_partials(
    reduced: torch.Tensor,
    a_decode_scale: torch.Tensor,
    w_decode_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The output from :func:`reduce_partials`' result (local): CPU, one rounding of the exact
    sum and the epilogue; GPU, ``minite_kernels.fold_partials`` (chunk-order fold and epilogue).
    ``bias`` is applied once."""
    if reduced.dtype == torch.int64:
        acc = round_exact_sum(reduced)
        return gemm_epilogue(acc, a_decode_scale, w_decode_scale, bias, out_dtype)
    return minite_kernels.fold_partials(
        reduced.contiguous(), a_decode_scale, w_decode_scale, bias, out_dtype
    )


def row_parallel_gemm(
    a: NVFP4Tensor,
    w: NVFP4Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    group: ProcessGroup | None,
    where: str = "row-parallel linear",
) -> torch.Tensor:
    """``nvfp4_gemm`` of the whole (unsharded) operands, on every rank, from this rank's K slices
    ``a`` [M, K_r] and ``w`` [N, K_r] (quantized with the whole row's / tensor's amax):
    bitwise TP=1's output. ``bias`` (the whole bias, on every rank) is added once."""
    check_tp_split(a.cols, group_size(group), a.device, where)
    reduced = reduce_partials(gemm_partials(a, w), group)
    return finish_partials(reduced, a.decode_scale, w.decode_scale, bias, out_dtype)


def grouped_row_parallel_gemm(
    a: NVFP4Tensor,
    w: NVFP4Tensor,
    sizes: list[int],
    out_dtype: torch.dtype,
    group: ProcessGroup | None,
    where: str = "row-parallel experts",
) -> torch.Tensor:
    """:func:`row_parallel_gemm` for MoE experts: rows of ``a`` [T, K_r] grouped by ``sizes``
    against the stacked expert shards ``w`` [G*N, K_r]; one collective for all groups."""
    check_tp_split(a.cols, group_size(group), a.device, where)
    n = w.rows // len(sizes)
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + size)
    pieces = [
        gemm_partials(a.narrow_rows(starts[g], size), w.narrow_rows(g * n, n))
        for g, size in enumerate(sizes)
        if size
    ]
    if not pieces:
        return torch.empty(a.rows, n, dtype=out_dtype, device=a.device)
    reduced = reduce_partials(torch.cat(pieces, dim=-2), group)
    out = torch.empty(a.rows, n, dtype=out_dtype, device=a.device)
    for g, size in enumerate(sizes):
        if size:
            rows = a.narrow_rows(starts[g], size)
            out[starts[g] : starts[g + 1]] = finish_partials(
                reduced.narrow(-2, starts[g], size),
                rows.decode_scale,
                w.narrow_rows(g * n, n).decode_scale,
                None,
                out_dtype,
            )
    return out


class _FirstRankOnly(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:  # type: ignore[override]
        if group_size(group) == 1 or dist.get_rank(group) == 0:
            return y.clone()
        return torch.full_like(y, -0.0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None


def first_rank_only(y: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """``y`` on rank 0 of ``group`` and ``-0.0`` on the others, for a whole output that an
    engine will still SUM over ``group``: ``x + (-0.0) == x`` for every float ``x`` (signed zeros
    included; NaN stays NaN), so that sum returns ``y`` bitwise in any order and precision. The
    gradient
    passes to every rank unchanged, as through the engine's all-reduce."""
    return _FirstRankOnly.apply(y, group)
