"""The CUDA GEMM's planner for 8 < M <= 256 against every plan it could have picked (issue 13).

    PYTHONPATH=$PWD python benchmarks/wide_plans.py [--shapes fit,holdout,short-k,small]
                                                    [--ms 32,64,128,256]
                                                    [--out DIR] [--cluster-fold-ab]

For each weight shape and batch size, ``w4a4_linear``'s CUDA path (the activation quantized into
its image, then the GEMM: ``w4a4_gemm_cuda.gemm_rows``) runs under every plan of the image-reading
families: the register-A wide kernel at batch tiles 32 / 64 / 128, unsplit, K split through the
workspace into every count whose grid fits one wave (and each such split folded by cluster where
its tiles fit one wave of clusters), and K split over two-CTA clusters; the
warp-specialized kernel's tiles; the mid-M kernel's; and the default plan where it is none of
these (the streamed kernel at M <= 16). Every plan's output is checked bitwise
against the first one's (the contract: one accumulation order), then timed by CUDA-graph replay
over enough weight copies to leave L2 (at least 160 MB). Prints per point the default plan's
time, the fastest plan and the ratio default / fastest, with cuBLAS BF16 and ``w4a4_linear`` in
the same run; writes ``wide_plans.json`` to ``--out``.

``--cluster-fold-ab``: instead, at every point where the default plan with the device's cluster
slots (``w4a4_gemm_cuda.cluster_slots``: the workspace split folded by a cluster, ``wide_cf``)
differs from the one without, both plans: bits compared, timed alternately (three rounds,
medians), the ratio old / new printed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
from pathlib import Path

import torch
import triton
from gemm import bench_us
from minite_kernels import w4a4_gemm_cuda as cu

from minite_common import quantize_nvfp4, w4a4_linear, with_kernel_layout

#: (N, K) weight shapes. ``fit``: the shapes the wide kernels' split terms were fitted to;
#: ``holdout``: shapes the planner was checked on afterwards; ``short-k``: K <= 1536, where the
#: mid-M kernel's two-fold-chunk rule (``w4a4_gemm_cuda._mid_default``) and the warp-specialized
#: kernel's fixed cost were checked (the last four were used for no choice); ``small``: weights
#: below the streamed kernel's threshold, where 8 < M <= 16 takes the plans of M = 17-32
#: (``w4a4_gemm_cuda._image_low_m``; run with ``--ms 9,12,16``).
SHAPES = {
    "fit": {
        "Qwen3-14B qkv": (7168, 5120),
        "Qwen3-14B o": (5120, 5120),
        "Qwen3-14B down": (5120, 17408),
        "Qwen2.5-7B qkv": (4608, 3584),
        "Qwen2.5-7B down": (3584, 18944),
        "Llama-3-70B qkv": (10240, 8192),
        "Mistral-7B qkv, TP 2": (3072, 4096),
        "Qwen3-30B-A3B o, TP 2": (2048, 2048),
        "Qwen3-30B-A3B qkv": (5120, 2048),
        "Qwen3-30B-A3B o": (2048, 4096),
        "square": (8192, 8192),
    },
    "holdout": {
        "Qwen3-8B qkv": (6144, 4096),
        "Qwen3-8B o": (4096, 4096),
        "Qwen3-8B gate/up": (24576, 4096),
        "Qwen3-8B down": (4096, 12288),
        "Qwen3-4B qkv": (6144, 2560),
        "Qwen3-4B o": (2560, 4096),
        "Qwen3-4B gate/up": (19456, 2560),
        "Qwen3-4B down": (2560, 9728),
        "Llama-3.2-3B qkv": (5120, 3072),
        "Llama-3.2-3B down": (3072, 8192),
        "Llama-3-8B down": (4096, 14336),
        "Qwen3-30B-A3B o, TP 4": (2048, 1024),
        "Qwen3-30B-A3B qkv, TP 4": (1280, 2048),
        "Qwen3-32B o, TP 8": (5120, 1024),
        "Qwen3-32B down, TP 8": (5120, 3200),
    },
    "short-k": {
        "4096 x 1024": (4096, 1024),
        "8192 x 1024": (8192, 1024),
        "3072 x 1024": (3072, 1024),
        "4096 x 768": (4096, 768),
        "2048 x 768": (2048, 768),
        "8192 x 512": (8192, 512),
        "4096 x 512": (4096, 512),
        "4096 x 1536": (4096, 1536),
        "6144 x 768": (6144, 768),
        "1536 x 1024": (1536, 1024),
        "2560 x 896": (2560, 896),
        "5120 x 640": (5120, 640),
    },
    "small": {
        "Qwen3-30B-A3B o, TP 4": (2048, 1024),
        "Qwen3-30B-A3B qkv, TP 4": (1280, 2048),
        "Qwen3-30B-A3B o, TP 2": (2048, 2048),
        "Qwen3-30B-A3B qkv, TP 2": (2560, 2048),
        "Qwen3-1.7B qkv": (4096, 2048),
        "Qwen3-1.7B o": (2048, 2048),
        "Qwen3-0.6B qkv": (4096, 1024),
        "Qwen3-0.6B gate/up": (6144, 1024),
        "Qwen3-0.6B down": (1024, 3072),
        "2048 x 768": (2048, 768),
        "4096 x 512": (4096, 512),
        "2560 x 2560": (2560, 2560),
    },
}


def candidate_plans(m: int, n: int, k: int, sms: int, slots: tuple[int, ...] = ()) -> list[cu.Plan]:
    """Every image-reading plan for an M x N x K GEMM: wide (tiles up to twice M, 32 always;
    unsplit, workspace splits within one wave and each folded by cluster where its tiles fit one
    wave of clusters (``slots``, ``w4a4_gemm_cuda.cluster_slots``), the two-CTA cluster where its
    grid fits one wave, stream-K where the tiles outnumber the SMs), warp-specialized, mid-M."""
    n_folds = triton.cdiv(k, cu.FOLD)
    plans = set()
    for b in (32, 64, 128):
        if b > 32 and b // 2 >= m:
            continue
        ctas = triton.cdiv(m, b) * triton.cdiv(n, cu.WIDE_ROWS)
        for s in range(1, n_folds + 1):
            if s == 1 or ctas * s <= sms:
                how = cu.wide_plan(m, n, k, sms, block_m=b, splits=s, cluster=False)
                plans.update((how, how and cu.cluster_folded(how, m, n, slots)))
        if n_folds >= 2 and 2 * ctas <= sms:
            plans.add(cu.wide_plan(m, n, k, sms, block_m=b, splits=2, cluster=True))
        plans.add(cu.wide_plan(m, n, k, sms, block_m=b, stream_k=True))  # None: one wave
    plans.update(p for p in cu.WS_PLANS if p.block_m // 2 < m)
    for bm in (32, 64):
        if bm == 32 or bm // 2 < m:
            plans.update(cu.Plan("mid", bm, n_folds, 1, wg) for wg in (1, 2))
    plans.discard(None)
    return sorted(plans)


def _plans_with(
    default: cu.Plan, m: int, n: int, k: int, sms: int, slots: tuple[int, ...]
) -> list[cu.Plan]:
    """:func:`candidate_plans`, the default plan first (timed even when it is none of them)."""
    return [default] + [p for p in candidate_plans(m, n, k, sms, slots) if p != default]


def bench_point(name: str, n: int, k: int, m: int, weights: list, dense: list) -> dict:
    """Time every candidate plan (bits checked against the first) and the default one."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    calls = len(weights)
    default = cu.rows_plan(x, weights[0], torch.bfloat16)
    if default is None:
        raise ValueError(f"{name} M={m}: w4a4_linear does not take the CUDA rows path here")
    row = {
        "shape": name, "n": n, "k": k, "m": m, "weights": calls, "default": default,
        "cublas_us": bench_us(lambda: [x @ w.t() for w in dense], calls=calls),
        "w4a4_linear_us": bench_us(lambda: [w4a4_linear(x, w) for w in weights], calls=calls),
        "plans": {},
    }  # fmt: skip
    first = first_plan = None
    for how in _plans_with(default, m, n, k, sms, cu.cluster_slots(torch.device("cuda"))):
        cu.gemm_rows(x, weights[0], None, y, how)
        if first is None:
            first, first_plan = y.clone(), how
        elif not torch.equal(y.view(torch.int16), first.view(torch.int16)):
            raise AssertionError(f"{name} M={m}: plan {how} differs bitwise from {first_plan}")
        row["plans"][how] = bench_us(
            lambda how=how: [cu.gemm_rows(x, w, None, y, how) for w in weights], calls=calls
        )
    return row


