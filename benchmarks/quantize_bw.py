"""Quantize kernels against copy bandwidth on the GPU (issue 15): each kernel's time (median of
``triton.testing.do_bench``), its minimum bytes (input read once per pass, outputs written once)
and the fraction of the copy bandwidth measured in the same run.

Shapes are the dense 8B-shaped layer's largest operands at 32768 tokens: activations [32768,
4096] and [32768, 12288] (fc2's input), the weight [24576, 4096] (fc1, 16x16 blocks), and the
backward operands of fc2 (output gradient [32768, 4096]: row operand with channel scales and
stochastic rounding, column operand with RHT and stochastic rounding, from one read; the
activation's column operand with RHT), and the same two for the 30B-A3B-shaped MoE layer's
experts (262144 routed rows in 128 equal groups, through the grouped kernels). ``generic``
rows run the BF16 activations through the generic kernel (the path before the word-pair
kernel; its rounding is already the new one).

    python benchmarks/quantize_bw.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch


def measure(device: torch.device) -> list[dict[str, float | str]]:
    """One row per kernel configuration: ms, bytes, TB/s, fraction of copy bandwidth."""
    from minite_kernels import nvfp4_quantize as q
    from minite_kernels.nvfp4_grad import quantize_grad_operands
    from minite_kernels.nvfp4_grouped import quantize_grouped_grad_operands
    from triton.testing import do_bench

    from minite_common.hadamard import RHT_SIGNS

    def bench(fn: Callable[[], object]) -> float:
        return do_bench(fn, warmup=25, rep=200, return_mode="median")

    src = torch.empty(2**29, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    copy_tb_s = 2 * src.numel() * 2 / (bench(lambda: dst.copy_(src)) * 1e-3) / 1e12
    rows: list[dict[str, float | str]] = []

    def add(name: str, ms: float, nbytes: float) -> None:
        tb_s = nbytes / (ms * 1e-3) / 1e12
        rows.append(dict(kernel=name, ms=ms, gb=nbytes / 1e9, tb_s=tb_s, of_copy=tb_s / copy_tb_s))

    tokens = 32768
    for k in (4096, 12288):
        x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16)
        out_bytes = tokens * k * (0.5 + 1 / 16) + tokens * 4
        add(f"activation [{tokens}, {k}] row amax", bench(
            lambda x=x: q.quantize_nvfp4_triton(x, amax="row", block_2d=False)
        ), tokens * k * 2 + out_bytes)  # fmt: skip
        words = q._bf16_words
        q._bf16_words = lambda _: False
        try:
            add(f"activation [{tokens}, {k}] generic kernel", bench(
                lambda x=x: q.quantize_nvfp4_triton(x, amax="row", block_2d=False)
            ), tokens * k * 2 + out_bytes)  # fmt: skip
        finally:
            q._bf16_words = words
    w = torch.randn(24576, 4096, device=device, dtype=torch.bfloat16) / 64
    add("weight [24576, 4096] 16x16, tensor amax (2 passes)", bench(
        lambda: q.quantize_nvfp4_triton(w, amax="tensor", block_2d=True)
    ), 2 * w.numel() * 2 + w.numel() * (0.5 + 1 / 16))  # fmt: skip
    g = torch.randn(tokens, 4096, device=device, dtype=torch.bfloat16)
    scale = torch.rand(4096, device=device) + 0.5
    h = RHT_SIGNS
    seed = torch.tensor([1], dtype=torch.int64, device=device)  # as the learner passes it
    n = g.numel()
    add("grad [32768, 4096] row (scales, SR) + col (RHT, SR), 2 passes", bench(
        lambda: quantize_grad_operands(g, row=True, row_scale=scale, row_stochastic=True,
                                       col=True, rht_signs=h, col_stochastic=True, seed=seed)
    ), 2 * n * 2 + 2 * n * 2)  # fmt: skip
    add("grad [32768, 4096] row only (scales, SR), 2 passes", bench(
        lambda: quantize_grad_operands(g, row=True, row_scale=scale, row_stochastic=True, seed=seed)
    ), 2 * n * 2 + n * 2)  # fmt: skip
    add("activation [32768, 4096] col (RHT, nearest), 2 passes", bench(
        lambda: quantize_grad_operands(g, row=False, col=True, rht_signs=h)
    ), 2 * n * 2 + n * 2)  # fmt: skip
    del g
    # The MoE layer's experts (128, top-8 of 32768 tokens): fc2's output gradient and fc1's input.
    experts, routed = 128, 8 * tokens
    sizes = tuple(torch.full((experts,), routed // experts).tolist())
    g = torch.randn(routed, 2048, device=device, dtype=torch.bfloat16)
    scale = torch.rand(experts * 2048, device=device) + 0.5
    n = g.numel()
    add(f"grouped grad [{routed}, 2048] row (SR) + col (RHT, SR), 2 passes", bench(
        lambda: quantize_grouped_grad_operands(g, sizes, row=True, row_scale=scale,
                                               row_stochastic=True, col=True, rht_signs=h,
                                               col_stochastic=True, seed=seed)
    ), 2 * n * 2 + 2 * n * 2)  # fmt: skip
    add(f"grouped activation [{routed}, 2048] col (RHT, nearest), 2 passes", bench(
        lambda: quantize_grouped_grad_operands(g, sizes, row=False, col=True, rht_signs=h)
    ), 2 * n * 2 + n * 2)  # fmt: skip
    for r in rows:
        r["copy_tb_s"] = copy_tb_s
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "quantize-bw-out")))
    args = p.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    rows = measure(device)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quantize_bw.json").write_text(json.dumps(rows, indent=1))
    print(f"copy bandwidth {rows[0]['copy_tb_s']:.2f} TB/s ({torch.cuda.get_device_name(device)})")
    print("| kernel | ms | GB (min) | TB/s | of copy |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kernel']} | {r['ms']:.3f} | {r['gb']:.2f} | {r['tb_s']:.2f} | "
              f"{r['of_copy']:.0%} |")  # fmt: skip


if __name__ == "__main__":
    main()
