"""``w4a4_linear`` from BF16: the fused path against quantize-then-GEMM (issue 13).

    PYTHONPATH=$PWD python benchmarks/rows_ab.py [--ms 1,2,4,8] [--out DIR]

Where ``minite_kernels.quantized_rows_gemm`` serves a weight with its kernel layout (at M = 1 and
K <= ``w4a4_gemm_cuda.STREAM_QUANT_MAX`` the streamed kernel quantizes the row itself: one
launch; at 8 < M <= 256 an activation pass quantizes the rows into the GEMM's operand image),
against the two launches it replaces (``quantize_nvfp4`` then ``nvfp4_gemm``), that GEMM alone on
the quantized activation, and cuBLAS BF16, all in one process: bits compared first (normal,
heavy-tailed, NaN / Inf / zero and tiny rows), then CUDA-graph replays over enough weight copies
to leave L2, the four peers alternated three times, medians. Prints per (shape, M) the times and
the ratios; writes ``rows_ab.json`` to ``--out``. Points the fused path does not serve are
skipped.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from pathlib import Path

import torch
from gemm import bench_us, nvfp4_bytes, rotations
from minite_kernels import quantized_rows_gemm
from minite_kernels import w4a4_gemm_cuda as cu

from minite_common import nvfp4_gemm, quantize_nvfp4, with_kernel_layout

#: (name, N, K): Qwen3-30B-A3B's attention projections and Qwen3-8B's / 14B's linears.
SHAPES = (
    ("Qwen3-30B-A3B qkv", 5120, 2048),
    ("Qwen3-30B-A3B o", 2048, 4096),
    ("Qwen3-8B qkv", 6144, 4096),
    ("Qwen3-8B o", 4096, 4096),
    ("Qwen3-8B gate/up", 24576, 4096),
    ("Qwen3-8B down", 4096, 12288),
    ("Qwen3-14B down", 5120, 17408),
    ("square", 8192, 8192),
)


def input_kinds(x: torch.Tensor) -> list[torch.Tensor]:
    """``x``, heavy-tailed, with NaN / Inf / zero rows or elements, and scaled by 1e-30."""
    heavy = (x.float() * torch.exp(3 * torch.randn_like(x, dtype=torch.float32))).bfloat16()
    special = x.clone()
    special[0, 5] = float("nan") if x.shape[0] > 1 else 0.0
    special[0, 17] = float("inf")
    special[-1] = 0
    return [x, heavy, special, (x.float() * 1e-30).bfloat16()]


def bench_point(name: str, n: int, k: int, m: int, wb: list, wq: list) -> dict | None:
    """One (shape, M): None where the fused path does not serve it."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    how = cu.rows_plan(x, wq[0], torch.bfloat16)
    if how is None:
        return None
    for xx in input_kinds(x):
        for w in wq[:2]:
            got = quantized_rows_gemm(xx, w, None, torch.bfloat16)
            want = nvfp4_gemm(quantize_nvfp4(xx), w)
            if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
                raise AssertionError(f"{name} M={m}: the fused path's bits differ")
    a = quantize_nvfp4(x)
    peers = {
        "two launches": lambda: [nvfp4_gemm(quantize_nvfp4(x), w) for w in wq],
        "GEMM alone": lambda: [nvfp4_gemm(a, w) for w in wq],
        "fused": lambda: [quantized_rows_gemm(x, w, None, torch.bfloat16) for w in wq],
        "cuBLAS BF16": lambda: [x @ w.t() for w in wb],
    }
    times: dict[str, list[float]] = {p: [] for p in peers}
    for _ in range(3):
        for p, fn in peers.items():
            times[p].append(bench_us(fn, len(wq)))
    us = {p: sorted(t)[1] for p, t in times.items()}
    return {"shape": name, "n": n, "k": k, "m": m, "plan": str(how), "us": us}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ms", default="1,2,4,8")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 1
    torch.manual_seed(0)
    ms = [int(v) for v in args.ms.split(",")]
    rows = []
    print(
        "| shape | M | cuBLAS BF16 us | GEMM alone us | two launches us | fused us | two / fused "
        "| vs cuBLAS |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, n, k in SHAPES:
        copies = rotations(nvfp4_bytes(n, k))
        wb = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        wq = [with_kernel_layout(quantize_nvfp4(w, amax="tensor", block_2d=True)) for w in wb]
        for m in ms:
            row = bench_point(name, n, k, m, wb, wq)
            if row is None:
                continue
            rows.append(row)
            us = row["us"]
            cub, two, fused = us["cuBLAS BF16"], us["two launches"], us["fused"]
            print(
                f"| {name} {n}x{k} | {m} | {cub:.2f} | {us['GEMM alone']:.2f} | {two:.2f} | "
                f"{fused:.2f} | "
                f"{two / fused:.3f} | {cub / two:.2f}x -> {cub / fused:.2f}x |",
                flush=True,
            )
        del wb, wq
        torch.cuda.empty_cache()
    if rows:
        ratios = [r["us"]["two launches"] / r["us"]["fused"] for r in rows]
        mean = math.exp(sum(map(math.log, ratios)) / len(ratios))
        print(
            f"\n{torch.cuda.get_device_name()}: {len(rows)} points, two launches / fused: "
            f"geometric mean {mean:.3f}, {min(ratios):.3f}-{max(ratios):.3f}; bits equal at all"
        )
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        meta = {"device": torch.cuda.get_device_name(), "date": date, "rows": rows}
        Path(args.out, "rows_ab.json").write_text(json.dumps(meta, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
