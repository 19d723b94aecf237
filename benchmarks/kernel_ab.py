"""A/B of CUDA C++ GEMM kernel variants against the shipped ``kernels/w4a4_gemm_sm90a.cu``: bits,
then times beside cuBLAS BF16, in one process (issue 13).

    # on any machine with nvcc (no GPU): variants from git revisions or files, cubins cached
    python benchmarks/kernel_ab.py prepare --out ab --rev before=0b9c9c1 --file mine=/tmp/x.cu \
        --patch parts=/tmp/change.patch --patch both=/tmp/a.patch+/tmp/b.patch
    # on the GPU, the project importable (README), ``ab`` carried: bits against the first, times
    python benchmarks/kernel_ab.py run --dir ab --check [1,9] --times [1,16] \
        [--names shipped,before] [--shapes 8192^2,qkv] [--no-linear]

A variant is a whole copy of the kernel source (a git revision's, a file, or the working tree's
with a patch applied); ``run`` loads it in place of the shipped file for every ``w4a4_gemm_cuda``
launch while it is selected (``cuda_jit.load`` is wrapped), so the default dispatch,
``w4a4_linear`` and the forced streamed plans all run it. The streamed kernel's launches of a
variant get all the dynamic shared memory a block may opt into (the kernel holds one CTA per SM
either way), for a variant's own flags or a ring deeper than the shipped plan reserves (6d05d18's
held 7 stages at M <= 8). ``shipped`` is the working tree's file. ``--check`` compares the bytes
of every variant's output with the first variant's on streamed plans (2 and 3 consumer
warpgroups, canonical and unit layouts) over shapes that cover tiles held by one, two and three or
more CTAs, K % 512 == 256 and N % 64 != 0, M = 1-16, float32 and BF16 out, heavy-tailed weights
and zero / NaN / Inf activation entries, and through ``w4a4_linear``. ``--times``: graph-replay
medians (``gemm.py``'s ``Shape``: weights rotated past L2), best of two rounds, per shape and M;
ratios print against the first variant and cuBLAS; a line per shape shows, as it goes, which
variant is being timed. On a fresh H100 (2026-12-06) ``--check 1,2,9,16`` and then ``--times
1,8,16 --no-linear`` of two variants over the five shapes took 30 s in all, Triton's compiles
included; a timing-only build that never finishes holds a run at its shape (the progress line
shows which): run it under ``timeout``, the output to a file as it comes. ``run`` keeps Triton's
cache in ``build/triton`` (unless ``TRITON_CACHE_DIR`` is set), an ignored folder of the tree,
which the GPU machine keeps between calls while it is held.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = "w4a4_gemm_sm90a.cu"
CHECK_SHAPES = (
    (8192, 8192), (5120, 2048), (2048, 4096), (4096, 12288), (1024, 768), (200, 512),
    (16384, 1024), (16384, 2560), (6144, 2304), (2000, 11264), (64, 256),
)  # fmt: skip
CHECK_MS = (1, 2, 5, 8, 9, 13, 16)
TIME_SHAPES = {
    "8192^2": (8192, 8192), "qkv": (5120, 2048), "o": (2048, 4096),
    "4096x12288": (4096, 12288), "28672x4096": (28672, 4096),
}  # fmt: skip


def prepare(out: Path, revs: list[str], files: list[str], patches: list[str]) -> None:
    """Write ``out/variants/<name>.cu`` (``shipped`` first) and compile each into ``out/cache``
    under ``cuda_jit``'s cache key (sm_90a: the source text and the file's stem), so the GPU run
    loads them without compiling."""
    variants = {"shipped": (ROOT / "kernels" / SOURCE).read_text()}
    for spec in revs:
        name, rev = spec.split("=", 1)
        variants[name] = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{rev}:kernels/{SOURCE}"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    for spec in files:
        name, path = spec.split("=", 1)
        variants[name] = Path(path).read_text()
    for spec in patches:
        name, paths = spec.split("=", 1)
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "kernels").mkdir()
            (Path(tmp) / "kernels" / SOURCE).write_text(variants["shipped"])
            for path in paths.split("+"):  # several patches, applied in order
                subprocess.run(
                    ["git", "apply", f"--include=kernels/{SOURCE}", str(Path(path).resolve())],
                    cwd=tmp, check=True,
                )  # fmt: skip
            variants[name] = (Path(tmp) / "kernels" / SOURCE).read_text()
    (out / "variants").mkdir(parents=True, exist_ok=True)
    os.environ["MINITE_CACHE_DIR"] = str(out / "cache")
    sys.path.insert(0, str(ROOT))
    from kernels import cuda_jit

    order = []
    for name, text in variants.items():
        path = out / "variants" / f"{name}.cu"
        path.write_text(text)
        order.append(name)
        # the shipped file is loaded by its own name, the others by their absolute path
        cubin_name = SOURCE if name == "shipped" else str(path.resolve())
        cuda_jit.compile_cubin(text, cubin_name, "sm_90a")  # NVRTC where found, else nvcc
        print(f"compiled {name}", flush=True)
    (out / "variants" / "ORDER").write_text("\n".join(order) + "\n")


def run(
    directory: Path,
    names: list[str] | None,
    check: list[int],
    times: list[int],
    shapes: list[str],
    linear: bool,
) -> int:
    """Bits (at the Ms in ``check``) and times (at the Ms in ``times``, of ``shapes``, with
    ``w4a4_linear`` if ``linear``) of the variants in ``directory`` (``prepare``'s output)."""
    os.environ.setdefault("MINITE_CACHE_DIR", str(directory / "cache"))
    # Triton's compiles in an ignored folder of the tree, which the GPU machine keeps between calls
    os.environ.setdefault("TRITON_CACHE_DIR", str(ROOT / "build" / "triton"))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import torch
    from minite_kernels import cuda_jit
    from minite_kernels import w4a4_gemm_cuda as wc

    order = (directory / "variants" / "ORDER").read_text().split()
    names = names or order
    paths = {n: str((directory / "variants" / f"{n}.cu").resolve()) for n in order}
    real_load = cuda_jit.load
    current = {"name": "shipped"}

    def load(source_file, kernel_names, device, defines=()):
        if source_file == SOURCE and current["name"] != "shipped":
            source_file = paths[current["name"]]
        return real_load(source_file, kernel_names, device, defines)

    cuda_jit.load = load
    real_smem = wc.Plan.smem
    smem_optin = torch.cuda.get_device_properties(0).shared_memory_per_block_optin

    def smem(plan, rows=False):
        if plan.family == "stream" and current["name"] != "shipped":
            return smem_optin
        return real_smem(plan, rows)

    wc.Plan.smem = smem
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name(0)}, {sms} SMs; variants {names}", flush=True)
    bad = 0
    if check:
        bad = _check(names, current, sms, wc, check)
    if times:
        _times(names, current, times, shapes, linear)
    return 1 if bad else 0


