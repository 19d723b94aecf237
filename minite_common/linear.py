"""The W4A4 linear: ``y[m,n] = out_dtype(f32(f32(acc[m,n] * a_dec[m]) * w_dec[n]) + bias[n])``.

``acc`` is the sum over K of the block products ``(a_code*a_scale) * (w_code*w_scale)``. The torch
path computes that sum *exactly* and rounds it once to float32, so its result depends on nothing
but the two rows involved: not on batch size, row position, thread count or BLAS blocking. How:
every ``code*scale`` is an integer multiple of 2^-10 (E2M1 codes are multiples of 1/2, E4M3
scales multiples of 2^-9), so ``acc * 2^20`` is an integer dot product. Splitting one integer
operand into 11-bit halves keeps every partial sum of two float64 GEMMs below 2^53, where
float64 arithmetic is exact in any order; the halves are recombined in int64 and rounded to
float32 (nearest even) in integer arithmetic.
"""

from __future__ import annotations

from dataclasses import replace

import minite_kernels
import torch
from minite_kernels.dispatch import kernel_arch

from .nvfp4 import (
    BLOCK,
    E2M1_VALUES,
    FLOAT_DTYPES,
    NVFP4Tensor,
    check_quantizable,
    quantize_nvfp4,
    unpack_codes,
)
from .recipe import DEFAULT_RECIPE, NVFP4Recipe, check_fingerprints

_SCALE_UNIT = 512  # E4M3 values are integer multiples of 2^-9
_PRODUCT_SHIFT = 20  # (code*2 * scale*512) products carry 2^-20
_SPLIT_BITS = 11
MAX_K = 2**19  # keeps every float64 partial sum of the split products below 2^53


def _integer_operand(t: NVFP4Tensor) -> torch.Tensor:
    """``code*scale*2^10`` as exact integers in float64, ``[rows, K]``."""
    lut = torch.tensor([2.0 * v for v in E2M1_VALUES], dtype=torch.float64, device=t.device)
    codes = lut[unpack_codes(t.codes).long()]
    units = t.scales.float().double() * _SCALE_UNIT
    return codes * units.repeat_interleave(BLOCK, dim=1)


def _round_int64_to_float32(v: torch.Tensor) -> torch.Tensor:
    """Round int64 values to the nearest float32 (ties to even) without double rounding."""
    negative = v < 0
    mag = v.abs()
    _, exponent = torch.frexp(mag.double())  # bit length, or one more if the double rounded up
    exponent = exponent.long()
    too_long = (exponent > 0) & ((mag >> (exponent - 1).clamp(min=0)) == 0)
    bit_length = exponent - too_long.long()
    shift = (bit_length - 24).clamp(min=0)
    kept = mag >> shift
    dropped = mag - (kept << shift)
    half = (torch.ones_like(shift) << shift) >> 1
    round_up = (shift > 0) & ((dropped > half) | ((dropped == half) & ((kept & 1) == 1)))
    rounded = torch.ldexp((kept + round_up.long()).double(), shift.double()).float()
    return torch.where(negative, -rounded, rounded)


def exact_block_sum(a: NVFP4Tensor, w: NVFP4Tensor) -> torch.Tensor:
    """``acc[m,n] * 2^20`` as exact int64: the block products of ``a`` [M,K] and ``w`` [N,K]
    summed without rounding. Sums of such values over disjoint K slices (tensor-parallel shards)
    are exact in any order, up to a total K of :data:`MAX_K`."""
    if a.cols > MAX_K:
        raise ValueError(f"K={a.cols} exceeds the exact torch GEMM's limit of {MAX_K}")
    a_int = _integer_operand(a)
    w_int = _integer_operand(w)
    a_high = torch.floor(a_int / 2**_SPLIT_BITS)
    a_low = a_int - a_high * 2**_SPLIT_BITS
    high = (a_high @ w_int.T).long()
    low = (a_low @ w_int.T).long()
    return (high << _SPLIT_BITS) + low


def round_exact_sum(total: torch.Tensor) -> torch.Tensor:
    """``acc`` in float32 from the int64 ``acc * 2^20`` of :func:`exact_block_sum` (one rounding,
    nearest even)."""
    return _round_int64_to_float32(total) * 2.0**-_PRODUCT_SHIFT


def exact_block_dot(a: NVFP4Tensor, w: NVFP4Tensor) -> torch.Tensor:
    """``acc[m,n]``: the exact sum of block products of ``a`` [M,K] and ``w`` [N,K], in float32."""
    return round_exact_sum(exact_block_sum(a, w))


