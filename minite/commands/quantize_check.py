"""``minite quantize-check``: quantize random tensors and print the contract's figures."""

from __future__ import annotations

import argparse
import time

import torch


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "quantize-check",
        help="quantize a random activation and weight, run the W4A4 linear, print the figures",
        description="Quantize a random activation [rows, K] (1x16 blocks, per-row amax) and weight "
        "[N, K] (16x16 blocks, per-tensor amax), run w4a4_linear, and check batch invariance.",
    )
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--k", type=int, default=1024)
    p.add_argument("--n", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from minite_common import (
        DEFAULT_RECIPE,
        gemm_path,
        quantize_nvfp4,
        quantize_weight,
        w4a4_linear,
    )
    from minite_common.health import quantizer_health

    gen = torch.Generator().manual_seed(args.seed)
    # Activations with per-token magnitudes spanning 4 decades, plus a few outlier channels.
    x = torch.randn(args.rows, args.k, generator=gen) * 10 ** (4 * torch.rand(args.rows, 1) - 2)
    x[:, :: max(args.k // 8, 1)] *= 20
    x = x.to(torch.bfloat16).to(args.device)
    w = (torch.randn(args.n, args.k, generator=gen) / args.k**0.5).to(torch.bfloat16)
    w = w.to(args.device)

    print(f"miniTE quantize-check on {args.device}: recipe {DEFAULT_RECIPE.fingerprint()}")
    print(f"GEMM path: {gemm_path(x.device)}")
    rows = []
    for name, t, src in (
        ("activation (1x16, row amax)", quantize_nvfp4(x, amax="row"), x),
        ("weight (16x16, tensor amax)", quantize_weight(w), w),
    ):
        rows.append((name, quantizer_health(src, t)))
    keys = ("amax", "snr_db", "rel_rmse", "zero_scales", "subnormal_scales", "saturated_scales",
            "flushed_to_zero")  # fmt: skip
    print(f"{'tensor':30s}" + "".join(f"{k:>17s}" for k in keys))
    for name, h in rows:
        print(f"{name:30s}" + "".join(f"{h[k]:17.4g}" for k in keys))

    w_q = quantize_weight(w)
    start = time.perf_counter()
    y = w4a4_linear(x, w_q)
    elapsed = time.perf_counter() - start
    ref = x.double() @ w.double().T
    rel = float((y.double() - ref).norm() / ref.norm())
    print(f"w4a4_linear [{args.rows}x{args.k}] x [{args.n}x{args.k}]^T: {elapsed * 1e3:.1f} ms, "
          f"relative error vs the unquantized product {rel:.4f}")  # fmt: skip
    mismatched = [
        m
        for m in (1, 2, 7, 16, 33)
        if m <= args.rows and not torch.equal(w4a4_linear(x[:m], w_q), y[:m])
    ]
    verdict = "bitwise equal" if not mismatched else f"DIFFERENT at batch sizes {mismatched}"
    print(f"batch invariance (first rows recomputed in batches 1, 2, 7, 16, 33): {verdict}")
    return 1 if mismatched else 0