def _ab_point(name: str, x: torch.Tensor, weights: list, old: cu.Plan, new: cu.Plan) -> dict | None:
    """One point of :func:`cluster_fold_ab` (None where the dispatch does not take ``new``): same
    bits as ``old``, both timed alternately (three rounds, medians)."""
    m, n = x.shape[0], weights[0].rows
    if cu.rows_plan(x, weights[0], torch.bfloat16) != new:
        print(f"{name} M={m}: skipped, the dispatch does not take {_short(new)}", flush=True)
        return None
    ys = {how: torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for how in (old, new)}
    for how, y in ys.items():
        cu.gemm_rows(x, weights[0], None, y, how)
    if not torch.equal(ys[old].view(torch.int16), ys[new].view(torch.int16)):
        raise AssertionError(f"{name} M={m}: {new} differs bitwise from {old}")
    times: dict[cu.Plan, list[float]] = {old: [], new: []}
    for _ in range(3):
        for how, y in ys.items():
            times[how].append(
                bench_us(
                    lambda how=how, y=y: [cu.gemm_rows(x, w, None, y, how) for w in weights],
                    calls=len(weights),
                )
            )
    t_old, t_new = (sorted(times[how])[1] for how in (old, new))
    return {
        "shape": name, "n": n, "k": x.shape[1], "m": m,
        "without": _short(old), "without_us": t_old, "with": _short(new), "with_us": t_new,
    }  # fmt: skip


