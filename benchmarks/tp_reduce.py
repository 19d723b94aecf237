"""Cost of the TP-invariant reduction of a row-parallel W4A4 linear against the plain all-reduce.

For each shape (M tokens, N outputs, K inputs split over ``--world`` ranks) every rank times:
- plain: ``w4a4_linear`` of its K slice (whole-row amax: one MAX all-reduce of M floats), then an
  all-reduce (SUM) of the BF16 partial outputs [M, N], which rounds differently from TP=1;
- deterministic: ``w4a4_linear(..., tp_group=)`` (:mod:`minite_common.parallel`): the whole-row
  amax and NaN flags (one MAX all-reduce of 2M floats), this rank's partial accumulator, its
  reduction (CPU: an int64 SUM all-reduce of [M, N]; GPU: an all-gather of the FP32 fold-chunk
  sums [K/(512*world), M, N] per rank) and the epilogue once; the output equals TP=1 bitwise.
It reports the median time per call of each (all ranks synchronized, rank 0's clock), the time
of the collectives alone, and the bytes each rank contributes to them. Checks the bits as well.

    python benchmarks/tp_reduce.py --world 2            # CPU, gloo (the CI machine's kind)
    python benchmarks/tp_reduce.py --world 2 --cuda     # 2 GPUs, NCCL (needs the GPU kernels'
                                                        # nvfp4_gemm_partials / fold_partials)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CPU_SHAPES = [(1, 1024, 1024), (16, 1024, 1024), (256, 1024, 1024), (16, 2048, 4096)]
GPU_SHAPES = [(1, 8192, 8192), (16, 8192, 8192), (256, 8192, 8192), (4096, 8192, 8192)]


def _median_time(fn, sync, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _measure(m, n, k, rank, world, device, group, recipe, sync, repeats) -> dict:
    """One shape's row of the table (every rank calls it; rank 0's row is reported)."""
    from minite_common import parallel as tp
    from minite_common import quantize_weight, w4a4_linear

    g = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=g).bfloat16().to(device)
    weight = (torch.randn(n, k, generator=g) * 0.02).bfloat16().to(device)
    cols = slice(rank * k // world, (rank + 1) * k // world)
    (shard,) = tp.quantize_weight_shards([("w", weight[:, cols].contiguous())], recipe, group)
    xs = x[:, cols].contiguous()

    def plain() -> torch.Tensor:
        y = w4a4_linear(xs, shard, recipe=recipe, row_amax=tp.tp_row_amax(xs, group))
        dist.all_reduce(y, group=group)
        return y

    def deterministic() -> torch.Tensor:
        return w4a4_linear(xs, shard, recipe=recipe, tp_group=group)

    partial = tp.gemm_partials(tp.quantize_row_slices(xs, recipe, None), shard)
    out_bf16 = torch.empty(m, n, dtype=torch.bfloat16, device=device)
    stats = torch.empty(2, m, device=device)
    amax = torch.empty(m, device=device)

    def plain_collectives() -> None:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX)
        dist.all_reduce(out_bf16)

    def deterministic_collectives() -> None:
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        tp.reduce_partials(partial, group)

    row = {
        "M": m, "N": n, "K": k,
        "plain_ms": 1e3 * _median_time(plain, sync, repeats),
        "deterministic_ms": 1e3 * _median_time(deterministic, sync, repeats),
        "plain_collectives_ms": 1e3 * _median_time(plain_collectives, sync, repeats),
        "deterministic_collectives_ms": 1e3 * _median_time(deterministic_collectives, sync,
                                                           repeats),
        "plain_bytes": amax.numel() * 4 + out_bf16.numel() * 2,
        "deterministic_bytes": stats.numel() * 4 + partial.numel() * partial.element_size(),
    }  # fmt: skip
    if rank == 0:
        full = quantize_weight(weight, recipe=recipe)
        want = w4a4_linear(x, full, recipe=recipe).view(torch.int16)
        row["deterministic_equals_tp1"] = bool(torch.equal(deterministic().view(torch.int16), want))
        row["plain_outputs_differing_from_tp1"] = int((plain().view(torch.int16) != want).sum())
    else:
        deterministic(), plain()
    return row


def _worker(rank: int, world: int, init_file: str, cuda: bool, repeats: int, out: str) -> None:
    from minite_common import DEFAULT_RECIPE

    if cuda:
        torch.cuda.set_device(rank)
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    group = dist.group.WORLD
    recipe = dataclasses.replace(DEFAULT_RECIPE, tp_invariant=True)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()

    rows = [
        _measure(m, n, k, rank, world, device, group, recipe, sync, repeats)
        for m, n, k in (GPU_SHAPES if cuda else CPU_SHAPES)
    ]
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, help="tensor-parallel ranks")
    parser.add_argument("--cuda", action="store_true", help="one GPU per rank, NCCL")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        mp.start_processes(
            _worker,
            args=(args.world, str(Path(tmp) / "rdv"), args.cuda, args.repeats, str(out)),
            nprocs=args.world,
            start_method="spawn",
        )
        rows = json.loads(out.read_text())
    device = f"{args.world} GPUs, NCCL" if args.cuda else f"CPU, {args.world} gloo ranks"
    print(f"TP-invariant reduction vs plain all-reduce ({device}; median of {args.repeats})")
    print("| M x N x K | plain ms | deterministic ms | ratio | collectives ms plain / det. | "
          "bytes per rank plain / det. | det. == TP=1 | plain outputs != TP=1 |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['M']} x {r['N']} x {r['K']} | {r['plain_ms']:.3f} | {r['deterministic_ms']:.3f}"
            f" | {r['deterministic_ms'] / r['plain_ms']:.2f} | {r['plain_collectives_ms']:.3f} / "
            f"{r['deterministic_collectives_ms']:.3f} | {r['plain_bytes']} / "
            f"{r['deterministic_bytes']} | {r['deterministic_equals_tp1']} | "
            f"{r['plain_outputs_differing_from_tp1']} |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
