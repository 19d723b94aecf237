"""Quantizer health: how well an NVFP4 tensor represents the high-precision tensor it came from."""

from __future__ import annotations

import math

import torch

from .nvfp4 import NVFP4Tensor, dequantize_nvfp4, unpack_codes

E4M3_MIN_NORMAL = 2.0**-6
E4M3_MAX = 448.0


def quantizer_health(x: torch.Tensor, t: NVFP4Tensor) -> dict[str, float]:
    """Figures for ``t = quantize_nvfp4(x, ...)``.

    ``amax``; shares of block scales that are zero, subnormal (below 2^-6) or saturated (448);
    ``flushed_to_zero``: share of nonzero inputs whose code is zero; ``snr_db`` =
    10 log10(sum x^2 / sum (x - dq)^2) (inf when exact); ``max_abs_error``; ``rel_rmse``;
    ``quant_mse`` = mean (x - dq)^2;
    ``nonfinite_rows``: rows whose decode scale is NaN (the input held NaN/Inf there).
    """
    if tuple(x.shape) != tuple(t.shape):
        raise ValueError(f"quantizer_health: x is {list(x.shape)}, t is {list(t.shape)}")
    x32 = x.float()
    finite = torch.isfinite(x32)
    dq = dequantize_nvfp4(t, torch.float32)
    ok_rows = torch.isfinite(t.decode_scale.expand(t.rows))
    xs, dqs = x32[ok_rows], dq[ok_rows]
    scales = t.scales.float()
    nonzero = (xs != 0) & finite[ok_rows]
    zero_code = (unpack_codes(t.codes)[ok_rows] & 0x7) == 0
    signal = float((xs.double() ** 2).sum())
    noise = float(((xs.double() - dqs.double()) ** 2).sum())
    n_scales = max(scales.numel(), 1)
    return {
        "amax": float(xs.abs().max()) if xs.numel() else 0.0,
        "zero_scales": float((scales == 0).sum()) / n_scales,
        "subnormal_scales": float(((scales > 0) & (scales < E4M3_MIN_NORMAL)).sum()) / n_scales,
        "saturated_scales": float((scales == E4M3_MAX).sum()) / n_scales,
        "flushed_to_zero": float((nonzero & zero_code).sum()) / max(int(nonzero.sum()), 1),
        "snr_db": math.inf if noise == 0 else 10.0 * math.log10(max(signal, 1e-300) / noise),
        "max_abs_error": float((xs - dqs).abs().max()) if xs.numel() else 0.0,
        "rel_rmse": math.sqrt(noise / signal) if signal > 0 else 0.0,
        "quant_mse": noise / max(xs.numel(), 1),
        "nonfinite_rows": float((~ok_rows).sum()),
    }


def tensor_stats(x: torch.Tensor, t: NVFP4Tensor | None = None) -> dict[str, float]:
    """Statistics of a 2D tensor for precision debugging, plus :func:`quantizer_health` of ``t``.

    ``dynamic_range`` = log2(amax / smallest nonzero |x|); ``block_dynamic_range`` = the mean
    over 16-element blocks of the same within a block.
    """
    x32 = x.detach().float()
    finite = x32[torch.isfinite(x32)]
    mag = finite.abs()
    nonzero = mag[mag > 0]
    stats = {
        "numel": float(x32.numel()),
        "nonfinite": float(x32.numel() - finite.numel()),
        "min": float(finite.min()) if finite.numel() else math.nan,
        "max": float(finite.max()) if finite.numel() else math.nan,
        "amax": float(mag.max()) if mag.numel() else math.nan,
        "dynamic_range": float(torch.log2(nonzero.max() / nonzero.min()))
        if nonzero.numel()
        else 0.0,
    }
    if x32.shape[-1] % 16 == 0 and x32.numel():
        blocks = x32.abs().reshape(-1, 16)
        blocks = blocks[torch.isfinite(blocks).all(dim=1)]
        bmax = blocks.max(dim=1).values
        bmin = torch.where(blocks > 0, blocks, torch.full_like(blocks, math.inf)).min(dim=1).values
        ok = bmax > 0
        stats["block_dynamic_range"] = (
            float(torch.log2(bmax[ok] / bmin[ok]).mean()) if ok.any() else 0.0
        )
    if t is not None:
        stats.update(quantizer_health(x, t))
    return stats