def gemm_epilogue(
    acc: torch.Tensor,
    a_decode_scale: torch.Tensor,
    w_decode_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The contract's epilogue on a float32 accumulator ``[M, N]`` (CPU path):
    ``out_dtype(f32(f32(acc * a_dec[m]) * w_dec[n]) + bias[n])``."""
    a_dec = a_decode_scale.unsqueeze(-1) if a_decode_scale.dim() else a_decode_scale
    y = (acc * a_dec) * w_decode_scale
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def gemm_path(device: torch.device | str) -> str:
    """Name of the GEMM implementation :func:`nvfp4_gemm` runs on ``device`` (kernel family and
    K-order configuration); ``MINITE_BACKEND=torch`` forces the torch path."""
    arch = kernel_arch(device)
    return minite_kernels.gemm_path(arch) if arch else "torch-exact-f64"


def nvfp4_gemm(
    a: NVFP4Tensor,
    w: NVFP4Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``a @ w.T`` for NVFP4 operands ``a`` [M,K] and ``w`` [N,K], with the contract's epilogue."""
    if a.cols != w.cols:
        raise ValueError(
            f"NVFP4 GEMM: activation has K={a.cols} but the weight has K={w.cols} (weight shape "
            f"{list(w.shape)}); the input's last dimension must equal the layer's input size"
        )
    if a.device != w.device:
        raise ValueError(f"NVFP4 GEMM: activation on {a.device}, weight on {w.device}")
    if kernel_arch(a.device):
        return minite_kernels.nvfp4_gemm(a, w, bias, out_dtype)
    return gemm_epilogue(exact_block_dot(a, w), a.decode_scale, w.decode_scale, bias, out_dtype)


def with_kernel_layout(w: NVFP4Tensor) -> NVFP4Tensor:
    """``w`` with a kernel-friendly copy of its codes and scales attached where a GPU kernel
    reads one (Hopper: the streamed GEMM that serves batches of up to 16 rows, for weights of at
    least 8 Mi elements with K % 256 == 0), else ``w`` itself. The copy is lossless, holds about
    as many bytes again as the codes and scales, and changes no bit of any result: only speed
    (``MINITE_KERNEL_LAYOUT=0`` turns it off). Made once per weight, e.g. at load; after writing
    into ``w.codes`` / ``w.scales`` in place call :func:`refresh_kernel_layout` (an eager call
    notices the change and refreshes it itself; a CUDA graph replay does not)."""
    if w.kernel_layout is not None:
        return w
    layout = minite_kernels.kernel_layout(w)
    return w if layout is None else replace(w, kernel_layout=layout)


def refresh_kernel_layout(w: NVFP4Tensor) -> None:
    """Rewrite ``w``'s kernel layout (if it has one) in place from its codes and scales, after
    they were changed in place: CUDA graphs that captured GEMMs on ``w`` then replay with the new
    weight."""
    if w.kernel_layout is not None:
        w.kernel_layout.refresh(w.codes, w.scales)


def check_weight(w: object, recipe: NVFP4Recipe, where: str = "w4a4_linear") -> NVFP4Tensor:
    """Return ``w`` if it is an NVFP4 weight quantized under ``recipe``, else raise clearly."""
    if not isinstance(w, NVFP4Tensor):
        raise TypeError(
            f"{where}: the weight must be an NVFP4Tensor (use quantize_weight(w) once), got "
            f"{type(w).__name__}"
        )
    check_fingerprints(recipe.fingerprint(), w.recipe_fingerprint, f"{where}: weight")
    return w


def row_amax(x: torch.Tensor) -> torch.Tensor:
    """The per-row amax the activation quantizer uses: float32 max |x| over finite elements of
    each row of ``x`` [..., K] (flattened to rows). For a row-parallel linear, MAX-reduce it over
    the tensor-parallel group and pass it as ``w4a4_linear(..., row_amax=)``: every shard then
    quantizes its slice of the row exactly as the unsharded linear would."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    return torch.where(torch.isfinite(x2), x2, torch.zeros_like(x2)).abs().amax(dim=-1)


def _check_row_amax(given: torch.Tensor, x2: torch.Tensor) -> None:
    """Refuse a ``row_amax`` that cannot be the amax of rows containing ``x2``: wrong shape,
    negative, NaN, or below the amax of the slice itself (which would saturate it silently).
    The value check reads the result on the host, so it is skipped while a CUDA graph is being
    captured (replays reuse the checked eager call's shapes)."""
    if not isinstance(given, torch.Tensor) or given.shape not in (torch.Size([]), x2.shape[:1]):
        raise ValueError(
            f"w4a4_linear: row_amax must be a tensor of shape [{x2.shape[0]}] (one amax per row) "
            f"or a scalar, got {getattr(given, 'shape', type(given).__name__)}"
        )
    if given.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    local = row_amax(x2)
    bad = torch.isnan(given) | (given.float() < local)
    if bool(bad.any()):
        raise ValueError(
            f"w4a4_linear: row_amax is NaN, negative or smaller than the row's own max |x| for "
            f"{int(bad.sum())} row(s); pass the MAX-reduced amax of the whole (unsharded) row, "
            "e.g. row_amax(x) all-reduced with MAX over the tensor-parallel group"
        )


def w4a4_linear(
    x: torch.Tensor,
    w: NVFP4Tensor,
    bias: torch.Tensor | None = None,
    *,
    recipe: NVFP4Recipe = DEFAULT_RECIPE,
    row_amax: torch.Tensor | None = None,
    tp_group: torch.distributed.ProcessGroup | None = None,
    where: str = "w4a4_linear",
) -> torch.Tensor:
    """NVFP4 W4A4 linear: quantize ``x`` [..., K] per row, multiply by ``w`` [N, K], x's dtype out.

    Batch-invariant and deterministic: each output row depends only on its own input row.
    Rows containing NaN/Inf come out NaN. ``row_amax`` (one float32 per row) replaces the
    activation amax computed from ``x``: the amax of the whole row when ``x`` is a
    tensor-parallel slice of it (see :func:`row_amax`).

    ``tp_group``: ``x`` and ``w`` are this rank's K slices of a row-parallel linear over that
    group; the whole row's amax is reduced (unless given) and the ranks' partial accumulators are
    combined deterministically (:mod:`minite_common.parallel`, collective), so every rank returns
    bitwise the unsharded linear's output, ``bias`` (whole, on every rank) added once.
    Unsupported K splits raise naming ``where``.
    """
    check_weight(w, recipe)
    if not isinstance(x, torch.Tensor) or x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            "w4a4_linear: x must be a float32, bfloat16 or float16 tensor, got "
            f"{getattr(x, 'dtype', type(x).__name__)}"
        )
    if x.dim() == 0:
        raise ValueError(
            f"w4a4_linear: x is a 0-d tensor; it needs at least one dimension of size {w.cols} "
            "(the layer's input size)"
        )
    if x.shape[-1] != w.cols:
        raise ValueError(
            f"w4a4_linear: x has last dimension {x.shape[-1]} but the weight is "
            f"{list(w.shape)} (expects {w.cols})"
        )
    if bias is not None and bias.shape != (w.rows,):
        raise ValueError(f"w4a4_linear: bias must have shape [{w.rows}], got {list(bias.shape)}")
    x2 = x.reshape(-1, x.shape[-1])
    if row_amax is not None:
        if recipe.activation_amax != "row":
            raise ValueError("w4a4_linear: row_amax needs a recipe with activation_amax='row'")
        _check_row_amax(row_amax, x2)
    from . import parallel  # parallel builds on this module

    if parallel.group_size(tp_group) > 1:
        if recipe.activation_amax != "row":
            raise ValueError(f"{where}: a row-parallel W4A4 linear needs activation_amax='row'")
        parallel.check_tp_split(w.cols, parallel.group_size(tp_group), x.device, where)
        a = parallel.quantize_row_slices(x2, recipe, tp_group, row_amax)
        y = parallel.row_parallel_gemm(a, w, bias, x.dtype, tp_group, where)
    else:
        y = None
        if row_amax is None and recipe.activation_amax == "row":
            # where a kernel quantizes the rows in its activation pass: one launch fewer, same bits
            y = minite_kernels.quantized_rows_gemm(x2, w, bias, x.dtype)
        if y is None:
            a = quantize_nvfp4(x2, amax=recipe.activation_amax, recipe=recipe, global_amax=row_amax)
            y = nvfp4_gemm(a, w, bias, out_dtype=x.dtype)
    return y.reshape(*x.shape[:-1], w.rows)


def quantize_weight(
    w: torch.Tensor,
    *,
    recipe: NVFP4Recipe = DEFAULT_RECIPE,
    name: str = "weight",
    global_amax: torch.Tensor | None = None,
) -> NVFP4Tensor:
    """Quantize a linear weight [N, K] the recipe's way (per-tensor amax, 16x16 blocks by default).

    Raises, naming ``name``, on NaN/Inf values or a shape NVFP4 cannot hold, so a bad checkpoint
    or weight update never becomes a silently wrong layer.
    """
    check_quantizable(w, name)
    if not bool(torch.isfinite(w).all()):
        bad = int((~torch.isfinite(w)).sum())
        raise ValueError(f"{name}: weight holds {bad} NaN/Inf values; refusing to quantize it")
    return quantize_nvfp4(
        w, amax="tensor", block_2d=recipe.weight_block_2d, recipe=recipe, global_amax=global_amax
    )


def host_group_sizes(group_sizes: torch.Tensor | list[int], where: str) -> list[int]:
    """``group_sizes`` as a host list of ints; raises, naming ``where``, unless every size is a
    non-negative whole number."""
    given = group_sizes.tolist() if isinstance(group_sizes, torch.Tensor) else list(group_sizes)
    sizes = [int(s) for s in given]
    if any(s < 0 or s != g for s, g in zip(sizes, given, strict=True)):
        raise ValueError(
            f"{where}: group sizes must be non-negative whole numbers (rows per expert, e.g. "
            f"expert_counts of the routed expert ids), got {given}"
        )
    return sizes


def grouped_w4a4_linear(
    x: torch.Tensor,
    w: NVFP4Tensor,
    group_sizes: torch.Tensor | list[int],
    *,
    recipe: NVFP4Recipe = DEFAULT_RECIPE,
    row_amax: torch.Tensor | None = None,
    tp_group: torch.distributed.ProcessGroup | None = None,
    where: str = "grouped_w4a4_linear",
) -> torch.Tensor:
    """W4A4 linear for MoE experts: ``x`` [T, K] holds rows grouped by expert (group g has
    ``group_sizes[g]`` consecutive rows, summing to T); ``w`` stacks the G expert weights as
    [G*N, K].

    Row t of group g gives bitwise what ``w4a4_linear(x[t:t+1], expert g's weight)`` gives;
    ``row_amax`` as in :func:`w4a4_linear`. On a GPU, ``group_sizes`` may be a device tensor
    (e.g. :func:`expert_counts` of the routed expert ids): the kernel reads it there, so the call
    never synchronizes with the host and can be captured in a CUDA graph (the sizes are then not
    checked on the host: a negative size counts as 0, rows of x past the sizes' sum are left
    unwritten and sizes past T are cut at T, so no row outside x is read or written). Sizes on
    the host must be non-negative whole numbers summing to T. ``tp_group``, ``where``: as in
    :func:`w4a4_linear` (row-parallel experts under expert TP, combined deterministically; the
    group sizes are then read on the host).
    """
    check_weight(w, recipe, "grouped_w4a4_linear")
    from . import parallel  # parallel builds on this module

    tp = parallel.group_size(tp_group) > 1
    on_device = isinstance(group_sizes, torch.Tensor) and bool(kernel_arch(x.device)) and not tp
    if on_device:
        groups = group_sizes.numel()
    else:
        sizes = host_group_sizes(group_sizes, where)
        groups = len(sizes)
    if x.dim() != 2 or x.shape[-1] != w.cols:
        raise ValueError(
            f"grouped_w4a4_linear: x must be [T, {w.cols}] for the stacked weight "
            f"{list(w.shape)}, got {list(x.shape)}"
        )
    if groups == 0 or w.rows % groups or (not on_device and sum(sizes) != x.shape[0]):
        raise ValueError(
            f"grouped_w4a4_linear: {groups} groups of sizes "
            f"{group_sizes if on_device else sizes} do not fit x {list(x.shape)} and stacked "
            f"weight {list(w.shape)} (need G dividing the weight rows and sizes summing to T)"
        )
    n = w.rows // groups
    if tp:
        parallel.check_tp_split(w.cols, parallel.group_size(tp_group), x.device, where)
        a = parallel.quantize_row_slices(x, recipe, tp_group, row_amax)
        return parallel.grouped_row_parallel_gemm(a, w, sizes, x.dtype, tp_group, where)
    a = quantize_nvfp4(x, amax=recipe.activation_amax, recipe=recipe, global_amax=row_amax)
    if kernel_arch(x.device):
        return minite_kernels.grouped_nvfp4_gemm(
            a, w, group_sizes if on_device else sizes, out_dtype=x.dtype
        )
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    start = 0
    for g, size in enumerate(sizes):
        if size:
            out[start : start + size] = nvfp4_gemm(
                a.narrow_rows(start, size), w.narrow_rows(g * n, n), out_dtype=x.dtype
            )
        start += size
    return out
