"""How fast can a kernel stream N = K = 8192's NVFP4 weight (37.7 MB) on this GPU (issue 13)?

    PYTHONPATH=$PWD python benchmarks/stream_probe.py [--out DIR]

The streamed small-batch GEMM (M <= 16) reads that weight as 2048 units of 18 KB, each CTA a
contiguous range, one bulk copy per unit into a 6-stage shared-memory ring. A timing build of it
with no split-K hand-off took ~17 us on an H100 and on an H200 alike (2.2-2.3 TB/s), where
cuBLAS reads its BF16 weight at ~2.8 and ~4.0 TB/s (benchmarks/RESULTS.md, forty-fifth
session). This probe times streams that do no work on the data (``benchmarks/stream_probe.cu``):
the same bulk-copy ring with more stages, smaller or larger units, units dealt round-robin, the
L2 evict-first hint, two CTAs per SM; plain 16-byte loads by every thread; ``torch.sum`` over the
bytes; the ring and the loads again over four times the bytes (the rate without the launch's fixed
cost); and, in the same process, cuBLAS BF16 and the shipped GEMM at M = 1 on that shape. Times
are medians of CUDA-graph replays over copies rotated past twice the L2 (as ``gemm.py``); prints
us and TB/s per line, writes ``stream_probe.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import sys
from pathlib import Path

import torch
from gemm import Shape, bench_us, gpu_device, rotations
from minite_kernels import cuda_jit

UNIT = 18432  # the streamed GEMM's unit: 64 weight rows x 512 K (codes and scales)
TOTAL = 2048 * UNIT  # N = K = 8192's NVFP4 weight in that layout
SOURCE = Path(__file__).resolve().parent / "stream_probe.cu"


class Params(ctypes.Structure):
    _fields_ = [
        ("src", ctypes.c_void_p),
        ("sink", ctypes.c_void_p),
        ("units", ctypes.c_uint32),
        ("unit_bytes", ctypes.c_uint32),
        ("stages", ctypes.c_uint32),
        ("interleave", ctypes.c_uint32),
        ("evict_first", ctypes.c_uint32),
    ]


def bulk(unit: int, stages: int, ctas_per_sm: int = 1, interleave: bool = False,
         evict_first: bool = False) -> dict:  # fmt: skip
    return {"kernel": "probe_bulk", "unit": unit, "stages": stages, "ctas_per_sm": ctas_per_sm,
            "interleave": interleave, "evict_first": evict_first}  # fmt: skip


def loads(threads: int, ctas_per_sm: int) -> dict:
    return {"kernel": "probe_loads", "threads": threads, "ctas_per_sm": ctas_per_sm}


SHIPPED_RING = "bulk 18 KB x 6 stages (the shipped ring)"
LONG = 4
VARIANTS = {
    SHIPPED_RING: bulk(UNIT, 6),
    "bulk 18 KB x 6, evict-first (as shipped)": bulk(UNIT, 6, evict_first=True),
    "bulk 18 KB x 11": bulk(UNIT, 11),
    "bulk 18 KB x 6, units round-robin": bulk(UNIT, 6, interleave=True),
    "bulk 18 KB x 5, two CTAs per SM": bulk(UNIT, 5, ctas_per_sm=2),
    "bulk 4.5 KB x 24": bulk(UNIT // 4, 24),
    "bulk 9 KB x 22": bulk(UNIT // 2, 22),
    "bulk 36 KB x 6": bulk(2 * UNIT, 6),
    "loads 512 threads x 4 CTAs per SM": loads(512, 4),
    "loads 256 threads x 8 CTAs per SM": loads(256, 8),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    found = gpu_device()
    if found is None:
        return 1
    device, sms = found
    kernels = cuda_jit.load(str(SOURCE), ["probe_bulk", "probe_loads"], device)
    copies = [
        torch.randint(0, 256, (TOTAL,), dtype=torch.uint8, device=device)
        for _ in range(rotations(TOTAL))
    ]
    sink = torch.zeros(2 * sms, dtype=torch.int32, device=device)
    results: dict[str, float] = {}

    def report(name: str, us: float, nbytes: int = TOTAL) -> None:
        results[name] = us
        print(f"| {name} | {us:.2f} | {nbytes / us / 1e6:.2f} |", flush=True)

    print(f"{torch.cuda.get_device_name(device)}, {sms} SMs, {len(copies)} copies of {TOTAL} B")
    print("| stream | us | TB/s |\n|---|---|---|")

    def stream(name: str, v: dict, buffers: list[torch.Tensor]) -> None:
        unit, nbytes = v.get("unit", UNIT), buffers[0].numel()
        grid = sms * v["ctas_per_sm"]
        threads = v.get("threads", 32)
        smem = unit * v.get("stages", 0)
        params = [
            Params(c.data_ptr(), sink.data_ptr(), nbytes // unit, unit, v.get("stages", 0),
                   int(v.get("interleave", False)), int(v.get("evict_first", False)))
            for c in buffers
        ]  # fmt: skip
        kernel = kernels[v["kernel"]]

        def run() -> None:
            for p in params:
                kernel.launch((grid, 1, 1), threads, smem, p, device)

        report(name, bench_us(run, len(params)), nbytes)

    for name, v in VARIANTS.items():
        stream(name, v, copies)
    floats = [c.view(torch.float32) for c in copies]
    summed = bench_us(lambda: [f.sum() for f in floats], len(floats))
    report("torch.sum over the float32 words", summed)
    copies.clear()
    floats.clear()
    # the same streams over LONG x the bytes: what the rate is once a launch's fixed cost is spread
    big = [
        torch.randint(0, 256, (LONG * TOTAL,), dtype=torch.uint8, device=device)
        for _ in range(rotations(LONG * TOTAL))
    ]
    for name in (SHIPPED_RING, "loads 512 threads x 4 CTAs per SM"):
        stream(f"{name}, {LONG}x the bytes", VARIANTS[name], big)
    big.clear()
    s = Shape(1, 8192, 8192)
    report("cuBLAS BF16, M = 1 (reads 134 MB)", bench_us(s.cublas(), s.rotate), 2 * 8192 * 8192)
    report("shipped nvfp4_gemm, M = 1", bench_us(s.ours(), s.rotate))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        meta = {
            "device": torch.cuda.get_device_name(device),
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "bytes": TOTAL,
            "us": results,
        }
        Path(args.out, "stream_probe.json").write_text(json.dumps(meta, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
