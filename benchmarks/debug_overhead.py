"""Overhead of precision debugging on one W4A4 linear (the debug hooks of both plugins).

Variants, timed in the same run: the plain linear; a debug configuration active that does not
select this layer (what every other layer sees: nothing is hooked); statistics logging on this
layer every call, and every 100th call. Prints a ratio table last.

    python benchmarks/debug_overhead.py [--m 4096 --n 4096 --k 4096] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from minite_common import quantize_weight, w4a4_linear
from minite_common.debug import DebugConfig, activate, deactivate, linear_hook

LAYER = "model.layers.0.mlp.down_proj"


class Linear(torch.nn.Module):
    """A W4A4 linear as the plugins run it (the quantized weight cached)."""

    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(w, requires_grad=False)
        self.w_q = quantize_weight(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return w4a4_linear(x, self.w_q)


def timed(fn, x: torch.Tensor, iters: int) -> float:
    """Mean seconds per call, so that periodic logging is amortized (CUDA events on the GPU)."""
    for _ in range(3):
        fn(x)
    samples = []
    for _ in range(iters):
        if x.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(x)
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn(x)
            samples.append(time.perf_counter() - t)
    return statistics.fmean(samples)


def module_with(config: DebugConfig | None, w: torch.Tensor) -> Linear:
    """The linear with the hooks a plugin would attach under ``config``."""
    module = Linear(w)
    activate(config, "benchmark")
    try:
        hook = linear_hook("benchmark", [LAYER], lambda name: module.weight)
    finally:
        deactivate("benchmark")
    if hook is not None:
        module.register_forward_hook(hook)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=4096)
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="minite-dbg-")))
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.m, args.k, generator=gen).to(torch.bfloat16).to(device)
    w = (torch.randn(args.n, args.k, generator=gen) / args.k**0.5).to(torch.bfloat16).to(device)
    stats = {"output_dir": str(args.out)}
    variants = {
        "plain (no debug config)": None,
        "debug config active, layer not selected": DebugConfig.from_dict(
            {**stats, "rules": [{"layers": "model.layers.9.*", "disable_quantization": True}]}
        ),
        "stats on this layer every 100th call": DebugConfig.from_dict(
            {**stats, "rules": [{"layers": LAYER, "log_tensor_stats": {"freq": 100}}]}
        ),
        "stats on this layer every call": DebugConfig.from_dict(
            {**stats, "rules": [{"layers": LAYER, "log_tensor_stats": {"freq": 1}}]}
        ),
    }
    times = {}
    with torch.no_grad():
        for name, config in variants.items():
            times[name] = timed(module_with(config, w), x, args.iters)
        times["plain (again, the noise)"] = timed(module_with(None, w), x, args.iters)
    device_name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"W4A4 linear {args.m}x{args.n}x{args.k} on {device_name}, mean of {args.iters} calls")
    base = times["plain (no debug config)"]
    print(f"{'variant':44s} {'ms':>9s} {'vs plain':>9s}")
    for name, t in times.items():
        print(f"{name:44s} {t * 1e3:9.3f} {t / base:8.3f}x")


if __name__ == "__main__":
    main()