def _check(names, current, sms, wc, ms) -> int:
    from dataclasses import replace

    import torch

    from minite_common import quantize_nvfp4, w4a4_linear, with_kernel_layout

    g = torch.Generator(device="cuda").manual_seed(1)
    compared = bad = 0

    def compare(outs, where):
        nonlocal compared, bad
        for name in names[1:]:
            compared += 1
            if not torch.equal(outs[name].view(torch.uint8), outs[names[0]].view(torch.uint8)):
                bad += 1
                print(f"MISMATCH {name} vs {names[0]}: {where}", flush=True)

    for n, k in CHECK_SHAPES:
        heavy = torch.randn(n, k, device="cuda", generator=g)
        heavy *= torch.exp(torch.randn(n, k, device="cuda", generator=g))
        w = quantize_nvfp4(heavy.bfloat16(), amax="tensor", block_2d=True)
        w_units = replace(w, kernel_layout=wc.UnitLayout(w.codes, w.scales))
        for m in ms:
            x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
            x[0, :16] = 0
            if m > 2:
                x[1, 5], x[2, 7] = float("nan"), float("inf")
            a = quantize_nvfp4(x, amax="row")
            for dtype in (torch.float32, torch.bfloat16):
                for wgs in (2, 3):
                    for weight in (w, w_units):
                        how = wc.stream_plan(m, n, k, sms, wgs)
                        outs = {}
                        for name in names:
                            current["name"] = name
                            y = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
                            wc.gemm(a, weight, None, y, sms, how=how)
                            outs[name] = y
                        compare(outs, (n, k, m, dtype, wgs, weight is w_units))
            layout = with_kernel_layout(w)
            outs = {}
            for name in names:
                current["name"] = name
                outs[name] = w4a4_linear(x, layout)
            compare(outs, ("w4a4_linear", n, k, m))
    current["name"] = "shipped"
    leftover = int(wc.split_counters(torch.device("cuda")).abs().sum())
    print(f"check: {compared} comparisons, {bad} mismatches, counters left {leftover}", flush=True)
    return bad + (leftover != 0)


