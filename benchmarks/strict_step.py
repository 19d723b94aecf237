"""One decode step of a Qwen3-8B-shaped model, strict miniTE against default miniTE (issue 16).

    mkdir -p /tmp/pk && ln -sfn $PWD/kernels /tmp/pk/minite_kernels
    PYTHONPATH=$PWD:/tmp/pk python3 benchmarks/strict_step.py [--batches 1,16,64,256]
        [--context 1024] [--layers 36] [--no-graphs] [--out DIR]
    python benchmarks/strict_step.py --cpu-smoke   # tiny shapes on CPU, no timing

Both modes run the same NVFP4 linears (``minite_common.w4a4_linear`` on ``quantize_weight``
weights: qkv 4096->6144, o 4096->4096, gate/up 4096->2x12288, down 12288->4096), so the time
difference is the ops between them. Per decoder layer: input add+RMSNorm, qkv, per-head q/k
RMSNorm, rotary embedding (theta 1e6, NeoX), the new token's K/V into the KV cache, decode
attention over the ``--context`` cached tokens plus the new one (32 query / 8 KV heads of 128),
o, post-attention add+RMSNorm, gate/up, SwiGLU, down. Per step once ("head"): final
add+RMSNorm, LM head (vocabulary 151936, BF16 weight), log-softmax of the logits. One token per
sequence; every sequence has ``--context`` tokens cached.

- strict: what miniTE's strict vLLM adapters call (the call sequence of
  ``minite.strict_sampler.StrictSampler``): ``ops.add_rms_norm``, ``ops.rms_norm``,
  ``strict_forward.rotate`` (``ops.rope_cos_sin`` + ``ops.apply_rope``),
  ``strict_forward.write_kv_cache`` / ``cached_attention`` (``ops.paged_attention`` over a paged
  cache of 16-token blocks in random order), ``ops.swiglu``, ``ops.linear`` (LM head),
  ``ops.log_softmax``; on CUDA tensors the Triton kernels of ``minite_kernels.strict_ops``.
  ``ops.paged_attention`` pads each sequence's keys to a power of two (1025 keys run as 2048).
- default: what a non-strict engine runs, in torch: ``x + residual`` and ``F.rms_norm``, a torch
  NeoX rotary from a float32 cos/sin cache indexed by position (vLLM's ``cos_sin_cache``),
  ``F.scaled_dot_product_attention`` (GQA; restricted to the fused flash / cuDNN /
  memory-efficient kernels when they take the call, see ``fused_sdpa``) over a contiguous KV cache
  ``[batch, kv_heads, context + 1, 128]`` holding the same keys and values (vLLM's kernels read
  the paged cache in place; a contiguous cache keeps a gather out of the timed region), the new
  token's K/V copied into it, ``F.silu(g) * u``, ``F.linear`` (cuBLAS), ``log_softmax(-1,
  dtype=float32)``.

Timing: ``triton.testing.do_bench`` medians, plain (eager) launches for both modes, host time
included, under ``torch.inference_mode`` (the strict host code is not CUDA-graph capturable:
``paged_attention`` takes Python lists, the KV-cache write indexes with a device mask, and strict
vLLM runs ``enforce_eager``). ``DISTINCT`` layers with their own weights and KV caches run in a
chain per timed call (a layer's weights never sit in L2 when it runs), time per layer = call /
``DISTINCT``. The whole-model step
estimate is ``--layers`` x layer + head; overhead = strict / default - 1. For reference only, the
default layer and head are also timed as CUDA-graph replays (``do_bench_cudagraph``), what a
non-strict vLLM engine runs. Before timing, each batch runs the smoke comparison below on the GPU
too (recorded in the JSON). Results go to ``--out`` (``strict_step.json``, ``strict_step.md``).

``--cpu-smoke``: tiny shapes (hidden 64) on the CPU, one layer, 40 cached tokens, batches 1 and
3, both modes run once from the same inputs and caches and are compared (``smoke``: rotated q/k,
attention output, head, log-probs; ``tests/test_strict_step_benchmark.py`` bounds them, which
checks that both modes compute the same model). No timing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from strict_ops import rope_torch  # benchmarks/ (the script's directory)

from minite_common import NVFP4Recipe, ops, quantize_weight, w4a4_linear
from minite_vllm.strict_forward import cached_attention, rotate, write_kv_cache

DISTINCT = 4
BLOCK_SIZE = 16
DEFAULT_RECIPE = NVFP4Recipe()
STRICT_RECIPE = NVFP4Recipe(strict_ops=True)


@dataclasses.dataclass(frozen=True)
class Shape:
    """A Qwen3 dense model's shape."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    theta: float = 1e6
    eps: float = 1e-6

    @property
    def q_size(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.kv_heads * self.head_dim


QWEN3_8B = Shape(4096, 32, 8, 128, 12288, 151936)
TINY = Shape(64, 4, 2, 16, 96, 256)


def _rand(*shape: int, g: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """BF16 normal values on ``g``'s device."""
    x = torch.randn(*shape, generator=g, device=g.device, dtype=torch.bfloat16)
    return x.mul_(scale) if scale != 1.0 else x


def _norm_weight(n: int, g: torch.Generator) -> torch.Tensor:
    return (1 + 0.1 * torch.randn(n, generator=g, device=g.device)).bfloat16()


class LayerWeights:
    """One decoder layer's weights: norms in BF16, linears as NVFP4 under each recipe (the same
    codes; the recipe's fingerprint differs, and strict mode calls ``w4a4_linear`` with its own)."""

    def __init__(self, s: Shape, g: torch.Generator) -> None:
        shapes = {
            "qkv": (s.q_size + 2 * s.kv_size, s.hidden),
            "o": (s.hidden, s.q_size),
            "gate_up": (2 * s.ffn, s.hidden),
            "down": (s.hidden, s.ffn),
        }
        bf16 = {n: _rand(*sh, g=g, scale=sh[1] ** -0.5) for n, sh in shapes.items()}
        self.default = {n: quantize_weight(w, recipe=DEFAULT_RECIPE) for n, w in bf16.items()}
        self.strict = {n: quantize_weight(w, recipe=STRICT_RECIPE) for n, w in bf16.items()}
        self.input_norm = _norm_weight(s.hidden, g)
        self.post_norm = _norm_weight(s.hidden, g)
        self.q_norm = _norm_weight(s.head_dim, g)
        self.k_norm = _norm_weight(s.head_dim, g)


class Batch:
    """A decode step's metadata (as vLLM's model runner holds it): ``batch`` sequences with
    ``context`` cached tokens each, KV blocks of 16 tokens in random order (one block table for
    every layer); the new token of each sequence sits at position ``context``."""

    def __init__(
        self, s: Shape, batch: int, context: int, g: torch.Generator, device: torch.device
    ) -> None:
        self.batch, self.context = batch, context
        self.blocks = -(-(context + 1) // BLOCK_SIZE)  # per sequence
        table = torch.randperm(batch * self.blocks, generator=g, device=device)
        self.block_table = table.view(batch, self.blocks).to(torch.int32)
        self.positions = torch.full((batch,), context, dtype=torch.int64, device=device)
        self.query_starts = list(range(batch + 1))
        self.seq_lens = [context + 1] * batch
        block = self.block_table[:, context // BLOCK_SIZE].long()
        self.slot_mapping = block * BLOCK_SIZE + context % BLOCK_SIZE
        # vLLM's default rotary: a float32 cos/sin cache computed once, indexed by position
        inv_freq = 1.0 / (
            s.theta ** (torch.arange(0, s.head_dim, 2, dtype=torch.float32) / s.head_dim)
        )
        angles = torch.outer(torch.arange(context + 1, dtype=torch.float32), inv_freq)
        self.cos_cache, self.sin_cache = angles.cos().to(device), angles.sin().to(device)


class KVCache:
    """One layer's KV cache, twice with the same random values: the strict backend's paged cache
    ``[blocks, kv_heads, 16, 2 * head_dim]`` (read through ``b.block_table``) and the default
    path's contiguous ``k`` / ``v`` ``[batch, kv_heads, context + 1, head_dim]``."""

    def __init__(self, s: Shape, b: Batch, g: torch.Generator) -> None:
        shape = (b.batch * b.blocks, s.kv_heads, BLOCK_SIZE, 2 * s.head_dim)
        self.paged = _rand(*shape, g=g)
        cells = self.paged[b.block_table.long()]  # [batch, blocks, Hk, 16, 2d]
        cells = cells.permute(0, 2, 1, 3, 4).reshape(b.batch, s.kv_heads, -1, 2 * s.head_dim)
        self.k = cells[:, :, : b.context + 1, : s.head_dim].contiguous()
        self.v = cells[:, :, : b.context + 1, s.head_dim :].contiguous()


# -- the two modes ---------------------------------------------------------------------------------


def strict_layer(
    s: Shape,
    w: LayerWeights,
    cache: KVCache,
    b: Batch,
    hidden: torch.Tensor,
    residual,
    taps: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A Qwen3 decoder layer under the strict vLLM adapters (``StrictSampler._attention`` /
    ``_mlp`` and its layer loop)."""
    lin = w.strict
    hidden, residual = ops.add_rms_norm(hidden, residual, w.input_norm, s.eps)
    q, k, v = w4a4_linear(hidden, lin["qkv"], recipe=STRICT_RECIPE).split(
        [s.q_size, s.kv_size, s.kv_size], dim=-1
    )
    q = ops.rms_norm(q.view(-1, s.heads, s.head_dim), w.q_norm, s.eps).view(q.shape)
    k = ops.rms_norm(k.view(-1, s.kv_heads, s.head_dim), w.k_norm, s.eps).view(k.shape)
    q, k = rotate(b.positions, q, k, s.head_dim, s.head_dim, s.theta)
    output = torch.empty(q.shape[0], s.q_size, dtype=q.dtype, device=q.device)
    key = k.view(-1, s.kv_heads, s.head_dim)
    value = v.view(-1, s.kv_heads, s.head_dim)
    write_kv_cache(key, value, cache.paged, s.head_dim, b.slot_mapping)
    cached_attention(
        q.view(-1, s.heads, s.head_dim), cache.paged, s.head_dim, b.block_table,
        b.query_starts, b.seq_lens, s.head_dim**-0.5, output.view(-1, s.heads, s.head_dim),
    )  # fmt: skip
    if taps is not None:
        taps.update(q=q, k=k, attention=output)
    hidden = w4a4_linear(output, lin["o"], recipe=STRICT_RECIPE)
    hidden, residual = ops.add_rms_norm(hidden, residual, w.post_norm, s.eps)
    gate_up = w4a4_linear(hidden, lin["gate_up"], recipe=STRICT_RECIPE)
    return w4a4_linear(ops.swiglu(gate_up), lin["down"], recipe=STRICT_RECIPE), residual


def default_layer(
    s: Shape,
    w: LayerWeights,
    cache: KVCache,
    b: Batch,
    hidden: torch.Tensor,
    residual,
    taps: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same layer with torch's default ops (see the module docstring). ``taps`` (the smoke
    check) receives intermediate tensors."""
    lin = w.default
    residual = hidden + residual
    hidden = F.rms_norm(residual, (s.hidden,), w.input_norm, s.eps)
    q, k, v = w4a4_linear(hidden, lin["qkv"]).split([s.q_size, s.kv_size, s.kv_size], dim=-1)
    q = F.rms_norm(q.view(-1, s.heads, s.head_dim), (s.head_dim,), w.q_norm, s.eps)
    k = F.rms_norm(k.view(-1, s.kv_heads, s.head_dim), (s.head_dim,), w.k_norm, s.eps)
    cos, sin = b.cos_cache[b.positions][:, None], b.sin_cache[b.positions][:, None]
    q, k = rope_torch(q, cos, sin), rope_torch(k, cos, sin)
    cache.k[:, :, b.context] = k
    cache.v[:, :, b.context] = v.view(-1, s.kv_heads, s.head_dim)
    out = F.scaled_dot_product_attention(
        q[:, :, None], cache.k, cache.v, scale=s.head_dim**-0.5, enable_gqa=True
    )  # [batch, heads, 1, d]
    out = out.reshape(-1, s.q_size)
    if taps is not None:
        taps.update(q=q.reshape(-1, s.q_size), k=k.reshape(-1, s.kv_size), attention=out)
    hidden = w4a4_linear(out, lin["o"])
    residual = hidden + residual
    hidden = F.rms_norm(residual, (s.hidden,), w.post_norm, s.eps)
    gate_up = w4a4_linear(hidden, lin["gate_up"])
    act = F.silu(gate_up[:, : s.ffn]) * gate_up[:, s.ffn :]
    return w4a4_linear(act, lin["down"]), residual


def strict_head(s: Shape, head: dict, hidden: torch.Tensor, residual) -> torch.Tensor:
    """Final add+RMSNorm, LM head (``StrictLMHeadMethod``), the sampler's log-probs."""
    hidden, _ = ops.add_rms_norm(hidden, residual, head["norm"], s.eps)
    return ops.log_softmax(ops.linear(hidden, head["lm_head"]))


def default_head(s: Shape, head: dict, hidden: torch.Tensor, residual) -> torch.Tensor:
    hidden = F.rms_norm(hidden + residual, (s.hidden,), head["norm"], s.eps)
    return F.linear(hidden, head["lm_head"]).log_softmax(dim=-1, dtype=torch.float32)


# -- driver ----------------------------------------------------------------------------------------


class Step:
    """``DISTINCT`` layers (own weights and KV caches) and the head at one batch size, with fixed
    inputs: ``layers(strict)`` runs the layers in a chain, ``head(strict)`` the head."""

    def __init__(
        self, s: Shape, weights: list[LayerWeights], head: dict, batch: int, context: int,
        g: torch.Generator,
    ) -> None:  # fmt: skip
        self.s, self.weights, self.head_weights = s, weights, head
        self.b = Batch(s, batch, context, g, g.device)
        self.caches = [KVCache(s, self.b, g) for _ in weights]
        self.x = _rand(batch, s.hidden, g=g)  # the previous layer's output
        self.residual = _rand(batch, s.hidden, g=g)

    def layers(self, strict: bool, taps: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The layers in a chain; ``taps`` gets the first layer's intermediates."""
        fn = strict_layer if strict else default_layer
        hidden, residual = self.x, self.residual
        for i, (w, cache) in enumerate(zip(self.weights, self.caches, strict=True)):
            hidden, residual = fn(
                self.s, w, cache, self.b, hidden, residual, taps if i == 0 else None
            )
        return hidden, residual

    def head(self, strict: bool, hidden=None, residual=None) -> torch.Tensor:
        hidden = self.x if hidden is None else hidden
        residual = self.residual if residual is None else residual
        fn = strict_head if strict else default_head
        return fn(self.s, self.head_weights, hidden, residual)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def smoke(step: Step) -> dict[str, float]:
    """Both modes once from the same inputs and caches (the model: the layers, then the head):
    relative differences of the first layer's rotated q/k and attention output (the ops before
    any NVFP4 linear after the qkv one: BF16 rounding apart), of the head on the same inputs, and
    of the whole model's layer output and log-probs (there an ulp that moves an activation to
    another E2M1 code grows, as without strict mode)."""
    outs, taps = {}, {False: {}, True: {}}
    for strict in (False, True):
        hidden, residual = step.layers(strict, taps[strict])
        outs[strict] = hidden, residual, step.head(strict, hidden, residual)
    (h0, r0, lp0), (h1, r1, lp1) = outs[False], outs[True]
    head0, head1 = step.head(False), step.head(True)
    return {
        **{f"{k}_rel": _rel(taps[True][k], taps[False][k]) for k in ("q", "k", "attention")},
        "head_logprobs_max_abs": float((head1 - head0).abs().max()),
        "layer_out_rel": _rel(h1, h0),
        "residual_rel": _rel(r1, r0),
        "logprobs_max_abs": float((lp1 - lp0).abs().max()),
        "logprobs_rel": _rel(lp1, lp0),
        "argmax_equal": float((lp1.argmax(-1) == lp0.argmax(-1)).float().mean()),
        "finite": float(bool(torch.isfinite(lp1).all() and torch.isfinite(lp0).all())),
    }


def timed(step: Step, graphs: bool) -> dict[str, float | None]:
    """Milliseconds per layer and for the head, each mode (see the module docstring)."""
    import triton.testing

    def bench(fn: Callable[[], object]) -> float:
        fn()  # compile / autotune outside the measurement
        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")

    n = len(step.weights)
    out: dict[str, float | None] = {
        "layer_default_ms": bench(lambda: step.layers(False)) / n,
        "layer_strict_ms": bench(lambda: step.layers(True)) / n,
        "head_default_ms": bench(lambda: step.head(False)),
        "head_strict_ms": bench(lambda: step.head(True)),
    }
    out["layer_default_graph_ms"] = out["head_default_graph_ms"] = None
    if graphs:
        try:
            out["layer_default_graph_ms"] = (
                triton.testing.do_bench_cudagraph(
                    lambda: step.layers(False), rep=100, return_mode="median"
                )
                / n
            )
            out["head_default_graph_ms"] = triton.testing.do_bench_cudagraph(
                lambda: step.head(False), rep=100, return_mode="median"
            )
        except Exception as exc:  # noqa: BLE001  (reference figure only: record and go on)
            out["graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return out


def fused_sdpa(s: Shape, device: torch.device) -> tuple[Callable, str]:
    """A context factory restricting SDPA to its fused CUDA kernels (flash, cuDNN,
    memory-efficient) when they take the default mode's decode call, so that it never runs the
    unfused math kernel unnoticed; else no restriction. Returns the factory and its label."""
    if device.type != "cuda":
        return contextlib.nullcontext, "torch default (CPU)"
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    q = torch.randn(2, s.heads, 1, s.head_dim, device=device, dtype=torch.bfloat16)
    kv = torch.randn(2, s.kv_heads, 33, s.head_dim, device=device, dtype=torch.bfloat16)
    try:
        with sdpa_kernel(fused):
            F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    except RuntimeError as exc:
        return contextlib.nullcontext, f"unrestricted (fused kernels refused: {exc})"[:300]
    return functools.partial(
        sdpa_kernel, fused
    ), "fused kernels only (flash / cuDNN / memory-efficient)"


def run_batch(step: Step, args: argparse.Namespace, sdpa: Callable) -> dict:
    """The smoke comparison at one batch size, then (GPU) the timings and the step estimate."""
    with sdpa():
        row: dict = {"batch": step.b.batch, **smoke(step)}
        if args.cpu_smoke:
            return row
        row.update(timed(step, args.graphs))
    n = args.layers
    row["step_default_ms"] = n * row["layer_default_ms"] + row["head_default_ms"]
    row["step_strict_ms"] = n * row["layer_strict_ms"] + row["head_strict_ms"]
    if row["layer_default_graph_ms"] is not None:
        row["step_default_graph_ms"] = (
            n * row["layer_default_graph_ms"] + row["head_default_graph_ms"]
        )
    row["overhead_pct"] = 100.0 * (row["step_strict_ms"] / row["step_default_ms"] - 1)
    return row


def table(rows: list[dict], layers: int) -> str:
    nan = float("nan")
    lines = [
        f"| batch | layer default ms | layer strict ms | head default ms | head strict ms | "
        f"step default ms ({layers} layers + head) | step strict ms | default step, CUDA graph "
        "ms | overhead strict/default - 1 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        graph = r.get("step_default_graph_ms")
        lines.append(
            f"| {r['batch']} | {r['layer_default_ms']:.3f} | {r['layer_strict_ms']:.3f} | "
            f"{r['head_default_ms']:.3f} | {r['head_strict_ms']:.3f} | "
            f"{r['step_default_ms']:.2f} | {r['step_strict_ms']:.2f} | "
            f"{nan if graph is None else graph:.2f} | {r['overhead_pct']:+.1f}% |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--context", type=int, default=1024, help="tokens cached per sequence")
    parser.add_argument("--layers", type=int, default=36, help="decoder layers of the estimate")
    parser.add_argument(
        "--no-graphs", dest="graphs", action="store_false", help="no CUDA-graph reference timing"
    )
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU, no timing")
    parser.add_argument("--out", default=os.environ.get("OUT", "strict-step-out"))
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        shape, distinct, device = TINY, 1, torch.device("cpu")
        batches, context = [1, 3], 40
    else:
        shape, distinct, device = QWEN3_8B, DISTINCT, torch.device("cuda")
        batches, context = [int(b) for b in args.batches.split(",")], args.context
    meta: dict = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(sys.argv if argv is None else ["strict_step.py", *argv]),
        "torch": torch.__version__,
        "shape": dataclasses.asdict(shape),
        "context": context,
        "layers": args.layers,
        "distinct_layers": distinct,
        "timing": None if args.cpu_smoke else "triton.testing.do_bench median, eager launches",
    }
    if device.type == "cuda":
        import triton

        meta.update(device=torch.cuda.get_device_name(), triton=triton.__version__)
    sdpa, meta["default_sdpa"] = fused_sdpa(shape, device)
    rows = []
    with torch.inference_mode():  # as vLLM runs its model
        g = torch.Generator(device=device).manual_seed(0)
        weights = [LayerWeights(shape, g) for _ in range(distinct)]
        head = {
            "norm": _norm_weight(shape.hidden, g),
            "lm_head": _rand(shape.vocab, shape.hidden, g=g, scale=shape.hidden**-0.5),
        }
        for batch in batches:
            step = Step(shape, weights, head, batch, context, g)
            row = run_batch(step, args, sdpa)
            rows.append(row)
            print(json.dumps(row), flush=True)
            del step
            if device.type == "cuda":
                torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "strict_step.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    if args.cpu_smoke:
        print("cpu smoke: both modes ran at batches", batches, "(no timing)")
        return 0
    md = "\n".join(
        [
            f"Device: {meta['device']}; torch {meta['torch']}, triton {meta['triton']}; "
            f"{meta['date']}. One decode step of a Qwen3-8B-shaped model, context {context} "
            f"tokens per sequence, NVFP4 linears in both modes; do_bench medians, eager launches "
            f"(the CUDA-graph column is the default mode replayed as a graph, for reference); "
            f"default SDPA: {meta['default_sdpa']}.",
            "",
            table(rows, args.layers),
            "",
            "Overhead of strict mode (whole step, strict / default - 1): "
            + ", ".join(f"batch {r['batch']}: {r['overhead_pct']:+.1f}%" for r in rows),
        ]
    )
    (out / "strict_step.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
