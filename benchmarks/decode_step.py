"""One decode step's linear layers, miniTE W4A4 against BF16, under CUDA graphs (issue 13).

    PYTHONPATH=$PWD python benchmarks/decode_step.py [--batches 1,16,64,256] [--out DIR]

Two layer shapes, each at every batch size (tokens in the decode step):
- Qwen3-30B-A3B-shaped MoE layer: qkv 2048->5120, o 4096->2048, router 2048->128 (BF16 in both:
  the recipe keeps routers in high precision), 128 experts top-8 (gate/up 2048->2x768, SwiGLU,
  down 768->2048) through the grouped kernel, routing on the device;
- Qwen3-8B-shaped dense layer: qkv 4096->6144, o 4096->4096, gate/up 4096->2x12288, down
  12288->4096.
miniTE runs the public ``w4a4_linear`` / ``grouped_w4a4_linear`` from BF16 activations (the
activation quantization included) on weights with their kernel layout (``with_kernel_layout``), as
the vLLM plugin holds and calls them; BF16 runs cuBLAS matmuls and
``torch._grouped_mm``. Both run the same glue (routing, permutation, SwiGLU, combine), so the
time difference is the linears'. Each timed graph replays ``LAYERS`` layers with distinct weights
(a layer's weights never sit in L2 when it runs); times are per layer, medians of replays.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.testing

from minite_common import (
    expert_counts,
    grouped_w4a4_linear,
    quantize_weight,
    w4a4_linear,
    with_kernel_layout,
)
from minite_common.grouped import expert_swiglu

LAYERS = 4
EXPERTS, TOP_K = 128, 8


def _rand(*shape: int, g: torch.Generator) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda", generator=g) * shape[-1] ** -0.5).bfloat16()


class MoELayer:
    """Weights of one Qwen3-30B-A3B-shaped layer, in BF16 and as miniTE NVFP4."""

    hidden, qkv, attn, ffn = 2048, 5120, 4096, 768

    def __init__(self, g: torch.Generator):
        h, f = self.hidden, self.ffn
        self.w = {
            "qkv": _rand(self.qkv, h, g=g),
            "o": _rand(h, self.attn, g=g),
            "router": _rand(EXPERTS, h, g=g),
            "gate_up": _rand(EXPERTS, 2 * f, h, g=g),
            "down": _rand(EXPERTS, h, f, g=g),
        }
        self.q = {
            "qkv": with_kernel_layout(quantize_weight(self.w["qkv"])),
            "o": with_kernel_layout(quantize_weight(self.w["o"])),
            "gate_up": quantize_weight(self.w["gate_up"].reshape(-1, h)),
            "down": quantize_weight(self.w["down"].reshape(-1, f)),
        }
        # torch._grouped_mm takes [G, K, N]: views of the [G, N, K] weights.
        self.gate_up_t = self.w["gate_up"].transpose(1, 2)
        self.down_t = self.w["down"].transpose(1, 2)

    def step(self, x: torch.Tensor, attn_out: torch.Tensor, minite: bool) -> torch.Tensor:
        tokens = x.shape[0]
        if minite:
            qkv = w4a4_linear(x, self.q["qkv"])
            o = w4a4_linear(attn_out, self.q["o"])
        else:
            qkv = x @ self.w["qkv"].t()
            o = attn_out @ self.w["o"].t()
        logits = o @ self.w["router"].t()
        weights, experts = torch.softmax(logits.float(), -1).topk(TOP_K, dim=-1)
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        sizes = expert_counts(flat, EXPERTS)
        rows = o.index_select(0, order // TOP_K)
        if minite:
            gate_up = grouped_w4a4_linear(rows, self.q["gate_up"], sizes)
            down = grouped_w4a4_linear(expert_swiglu(gate_up), self.q["down"], sizes)
        else:
            offs = sizes.cumsum(0).to(torch.int32)
            gate_up = torch._grouped_mm(rows, self.gate_up_t, offs=offs, out_dtype=torch.bfloat16)
            down = torch._grouped_mm(
                expert_swiglu(gate_up), self.down_t, offs=offs, out_dtype=torch.bfloat16
            )
        per_slot = torch.empty_like(down)
        per_slot[order] = down
        out = (per_slot.view(tokens, TOP_K, -1).float() * weights[..., None]).sum(1)
        return out.bfloat16() + qkv[:, : self.hidden]


class DenseLayer:
    """Weights of one Qwen3-8B-shaped dense layer, in BF16 and as miniTE NVFP4."""

    hidden, qkv, attn, ffn = 4096, 6144, 4096, 12288

    def __init__(self, g: torch.Generator):
        h = self.hidden
        self.w = {
            "qkv": _rand(self.qkv, h, g=g),
            "o": _rand(h, self.attn, g=g),
            "gate_up": _rand(2 * self.ffn, h, g=g),
            "down": _rand(h, self.ffn, g=g),
        }
        self.q = {name: with_kernel_layout(quantize_weight(w)) for name, w in self.w.items()}

    def step(self, x: torch.Tensor, attn_out: torch.Tensor, minite: bool) -> torch.Tensor:
        def lin(t: torch.Tensor, name: str) -> torch.Tensor:
            return w4a4_linear(t, self.q[name]) if minite else t @ self.w[name].t()

        qkv = lin(x, "qkv")
        o = lin(attn_out, "o")
        gate_up = lin(o, "gate_up")
        down = lin(expert_swiglu(gate_up), "down")
        return down + qkv[:, : self.hidden]


def time_step(layers: list, tokens: int, minite: bool, g: torch.Generator) -> float:
    """Median microseconds per layer of one decode step, replayed as one CUDA graph."""
    hidden, attn = layers[0].hidden, layers[0].attn
    x = _rand(tokens, hidden, g=g)
    attn_out = _rand(tokens, attn, g=g)

    def run() -> None:
        for layer in layers:
            layer.step(x, attn_out, minite)

    ms = triton.testing.do_bench_cudagraph(run, rep=50, return_mode="median")
    return ms * 1000.0 / len(layers)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    g = torch.Generator(device="cuda").manual_seed(0)
    results: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(sys.argv),
        "us_per_layer": {},
    }
    rows = []
    for name, cls in (("Qwen3-30B-A3B MoE layer", MoELayer), ("Qwen3-8B dense layer", DenseLayer)):
        layers = [cls(g) for _ in range(LAYERS)]
        for tokens in batches:
            bf16 = time_step(layers, tokens, False, g)
            ours = time_step(layers, tokens, True, g)
            results["us_per_layer"][f"{name} B={tokens}"] = {"bf16": bf16, "minite": ours}
            rows.append(f"| {name} | {tokens} | {bf16:.1f} | {ours:.1f} | {bf16 / ours:.2f}x |")
            print(rows[-1], flush=True)
        del layers
        torch.cuda.empty_cache()
    md = "\n".join(
        [
            f"Device: {results['device']}; torch {results['torch']}, triton {results['triton']}; "
            f"{results['date']}. Per layer, one decode step, CUDA-graph replay.",
            "",
            "| layer | batch | BF16 us | miniTE us | miniTE speed vs BF16 |",
            "|---|---|---|---|---|",
            *rows,
        ]
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_step.json").write_text(json.dumps(results, indent=1))
    (out / "decode_step.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
