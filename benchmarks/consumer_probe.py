"""How fast can the streamed GEMM's consumer warpgroups work through units (issue 13)?

    PYTHONPATH=$PWD python benchmarks/consumer_probe.py [--units 64] [--out DIR]

The streamed small-batch GEMM (M <= 16) is the weight stream, its consumers' per-unit work and
the split-K hand-off, and the three add up rather than hide one another
(``benchmarks/RESULTS.md``, forty-sixth and forty-ninth sessions). This probe times the consumers
alone: every CTA (one per SM) runs 1-4 consumer warpgroups (``--warpgroups``; the shipped kernel
has 2 or 3, a fourth would need registers moved from the producer), each ``units`` times over one
stage of fixed data in shared memory (``benchmarks/consumer_probe.cu``, appended to the shipped
``kernels/w4a4_gemm_sm90a.cu`` so that it runs its very functions), in two modes: the wgmma
chains alone, and the shipped per-unit work (``stream_unit``: the unit layout's reads, the decode,
the chains), each at 8 and 16 batch columns. Prints, per mode and warpgroup count, cycles per
unit and warpgroup (median over warpgroups) and the SM's units per microsecond, beside what the
stream delivers (N = K = 8192: 15.5 units per SM in the bare stream's time, ``--stream-us``).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import itertools
import json
import sys
import tempfile
from pathlib import Path

import torch
from gemm import bench_us, gpu_device
from minite_kernels import cuda_jit

ROOT = Path(__file__).resolve().parent.parent
SOURCES = (
    ROOT / "kernels" / "w4a4_gemm_sm90a.cu",
    Path(__file__).resolve().parent / "consumer_probe.cu",
)
MODES = {0: "wgmma chains only", 1: "stream_unit (reads, decode, chains)"}
UNITS_8192 = 2048  # N = K = 8192's units of 64 rows x 512 K


class Probe(ctypes.Structure):
    _fields_ = [("cycles", ctypes.c_void_p), ("sink", ctypes.c_void_p), ("units", ctypes.c_int)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", type=int, default=64)
    parser.add_argument("--stream-us", type=float, default=13.35,
                        help="the bare stream's time at N = K = 8192 (H100: 13.35 us)")  # fmt: skip
    parser.add_argument("--warpgroups", default="1,2,3,4", help="consumer warpgroups per CTA")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    counts = [int(n) for n in args.warpgroups.split(",")]
    if not all(1 <= n <= 4 for n in counts):
        parser.error("--warpgroups: 1 to 4 per CTA (the probe's 512-thread launch bound)")
    found = gpu_device()
    if found is None:
        return 1
    device, sms = found
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp, "consumer_probe_full.cu")
        src.write_text("\n".join(p.read_text() for p in SOURCES))
        names = [f"consumer_probe_{m}_m{bm}" for m in MODES for bm in (8, 16)]
        kernels = cuda_jit.load(str(src), names, device)
    sink = torch.zeros(512, dtype=torch.float32, device=device)
    per_sm = UNITS_8192 / sms
    print(f"{torch.cuda.get_device_name(device)}, {sms} SMs, {args.units} units per warpgroup")
    rate = per_sm / args.stream_us
    print(f"the stream: {rate:.2f} units / us per SM ({per_sm:.1f} in {args.stream_us} us)")
    print(
        "| mode | BM | warpgroups | us per launch | cycles per unit, warpgroup | units / us, SM"
        " | 8192^2's units per SM take (us) |\n|---|---|---|---|---|---|---|"
    )
    results = []
    for (mode, label), bm, nwg in itertools.product(MODES.items(), (8, 16), counts):
        cycles = torch.zeros(sms * nwg, dtype=torch.int64, device=device)
        p = Probe(cycles.data_ptr(), sink.data_ptr(), args.units)
        kernel = kernels[f"consumer_probe_{mode}_m{bm}"]
        stage = 16384 + 2048 + bm * 1024  # StreamShape<BM, unit layout>::STAGE

        def run(kernel=kernel, nwg=nwg, p=p, stage=stage) -> None:
            kernel.launch((sms, 1, 1), 128 * nwg, nwg * stage, p, device)

        us = bench_us(run, graph=False)
        per_unit = float(cycles.double().median()) / args.units
        rate = nwg * args.units / us
        results.append({"mode": label, "bm": bm, "warpgroups": nwg, "us": us,
                        "cycles_per_unit": per_unit, "units_per_us": rate})  # fmt: skip
        cells = [
            label,
            bm,
            nwg,
            f"{us:.2f}",
            f"{per_unit:.0f}",
            f"{rate:.2f}",
            f"{per_sm / rate:.2f}",
        ]
        print("| " + " | ".join(map(str, cells)) + " |", flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        meta = {
            "device": torch.cuda.get_device_name(device),
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "units": args.units,
            "results": results,
        }
        Path(args.out, "consumer_probe.json").write_text(json.dumps(meta, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