def _times(names, current, ms, shapes, linear) -> None:
    import torch
    from gemm import Shape, bench_us

    for m in ms:
        for label in shapes:
            # progress as it goes (a run cut short by a time limit shows where it was)
            print(f"[{time.strftime('%H:%M:%S')}] {label} M={m}: operands", end="", flush=True)
            s = Shape(m, *TIME_SHAPES[label])
            best: dict[str, float] = {}
            for _ in range(2):
                runs = [("cublas", s.cublas())]
                for name in names:
                    runs.append((name, s.ours()))
                    if linear:
                        runs.append((f"{name} linear", s.ours_linear()))
                for key, fn in runs:
                    print(f", {key}", end="", flush=True)
                    current["name"] = key.split()[0] if key != "cublas" else "shipped"
                    best[key] = min(best.get(key, float("inf")), bench_us(fn, s.rotate))
            print(flush=True)
            current["name"] = "shipped"
            base = names[0]
            cells = [f"cuBLAS {best['cublas']:.2f}"]
            for name in names:
                cell = f"{name} {best[name]:.2f} ({best[base] / best[name]:.3f}x)"
                if linear:
                    lin = best[f"{name} linear"]
                    cell += f" / linear {lin:.2f} ({best['cublas'] / lin:.2f}x cuBLAS)"
                cells.append(cell)
            print(f"{label} M={m}: " + "; ".join(cells), flush=True)
            del s
            torch.cuda.empty_cache()


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(m) for m in text.split(","))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="write and compile the variants (nvcc, no GPU needed)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rev", action="append", default=[], help="NAME=GIT_REVISION")
    p.add_argument("--file", action="append", default=[], help="NAME=PATH of a .cu copy")
    p.add_argument(
        "--patch", action="append", default=[],
        help="NAME=PATH[+PATH...]: the working tree's kernel with these patches applied in order",
    )  # fmt: skip
    r = sub.add_parser("run", help="bits and times on the GPU")
    r.add_argument("--dir", type=Path, required=True)
    r.add_argument("--names", default="", help="comma-separated subset (default: all, in order)")
    r.add_argument(
        "--check",
        nargs="?",
        const=CHECK_MS,
        type=_ints,
        default=(),
        help=f"compare bits (at these Ms; default {','.join(map(str, CHECK_MS))})",
    )
    r.add_argument(
        "--times",
        nargs="?",
        const=(1, 16),
        type=_ints,
        default=(),
        help="time (at these Ms; default 1,16)",
    )
    r.add_argument("--shapes", default=",".join(TIME_SHAPES), help="timed shapes (comma names)")
    r.add_argument(
        "--linear",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time w4a4_linear",
    )
    args = parser.parse_args()
    if args.cmd == "prepare":
        prepare(args.out, args.rev, args.file, args.patch)
        return 0
    names = [n for n in args.names.split(",") if n] or None
    return run(args.dir, names, args.check, args.times, args.shapes.split(","), args.linear)


if __name__ == "__main__":
    sys.exit(main())