def cluster_fold_ab(groups: list[str], ms: list[int]) -> list[dict]:
    """The default plan against the one it replaces without cluster slots, where they differ."""
    device = torch.device("cuda")
    sms, slots = cu._sms(device), cu.cluster_slots(device)
    print(f"cluster slots (2..8 CTAs): {slots}")
    print("| shape | M | without | us | with | us | without / with |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for group in groups:
        for name, (n, k) in SHAPES[group].items():
            pairs = {}
            for m in ms:
                old = cu.plan(m, n, k, sms, ws=True, wide=True)
                new = cu.plan(m, n, k, sms, ws=True, wide=True, clusters=slots)
                if old != new:
                    pairs[m] = (old, new)
            if not pairs:
                continue
            copies = min(64, max(4, math.ceil(160e6 / (n * k * 0.5625))))
            g = torch.Generator(device="cuda").manual_seed(n + k)
            weights = [
                quantize_nvfp4(
                    torch.randn(n, k, device="cuda", generator=g).bfloat16(),
                    amax="tensor",
                    block_2d=True,
                )
                for _ in range(copies)
            ]
            for m, (old, new) in pairs.items():
                x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
                row = _ab_point(name, x, weights, old, new)
                if row is None:
                    continue
                rows.append(row)
                print(
                    f"| {name} | {m} | {row['without']} | {row['without_us']:.2f} | "
                    f"{row['with']} | {row['with_us']:.2f} | "
                    f"{row['without_us'] / row['with_us']:.3f} |",
                    flush=True,
                )
            del weights
            torch.cuda.empty_cache()
    ratios = [r["without_us"] / r["with_us"] for r in rows]
    if ratios:
        geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
        print(
            f"\n{torch.cuda.get_device_name()}: {len(rows)} points, without / with: geometric "
            f"mean {geo:.4f}, {min(ratios):.3f}-{max(ratios):.3f}"
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    groups = ", ".join(SHAPES)
    parser.add_argument("--shapes", default="fit,holdout", help=f"comma list of: {groups}")
    parser.add_argument("--ms", default="32,48,64,96,128,192,256")
    parser.add_argument("--out", default=None)
    parser.add_argument("--cluster-fold-ab", action="store_true")
    args = parser.parse_args()
    ms = [int(v) for v in args.ms.split(",")]
    unknown = set(args.shapes.split(",")) - set(SHAPES)
    if unknown:
        parser.error(f"--shapes: unknown {sorted(unknown)}; choose from {groups}")
    if not all(cu.IMAGE_MIN_M < m <= cu.ROWS_MAX_M for m in ms):
        parser.error(f"--ms: each M must be in ({cu.IMAGE_MIN_M}, {cu.ROWS_MAX_M}]")
    if not torch.cuda.is_available() or not cu.available(torch.device("cuda")):
        print("needs a GPU the CUDA C++ kernels serve (Hopper)", file=sys.stderr)
        return 1
    if args.cluster_fold_ab:
        rows = cluster_fold_ab(args.shapes.split(","), ms)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            Path(args.out, "cluster_fold_ab.json").write_text(json.dumps(rows, indent=1))
        return 0
    rows = []
    print("| shape | M | cuBLAS us | w4a4_linear us | default plan us | fastest plan us | "
          "default / fastest | default plan | fastest plan |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for group in args.shapes.split(","):
        for name, (n, k) in SHAPES[group].items():
            copies = min(64, max(4, math.ceil(160e6 / (n * k * 0.5625))))
            g = torch.Generator(device="cuda").manual_seed(n + k)
            dense = [
                torch.randn(n, k, device="cuda", generator=g).bfloat16() for _ in range(copies)
            ]
            weights = [
                with_kernel_layout(quantize_nvfp4(w, amax="tensor", block_2d=True)) for w in dense
            ]
            for m in ms:
                row = bench_point(name, n, k, m, weights, dense)
                fastest = min(row["plans"], key=row["plans"].get)
                us = row["plans"][row["default"]]
                row["ratio"] = us / row["plans"][fastest]
                rows.append(row)
                print(
                    f"| {name} | {m} | {row['cublas_us']:.2f} | {row['w4a4_linear_us']:.2f} | "
                    f"{us:.2f} | {row['plans'][fastest]:.2f} | {row['ratio']:.3f} | "
                    f"{_short(row['default'])} | {_short(fastest)} |",
                    flush=True,
                )
            del dense, weights
            torch.cuda.empty_cache()
    ratios = [r["ratio"] for r in rows]
    geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
    within = sum(r <= 1.03 for r in ratios)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(
        f"\nDevice: {torch.cuda.get_device_name()}; {stamp}. Default plan within 3% of the fastest "
        f"on {within} of {len(rows)} points; default / fastest: geometric mean {geo:.4f}, "
        f"worst {max(ratios):.3f}."
    )
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        for r in rows:
            r["default"] = _short(r["default"])
            r["plans"] = {_short(p): t for p, t in r["plans"].items()}
        Path(args.out, "wide_plans.json").write_text(json.dumps(rows, indent=1))
    return 0


def _short(how: cu.Plan) -> str:
    """``wide b64 s2``: the family, batch tile and split count (CTAs of ``wide_sk``; warpgroups
    for the others)."""
    if how.family in cu._WIDE:
        return f"{how.family} b{how.block_m} s{how.splits}"
    return f"{how.family} b{how.block_m} w{how.warpgroups}"


if __name__ == "__main__":
    sys.exit(main())
