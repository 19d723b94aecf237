"""W4A4 GEMM and NVFP4 quantize benchmarks on a CUDA GPU (issue 3), with peers in the same run.

    PYTHONPATH=$PWD python benchmarks/gemm.py [--check] [--variants] [--out DIR]

Peers: cuBLAS BF16 ``x @ w.t()``, torch FP8 row-wise ``torch._scaled_mm``, and the vLLM-style
NVFP4 emulation (dequantize both operands, then a BF16 matmul). Times are medians of CUDA-graph
replays; each timed replay cycles through as many weight copies as make the NVFP4 copies at least
twice the GPU's L2 (``rotations``; at least ``ROTATE``), and the grouped experts through as many
routings, so that no peer's weight stays in L2 from one call to the next.
Writes ``results.json`` and ``results.md`` to ``--out`` (``results-<parts>.*`` with ``--only``
naming fewer than all parts, so that runs of different parts into one folder keep each other's
files) and prints the ratio table last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import triton
import triton.testing
from minite_kernels import w4a4_gemm as gemm_mod
from minite_kernels.nvfp4_quantize import quantize_nvfp4_triton
from minite_kernels.w4a4_gemm import (
    DecodeConfig,
    LargeConfig,
    grouped_nvfp4_gemm_sm90,
    nvfp4_gemm_sm90,
)

from minite_common import (
    dequantize_nvfp4,
    exact_block_dot,
    expert_counts,
    grouped_w4a4_linear,
    quantize_nvfp4,
    w4a4_linear,
    with_kernel_layout,
)

ROTATE = 4
SQUARE_MS = (1, 16, 64, 128, 256, 1024, 8192)
QWEN_DENSE = {"qkv 2048->5120": (5120, 2048), "o 4096->2048": (2048, 4096)}
QWEN_EXPERTS = {"experts 2048->2x768": (1536, 2048), "experts 768->2048": (2048, 768)}
QWEN_MS = (1, 16, 64, 256, 1024, 8192)
MOE_TOKENS = (1, 16, 64, 256, 8192)
EXPERTS, TOP_K = 128, 8


def gpu_device() -> tuple[torch.device, int] | None:
    """The current CUDA device and its SM count (for the probes); None, said on stderr, without."""
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return None
    device = torch.device("cuda", torch.cuda.current_device())
    return device, torch.cuda.get_device_properties(device).multi_processor_count


def bench_us(fn, calls: int = 1, graph: bool = True) -> float:
    """Median microseconds of one of ``calls`` calls made by ``fn``, via CUDA-graph replay (or
    plain launches for code that cannot be captured; fine for runs of a millisecond or more)."""
    fn()
    torch.cuda.synchronize()
    if graph:
        ms = triton.testing.do_bench_cudagraph(fn, rep=25, return_mode="median")
    else:
        ms = triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
    return ms * 1000.0 / calls


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + written)."""
    src = torch.empty(2**28, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    us = bench_us(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / (us * 1e-6)


def nvfp4_bytes(rows: int, k: int) -> int:
    return rows * k // 2 + rows * k // 16


def rotations(weight_bytes: int) -> int:
    """Copies (or routings) per timed replay: ``weight_bytes`` each, together at least twice the
    L2 (with four copies of a small weight, e.g. 5120 x 2048 in NVFP4, 24 MB, they stayed in the
    H200's L2 and the NVFP4 kernels read them from there, cuBLAS's BF16 copies not)."""
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    return max(ROTATE, -(-2 * l2 // weight_bytes))


class Shape:
    """Operands for one GEMM shape: ``rotate`` weights in NVFP4, BF16 and FP8, one activation."""

    def __init__(self, m: int, n: int, k: int, seed: int = 0):
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.m, self.n, self.k = m, n, k
        self.rotate = rotations(nvfp4_bytes(n, k))
        self.x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
        ws = [torch.randn(n, k, device="cuda", generator=g).bfloat16() for _ in range(self.rotate)]
        self.w_bf16 = ws
        # as the vLLM plugin holds them: with their kernel layout where a kernel reads one
        self.w_q = [with_kernel_layout(quantize_nvfp4(w, amax="tensor", block_2d=True)) for w in ws]
        self.a_q = quantize_nvfp4(self.x, amax="row")
        fp8 = torch.float8_e4m3fn
        self.x_fp8_scale = self.x.float().abs().amax(1, keepdim=True).clamp(min=1e-12) / 448
        self.x_fp8 = (self.x.float() / self.x_fp8_scale).to(fp8)
        self.w_fp8, self.w_fp8_scale = [], []
        for w in ws:
            s = w.float().abs().amax(1, keepdim=True).clamp(min=1e-12) / 448
            self.w_fp8.append((w.float() / s).to(fp8))
            self.w_fp8_scale.append(s.t().contiguous())

    def bytes_min(self) -> int:
        return nvfp4_bytes(self.n, self.k) + nvfp4_bytes(self.m, self.k) + 2 * self.m * self.n

    def flops(self) -> int:
        return 2 * self.m * self.n * self.k

    def cublas(self):
        return lambda: [self.x @ w.t() for w in self.w_bf16]

    def fp8(self):
        def run():
            for w, s in zip(self.w_fp8, self.w_fp8_scale, strict=True):
                torch._scaled_mm(
                    self.x_fp8, w.t(), scale_a=self.x_fp8_scale, scale_b=s,
                    out_dtype=torch.bfloat16,
                )  # fmt: skip

        return run

    def emulation(self):
        def run():
            for w in self.w_q:
                a = dequantize_nvfp4(self.a_q, torch.bfloat16)
                a @ dequantize_nvfp4(w, torch.bfloat16).t()

        return run

    def ours(self, **kw):
        return lambda: [nvfp4_gemm_sm90(self.a_q, w, **kw) for w in self.w_q]

    def ours_linear(self):
        return lambda: [w4a4_linear(self.x, w) for w in self.w_q]


def safe(results: dict, key: str, fn, calls: int, graph: bool = True) -> float | None:
    try:
        us = bench_us(fn, calls, graph)
    except Exception as e:  # one failing variant must not end the run
        results.setdefault("errors", {})[key] = f"{type(e).__name__}: {e}"[:400]
        traceback.print_exc()
        return None
    results.setdefault("us", {})[key] = us
    print(f"  {key}: {us:.1f} us", flush=True)
    return us


def bench_square(results: dict, variants: bool) -> None:
    k = n = 8192
    for m in SQUARE_MS:
        s = Shape(m, n, k)
        tag = f"sq M={m}"
        results.setdefault("rotations", {})[tag] = s.rotate
        safe(results, f"{tag} cublas", s.cublas(), s.rotate)
        safe(results, f"{tag} fp8", s.fp8(), s.rotate)
        # the emulation creates CPU tensors: plain launches
        safe(results, f"{tag} emulation", s.emulation(), s.rotate, graph=False)
        safe(results, f"{tag} ours", s.ours(), s.rotate)
        safe(results, f"{tag} ours+quant", s.ours_linear(), s.rotate)
        if not variants:
            continue
        safe(results, f"{tag} ours bits-decode", s.ours(use_asm=False), s.rotate)
        if m <= 16:
            for cfg in (DecodeConfig(64, 16, 4, 3), DecodeConfig(64, 16, 4, 4),
                        DecodeConfig(64, 16, 4, 2, split_k=1), DecodeConfig(64, 16, 4, 2, 8),
                        DecodeConfig(64, 16, 4, 2, 16), DecodeConfig(64, 16, 4, 2, 0, True),
                        DecodeConfig(128, 16, 8, 2), DecodeConfig(128, 16, 4, 2)):  # fmt: skip
                safe(results, f"{tag} {cfg}", s.ours(config=cfg), s.rotate)
        if 16 < m <= 512:
            for cfg in (DecodeConfig(64, 64, 4, 3, split_k=1), DecodeConfig(64, 64, 4, 3, 1, True),
                        DecodeConfig(64, 64, 4, 3, 0, True), DecodeConfig(128, 64, 8, 3, 1, True),
                        DecodeConfig(64, 128, 4, 3, 1, True), DecodeConfig(128, 128, 8, 4, 1, True),
                        DecodeConfig(128, 128, 8, 3, 1), DecodeConfig(128, 256, 8, 3, 1, True),
                        DecodeConfig(128, 128, 8, 3, 0, True)):  # fmt: skip
                safe(results, f"{tag} {cfg}", s.ours(config=cfg), s.rotate)
        if 64 < m <= 1024:
            safe(results, f"{tag} large-path", s.ours(config=gemm_mod.LARGE_CONFIG), s.rotate)
        if m >= 1024:
            for cfg in (
                LargeConfig(128, 256, 64, 8, 8, 3),
                LargeConfig(128, 128, 64, 8, 8, 3),
                LargeConfig(256, 128, 64, 8, 8, 3),
                LargeConfig(128, 256, 64, 8, 8, 4),
            ):
                safe(results, f"{tag} {cfg}", s.ours(config=cfg), s.rotate)
        if m == 8192:
            safe(results, f"{tag} decode A+W only", lambda s=s: [
                gemm_mod.decode_operand(w.codes, w.scales, use_asm=True) for w in s.w_q
            ] + [gemm_mod.decode_operand(s.a_q.codes, s.a_q.scales, use_asm=True)],
                 s.rotate)  # fmt: skip
        del s
        torch.cuda.empty_cache()


def bench_qwen(results: dict) -> None:
    for name, (n, k) in QWEN_DENSE.items():
        for m in QWEN_MS:
            s = Shape(m, n, k)
            tag = f"qwen {name} M={m}"
            results.setdefault("rotations", {})[tag] = s.rotate
            safe(results, f"{tag} cublas", s.cublas(), s.rotate)
            safe(results, f"{tag} fp8", s.fp8(), s.rotate)
            safe(results, f"{tag} ours", s.ours(), s.rotate)
            safe(results, f"{tag} ours+quant", s.ours_linear(), s.rotate)


def route(tokens: int, g: torch.Generator) -> torch.Tensor:
    """Rows per expert (on the device) for ``tokens`` tokens routed top-8 of 128 at random."""
    scores = torch.rand(tokens, EXPERTS, device="cuda", generator=g)
    experts = scores.topk(TOP_K, dim=1).indices.flatten()
    return expert_counts(experts, EXPERTS)


def bench_grouped(results: dict) -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    for name, (n, k) in QWEN_EXPERTS.items():
        w = torch.randn(EXPERTS * n, k, device="cuda", generator=g).bfloat16()
        w_q = quantize_nvfp4(w, amax="tensor", block_2d=True)
        w_b = w.view(EXPERTS, n, k)
        w_t = w_b.transpose(1, 2)  # [G, K, N] view of the [G, N, K] weights
        for tokens in MOE_TOKENS:
            # routings per replay: a call reads the weights of the experts it routes to
            hit = min(EXPERTS, tokens * TOP_K)
            sizes = [route(tokens, g) for _ in range(rotations(hit * nvfp4_bytes(n, k)))]
            rows = tokens * TOP_K
            x = torch.randn(rows, k, device="cuda", generator=g).bfloat16()
            a_q = quantize_nvfp4(x, amax="row")
            tag = f"moe {name} T={tokens}"
            offs = [s.cumsum(0).to(torch.int32) for s in sizes]

            def grouped_bf16(x=x, w_t=w_t, offs=offs):
                for o in offs:
                    torch._grouped_mm(x, w_t, offs=o, out_dtype=torch.bfloat16)

            def grouped_ours(a_q=a_q, w_q=w_q, sizes=sizes):
                for s in sizes:
                    grouped_nvfp4_gemm_sm90(a_q, w_q, s)

            def grouped_ours_linear(x=x, w_q=w_q, sizes=sizes):
                for s in sizes:
                    grouped_w4a4_linear(x, w_q, s)

            safe(results, f"{tag} torch._grouped_mm bf16", grouped_bf16, len(sizes))
            safe(results, f"{tag} ours", grouped_ours, len(sizes))
            safe(results, f"{tag} ours+quant", grouped_ours_linear, len(sizes))
            results.setdefault("moe_rows", {})[tag] = rows
            results.setdefault("rotations", {})[tag] = len(sizes)


def bench_quantize(results: dict) -> None:
    m = k = 8192
    x = torch.randn(m, k, device="cuda").bfloat16()
    out_bytes = nvfp4_bytes(m, k)
    results["quant_bytes"] = {
        "act row": 2 * m * k + out_bytes + 4 * m,
        "weight 2d": 2 * m * k + out_bytes + 4,
        "weight 2d given amax": 2 * m * k + out_bytes + 4,
    }
    safe(results, "quant act row", lambda: quantize_nvfp4_triton(x, amax="row", block_2d=False), 1)
    safe(
        results, "quant weight 2d",
        lambda: quantize_nvfp4_triton(x, amax="tensor", block_2d=True), 1,
    )  # fmt: skip
    amax = x.float().abs().amax()
    safe(
        results, "quant weight 2d given amax",
        lambda: quantize_nvfp4_triton(x, amax="tensor", block_2d=True, global_amax=amax), 1,
    )  # fmt: skip


def run_checks(results: dict) -> None:
    """Quick bitwise checks on the GPU: decode variants, paths and tile configs agree."""
    torch.manual_seed(0)
    n, k = 1024, 4096
    x = torch.randn(300, k, device="cuda").bfloat16()
    w_q = quantize_nvfp4(torch.randn(n, k, device="cuda"), amax="tensor", block_2d=True)
    a_q = quantize_nvfp4(x, amax="row")
    base = nvfp4_gemm_sm90(a_q, w_q, out_dtype=torch.float32, config=DecodeConfig(64, 16, 4, 4))
    checks = {}
    variants = {
        "bits-decode": dict(use_asm=False, config=DecodeConfig(64, 16, 4, 4)),
        "bm64": dict(config=DecodeConfig(64, 64, 4, 3)),
        "bm128": dict(config=DecodeConfig(128, 128, 8, 3)),
        "split2": dict(config=DecodeConfig(64, 16, 4, 4, split_k=2)),
        "split8": dict(config=DecodeConfig(64, 64, 4, 3, split_k=8)),
        "a-decoded": dict(config=DecodeConfig(64, 16, 4, 3, split_k=3, a_decoded=True)),
        "bn128-1wg": dict(config=DecodeConfig(128, 16, 4, 2, split_k=5)),
        "large": dict(config=LargeConfig()),
        "large-bits": dict(config=LargeConfig(), use_asm=False),
    }
    for name, kw in variants.items():
        try:
            y = nvfp4_gemm_sm90(a_q, w_q, out_dtype=torch.float32, **kw)
            checks[name] = bool(torch.equal(y, base))
        except Exception as e:
            checks[name] = f"{type(e).__name__}: {e}"[:300]
    acc = exact_block_dot(a_q.to("cpu"), w_q.to("cpu"))
    ref = (acc * a_q.decode_scale.cpu()[:, None]) * w_q.decode_scale.cpu()
    err = ((base.cpu() - ref).norm() / ref.norm()).item()
    checks["rel_err_vs_cpu_exact"] = err
    results["checks"] = checks
    print("checks:", json.dumps(checks), flush=True)


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "n/a"


def table(results: dict) -> str:
    us = results.get("us", {})
    bw = results["copy_bw"]
    lines = [
        f"Device: {results['device']}; torch {results['torch']}, triton {results['triton']}; "
        f"{results['date']}; copy bandwidth {bw / 1e12:.2f} TB/s (read+write).",
        "",
        "| GEMM M x N x K | cuBLAS BF16 us | FP8 rowwise us | emulation us | ours us | "
        "ours+quantize us | ours vs cuBLAS | ours vs emulation | ours TB/s (min bytes) | "
        "ours TFLOP/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in SQUARE_MS:
        t = f"sq M={m}"
        o = us.get(f"{t} ours")
        s_bytes = nvfp4_bytes(8192, 8192) + nvfp4_bytes(m, 8192) + 2 * m * 8192
        tbs = f"{s_bytes / (o * 1e-6) / 1e12:.2f}" if o else "n/a"
        tfl = f"{2 * m * 8192 * 8192 / (o * 1e-6) / 1e12:.0f}" if o else "n/a"
        lines.append(
            f"| {m} x 8192 x 8192 | {fmt(us.get(t + ' cublas'))} | {fmt(us.get(t + ' fp8'))} | "
            f"{fmt(us.get(t + ' emulation'))} | {fmt(o)} | {fmt(us.get(t + ' ours+quant'))} | "
            f"{ratio(us.get(t + ' cublas'), o)} | {ratio(us.get(t + ' emulation'), o)} | "
            f"{tbs} | {tfl} |"
        )
    lines += ["", "| Qwen3-30B-A3B GEMM | M | cuBLAS BF16 us | FP8 us | ours us | "
              "w4a4_linear us | ours vs cuBLAS | w4a4_linear vs cuBLAS |",
              "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name in QWEN_DENSE:
        for m in QWEN_MS:
            t = f"qwen {name} M={m}"
            c, f8, o = us.get(t + " cublas"), us.get(t + " fp8"), us.get(t + " ours")
            lin = us.get(t + " ours+quant")
            lines.append(f"| {name} | {m} | {fmt(c)} | {fmt(f8)} | {fmt(o)} | {fmt(lin)} | "
                         f"{ratio(c, o)} | {ratio(c, lin)} |")  # fmt: skip
    lines += ["", "| MoE grouped (128 experts, top-8) | tokens | rows | torch._grouped_mm BF16 us "
              "| ours us | grouped_w4a4_linear us | ours vs BF16 | grouped_w4a4_linear vs BF16 |",
              "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name in QWEN_EXPERTS:
        for tokens in MOE_TOKENS:
            t = f"moe {name} T={tokens}"
            c, o = us.get(t + " torch._grouped_mm bf16"), us.get(t + " ours")
            lin = us.get(t + " ours+quant")
            rows = results.get("moe_rows", {}).get(t)
            lines.append(f"| {name} | {tokens} | {rows} | {fmt(c)} | {fmt(o)} | {fmt(lin)} | "
                         f"{ratio(c, o)} | {ratio(c, lin)} |")  # fmt: skip
    lines += ["", "| quantize 8192 x 8192 bf16 | us | bytes (read+written, minimum) | "
              "fraction of copy bandwidth |", "|---|---|---|---|"]  # fmt: skip
    for name, nbytes in results.get("quant_bytes", {}).items():
        t = us.get(f"quant {name}")
        frac = f"{nbytes / (t * 1e-6) / bw:.0%}" if t else "n/a"
        lines.append(f"| {name} | {fmt(t)} | {nbytes} | {frac} |")
    return "\n".join(lines)


def fmt(v: float | None) -> str:
    return f"{v:.1f}" if v else "n/a"


PARTS = ("square", "qwen", "grouped", "quantize")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="bitwise checks before timing")
    parser.add_argument("--variants", action="store_true", help="also time tile/decode variants")
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="output folder")
    parser.add_argument("--only", default=",".join(PARTS), help="parts to run, comma-separated")
    args = parser.parse_args()
    parts = [part for part in PARTS if part in args.only.split(",")]
    unknown = set(args.only.split(",")) - set(PARTS)
    if unknown or not parts:
        parser.error(f"--only takes parts of {','.join(PARTS)}; got {args.only!r}")
    results = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(sys.argv),
    }
    results["copy_bw"] = copy_bandwidth()
    print(f"copy bandwidth {results['copy_bw'] / 1e12:.2f} TB/s", flush=True)
    if args.check:
        run_checks(results)
    for part, fn in (("square", lambda: bench_square(results, args.variants)),
                     ("qwen", lambda: bench_qwen(results)),
                     ("grouped", lambda: bench_grouped(results)),
                     ("quantize", lambda: bench_quantize(results))):  # fmt: skip
        if part in parts:
            print(f"== {part}", flush=True)
            fn()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "results" if len(parts) == len(PARTS) else "results-" + "-".join(parts)
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    md = table(results)
    (out / f"{stem}.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
