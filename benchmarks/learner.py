"""Learner speed: forward+backward of one Megatron-Core transformer layer, BF16 vs miniTE NVFP4.

Layers (Megatron-Core's local, non-TE specs; RMSNorm, q/k RMSNorm, SwiGLU, RoPE, no biases):

- ``moe``: Qwen3-30B-A3B-shaped: hidden 2048, 32 query / 4 KV heads of 128, 128 experts of 768,
  top-8 routing (all-to-all dispatcher, one rank). Megatron's local spec runs the experts through
  ``SequentialMLP`` (a Python loop over the experts) in BF16 and in miniTE alike: Megatron 0.19
  without Transformer Engine has no grouped-GEMM expert path for training (``TEGroupedMLP`` needs
  TE; ``InferenceGroupedMLP`` is inference-only), so that pair is the fairest one available.
- ``dense``: an 8B-shaped layer: hidden 4096, FFN 12288, 32 query / 8 KV heads of 128.

Variants (same weights, same routing function, same inputs):

- ``bf16``: Megatron's local spec (``get_gpt_decoder_block_spec(use_transformer_engine=False)``);
- ``bf16_grouped`` (MoE layer only): the same spec with ``SequentialMLP`` replaced by
  :class:`BF16GroupedMLP`: every local expert's BF16 weights stacked, fc1 and fc2 as one
  ``torch._grouped_mm`` each (cuBLAS/CUTLASS grouped GEMMs, autograd included), the same router,
  dispatcher, SwiGLU and probability product. This is the fair BF16 peer of ``minite_grouped``
  (what Transformer Engine's ``TEGroupedMLP`` gives a BF16 MoE learner), and every MoE ratio is
  quoted against it; ``SequentialMLP`` stays beside it as Megatron's host-bound local loop;
- ``minite``: ``minite_megatron.get_gpt_decoder_block_minite_spec``: W4A4 NVFP4 fprop (the
  sampler's Triton kernels), NVFP4 dgrad/wgrad (stochastic rounding, RHT) as the learner runs;
- ``minite_qonly`` ("miniTE quantize + BF16 GEMMs", a benchmark-only variant): the miniTE
  modules with every quantize kernel running on the same operands as ``minite`` (activation
  quantize in forward, the backward operand kernels in backward) but their results discarded
  and the three GEMMs done by cuBLAS in BF16 on the unquantized tensors. ``qonly - bf16`` is
  the quantize cost (plus miniTE's Python overhead); ``minite - qonly`` is the GEMM cost;
- ``minite_nvfp4bwd`` (optional): miniTE with the backward as first shipped (dgrad/wgrad through
  the Triton NVFP4 GEMM, stochastic rounding in torch), for a before/after figure;
- ``minite_grouped`` (MoE layer only): the miniTE spec with ``grouped_experts=True``: the experts
  in ``minite_megatron.MiniTEGroupedMLP`` (grouped W4A4 forward, grouped NVFP4 backward, one
  stacked weight quantization per optimizer step) instead of ``SequentialMLP``. With it, a GPU
  run first checks the grouped kernels against their per-expert counterparts
  (:func:`check_grouped_numerics`);
- ``minite_strict`` (not run unless named in ``--variants``): the miniTE spec under
  ``NVFP4Recipe(strict_ops=True)`` (``docs/strict.md``): the same NVFP4 linears, every op between
  them through ``minite_common.ops`` (Triton kernels on the GPU; backward passes are their
  fixed-order torch code), ``use_te_activation_func=True``, the rotary embedding applied by the
  strict attention core (the layer gets ``rotary_pos_emb=None``) and the core attention kept
  strict (``--attention`` does not apply). Its overhead over ``minite`` (strict ms / miniTE ms - 1,
  same layer, seq and micro-batch) is tabled last. The strict attention backward runs
  ``CHUNK_ELEMENTS // (heads * seq * head_dim)`` query rows per chunk, about a hundred torch
  kernels each (one row at seq 4096: seconds per sequence), so run it on few tokens.

The core attention is the same module for every variant: by default (``--attention sdpa``)
``torch.nn.functional.scaled_dot_product_attention`` restricted to its fused kernels (flash /
cuDNN / memory-efficient), standing in for the fused attention a real learner uses; Megatron's
unfused local ``DotProductAttention`` (``--attention local``) materializes the S x S scores.

Per configuration: the median of ``--iters`` timed forward+backward iterations (CUDA events,
weights' quantized copies cached as between micro-batches of one optimizer step), tokens/s,
peak memory, host time per iteration; one ``torch.profiler`` iteration splits the GPU time into
quantize kernels, GEMMs (NVFP4 decode kernels included), attention, the rest and idle (iteration
time minus kernel time: launch-bound gaps); one iteration after invalidating the quantized weights
gives the per-optimizer-step cost. The split is set against counted FLOPs and bytes and the
ceilings measured in the same run. Results go to ``--out`` (JSON and log); tables print last.

GPU (repo root, with ``minite_kernels`` importable and Megatron-Core installed)::

    python3 benchmarks/learner.py --out $OUT

Strict against default miniTE (issue 16; dense layer, few tokens, no profiler pass)::

    python3 benchmarks/learner.py --layers dense --seqs 1024,4096 --tokens 4096 \
        --variants minite,minite_strict --nvfp4bwd-seqs "" --iters 3 --warmup 1 --no-profile \
        --no-checks --no-host --out $OUT

CPU smoke test (tiny shapes, Megatron-Core 0.16.1, builds and runs every variant once)::

    python benchmarks/learner.py --cpu-smoke [--variants minite,minite_strict]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import types
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

warnings.filterwarnings("ignore")

VARIANTS = {
    "bf16": "BF16 local spec",
    "bf16_grouped": "BF16 grouped experts (torch._grouped_mm)",
    "minite": "miniTE NVFP4",
    "minite_qonly": "miniTE quantize + BF16 GEMMs",
    "minite_nvfp4bwd": "miniTE, NVFP4-GEMM backward (as first shipped)",
    "minite_grouped": "miniTE NVFP4, grouped experts",
    "minite_strict": "miniTE NVFP4, strict ops",
}
#: Variants that only differ from ``minite`` in a MoE layer.
MOE_ONLY_VARIANTS = ("bf16_grouped", "minite_grouped")
#: Variants whose layer is BF16 (no NVFP4 weights to re-quantize per optimizer step).
BF16_VARIANTS = ("bf16", "bf16_grouped")
#: Variants built with ``NVFP4Recipe(strict_ops=True)`` (their attention core applies the rotary
#: embedding; the SDPA core attention is not swapped in).
STRICT_VARIANTS = ("minite_strict",)


@dataclass(frozen=True)
class LayerShape:
    """One transformer layer's shape (HF Qwen3 / Qwen3-MoE naming)."""

    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    experts: int = 0
    topk: int = 0
    expert_ffn: int = 0

    def hf_config(self) -> types.SimpleNamespace:
        """A minimal HF-style config for ``minite_megatron.transformer_config_from_hf``."""
        ns = types.SimpleNamespace(
            model_type="qwen3_moe" if self.experts else "qwen3",
            attention_bias=False,
            use_sliding_window=False,
            rope_parameters={"rope_theta": 1e6, "rope_type": "default"},
            rope_theta=1e6,
            num_hidden_layers=1,
            hidden_size=self.hidden,
            intermediate_size=self.ffn,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=1e-6,
            vocab_size=1024,
            max_position_embeddings=65536,
            tie_word_embeddings=False,
        )
        if self.experts:
            ns.num_experts, ns.num_experts_per_tok = self.experts, self.topk
            ns.moe_intermediate_size = self.expert_ffn
            ns.norm_topk_prob, ns.decoder_sparse_step, ns.mlp_only_layers = True, 1, []
        return ns

    def linears(self, tokens: int) -> list[tuple[str, int, int, int]]:
        """``(name, rows, N, K)`` of every quantized linear of one micro-batch (rows summed
        over the experts for MoE)."""
        qkv = (self.heads + 2 * self.kv_heads) * self.head_dim
        out = [
            ("qkv", tokens, qkv, self.hidden),
            ("proj", tokens, self.hidden, self.heads * self.head_dim),
        ]
        if self.experts:
            rows = tokens * self.topk
            out += [
                ("experts.fc1", rows, 2 * self.expert_ffn, self.hidden),
                ("experts.fc2", rows, self.hidden, self.expert_ffn),
            ]
        else:
            out += [
                ("fc1", tokens, 2 * self.ffn, self.hidden),
                ("fc2", tokens, self.hidden, self.ffn),
            ]
        return out


LAYERS = {
    "moe": LayerShape("moe", 2048, 32, 4, 128, 6144, experts=128, topk=8, expert_ffn=768),
    "dense": LayerShape("dense", 4096, 32, 8, 128, 12288),
}
TINY = {
    "moe": LayerShape("moe", 64, 4, 2, 16, 96, experts=4, topk=2, expert_ffn=32),
    "dense": LayerShape("dense", 64, 4, 2, 16, 96),
}


# ---------------------------------------------------------------------------------------------
# Counted work


def count_work(shape: LayerShape, seq: int, batch: int) -> dict[str, float]:
    """FLOPs and minimum bytes of one forward+backward (see the module docstring)."""
    tokens = seq * batch
    gemm_flops = sum(6.0 * r * n * k for _, r, n, k in shape.linears(tokens))
    router_flops = 6.0 * tokens * shape.hidden * shape.experts if shape.experts else 0.0
    # Causal attention: QK^T and PV, 2 * s^2 * d per head per sample forward; backward 2.5x.
    attn_flops = 3.5 * 2.0 * seq * seq * shape.head_dim * shape.heads * batch
    quant_bytes = 0.0
    decode_bytes = 0.0
    for _, r, n, k in shape.linears(tokens):
        r16 = -(-r // 16) * 16
        quant_bytes += r * k * 2 + r * k * (0.5 + 1 / 16) + r * 4  # fprop activation quantize
        quant_bytes += 2 * r * n * 2 + r * n * 2 + r16 * n * 2  # grad: 2 passes, row + col out
        quant_bytes += 2 * r * k * 2 + r16 * k * 2  # wgrad x operand: 2 passes, col out
        decode_bytes += r * k * (0.5625 + 2)  # fprop large-M path: activation decoded to BF16
    return dict(
        tokens=tokens,
        gemm_flops=gemm_flops,
        router_flops=router_flops,
        attn_flops=attn_flops,
        quant_bytes=quant_bytes,
        decode_bytes=decode_bytes,
    )


# ---------------------------------------------------------------------------------------------
# Layers


class SDPACoreAttention(torch.nn.Module):
    """Causal core attention through ``scaled_dot_product_attention`` (Megatron's core-attention
    interface: ``[s, b, heads, d]`` query, ``[s, b, groups, d]`` key/value -> ``[s, b, h*d]``).

    KV groups are repeated to the query heads as Megatron's ``DotProductAttention`` does. On CUDA
    only the fused kernels are allowed, so a missing fused kernel fails instead of silently
    materializing S x S scores.
    """

    def __init__(
        self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str, **kw: Any
    ) -> None:
        super().__init__()
        self.config = config
        self.softmax_scale = kw.get("softmax_scale")

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        **_: Any,
    ) -> torch.Tensor:
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if k.shape[1] != q.shape[1]:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        with _fused_sdpa(q.device):
            o = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.softmax_scale
            )
        s, b = o.shape[2], o.shape[0]
        return o.permute(2, 0, 1, 3).reshape(s, b, -1)


def _fused_sdpa(device: torch.device) -> contextlib.AbstractContextManager:
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(
        [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    )


def build_layer(shape: LayerShape, variant: str, attention: str, device: torch.device):
    """One ``TransformerLayer`` (layer_number 1) of ``shape`` for ``variant``, seeded so that
    every variant gets the same weights."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.spec_utils import build_module

    import minite_megatron as mm
    from minite_common import NVFP4Recipe

    strict = variant in STRICT_VARIANTS
    hf = shape.hf_config()
    # strict mode: MLPs call the spec's activation module (StrictSwiGLU); no TE code runs
    config = mm.transformer_config_from_hf(
        hf, **({"use_te_activation_func": True} if strict else {})
    )
    if variant in BF16_VARIANTS:
        block = get_gpt_decoder_block_spec(
            config, use_transformer_engine=False, normalization=config.normalization
        )
    else:
        block = mm.get_gpt_decoder_block_minite_spec(
            config,
            NVFP4Recipe(strict_ops=strict),
            grouped_experts=variant == "minite_grouped",
            rotary_base=hf.rope_theta if strict else None,
        )
    spec = block.layer_specs[0]
    if variant == "bf16_grouped":
        spec = bf16_grouped_spec(spec)
    if attention == "sdpa" and not strict:  # strict: StrictDotProductAttention stays
        from minite_megatron.spec_tree import replace_class

        spec = replace_class(spec, DotProductAttention, SDPACoreAttention)
    torch.manual_seed(0)
    if device.type == "cuda":
        model_parallel_cuda_manual_seed(0)
    layer = build_module(spec, config=config, layer_number=1)
    return layer.to(device=device, dtype=torch.bfloat16), config


# ---------------------------------------------------------------------------------------------
# The grouped BF16 experts baseline


class BF16GroupedMLP(torch.nn.Module):
    """BF16 SwiGLU experts with Megatron's ``SequentialMLP`` interface, all local experts in two
    ``torch._grouped_mm`` calls (forward and autograd backward): ``linear_fc1.weight``
    [experts, 2 * ffn, hidden] (each expert's gate rows, then its up rows, as ``SequentialMLP``'s
    GLU split) and ``linear_fc2.weight`` [experts, hidden, ffn]. Initialized expert by expert,
    fc1 then fc2, as ``SequentialMLP``'s expert MLPs are (GPU: under the expert-parallel RNG
    tracker). The activation is Megatron's unfused local one, ``bf16(silu(gate) * up)``, then
    ``bf16(act * prob)``; the group offsets stay on the device (no host synchronization)."""

    def __init__(
        self,
        num_local_experts: int,
        config: Any,
        submodules: Any = None,
        pg_collection: Any = None,
        name: str | None = None,
    ) -> None:
        super().__init__()
        if not config.gated_linear_unit or config.add_bias_linear:
            raise ValueError("BF16GroupedMLP: needs SwiGLU experts without biases")
        self.config = config
        self.num_local_experts = num_local_experts
        ffn, hidden = config.moe_ffn_hidden_size, config.hidden_size
        dtype = config.params_dtype
        dev = None if config.use_cpu_initialization else torch.cuda.current_device()
        self.linear_fc1 = torch.nn.Module()
        self.linear_fc2 = torch.nn.Module()
        self.linear_fc1.weight = torch.nn.Parameter(
            torch.empty(num_local_experts, 2 * ffn, hidden, dtype=dtype, device=dev)
        )
        self.linear_fc2.weight = torch.nn.Parameter(
            torch.empty(num_local_experts, hidden, ffn, dtype=dtype, device=dev)
        )
        for p in (self.linear_fc1.weight, self.linear_fc2.weight):
            p.allreduce = False  # expert parameters: not data-parallel across the EP group
        if config.perform_initialization:
            self._initialize()

    def _initialize(self) -> None:
        from minite_megatron.experts import init_stacked_experts

        init_stacked_experts(self.config, self.linear_fc1.weight, self.linear_fc2.weight)

    def forward(
        self,
        permuted_local_hidden_states: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        permuted_probs: torch.Tensor,
    ) -> tuple[torch.Tensor, None]:
        """Rows grouped by local expert (``tokens_per_expert``) -> expert outputs, rows alike."""
        x = permuted_local_hidden_states
        offs = torch.cumsum(tokens_per_expert.to(x.device), 0).to(torch.int32)
        h = torch._grouped_mm(x, self.linear_fc1.weight.transpose(1, 2), offs=offs)
        gate, up = torch.chunk(h, 2, dim=-1)
        act = torch.nn.functional.silu(gate) * up
        act = (act * permuted_probs.unsqueeze(-1)).to(act.dtype)
        return torch._grouped_mm(act, self.linear_fc2.weight.transpose(1, 2), offs=offs), None

    def backward_dw(self) -> None:
        """Nothing to defer: wgrad runs in backward."""


def bf16_grouped_spec(spec: Any) -> Any:
    """``spec`` (Megatron's local BF16 layer spec) with ``SequentialMLP`` replaced by
    :class:`BF16GroupedMLP` (the experts' submodules are kept and ignored)."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    from minite_megatron.spec_tree import replace_class

    return replace_class(spec, SequentialMLP, BF16GroupedMLP)


# ---------------------------------------------------------------------------------------------
# The quantize-only variant


class _QuantizeOnlyLinear(torch.autograd.Function):
    """miniTE's quantize kernels on ``minite``'s operands, GEMMs in BF16 on the unquantized ones."""

    @staticmethod
    def forward(ctx, x, weight, w_q, recipe):  # type: ignore[override]
        from minite_common import quantize_nvfp4

        quantize_nvfp4(x.reshape(-1, x.shape[-1]), amax=recipe.activation_amax, recipe=recipe)
        ctx.save_for_backward(x, weight)
        ctx.w_q, ctx.recipe = w_q, recipe
        return torch.nn.functional.linear(x, weight)

    @staticmethod
    def backward(ctx, grad_y):  # type: ignore[override]
        from minite_kernels.dispatch import kernel_arch

        from minite_common import quantize_nvfp4
        from minite_common.autograd import hopper_grad_operands
        from minite_common.hadamard import random_hadamard_transform

        x, weight = ctx.saved_tensors
        recipe = ctx.recipe
        g2 = grad_y.reshape(-1, grad_y.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        if kernel_arch(x.device) == "sm90":
            hopper_grad_operands(g2, x2, ctx.w_q, recipe, True, True)
        else:  # the torch path's quantizations (CPU smoke test)
            sr = recipe.grad_stochastic_rounding
            quantize_nvfp4(
                g2.float() * ctx.w_q.channel_decode_scale(), amax="tensor", stochastic=sr
            )
            pad = -g2.shape[0] % 16
            for t, stochastic in ((g2, sr), (x2, False)):
                t_t = torch.nn.functional.pad(t.t(), (0, pad))
                if recipe.wgrad_rht:
                    t_t = random_hadamard_transform(t_t)
                quantize_nvfp4(t_t.contiguous(), amax="tensor", stochastic=stochastic)
        dx = (g2 @ weight).reshape(x.shape)
        dw = g2.t() @ x2
        return dx, dw, None, None


def quantize_only_linear_train(x, weight, w_q, bias=None, *, recipe=None, row_amax=None):
    """Drop-in for ``w4a4_linear_train`` in the ``minite_qonly`` variant (no bias, TP 1)."""
    if bias is not None or row_amax is not None:
        raise ValueError("minite_qonly: biased or row-parallel TP > 1 linears are not benchmarked")
    return _QuantizeOnlyLinear.apply(x, weight, w_q, recipe)


@contextlib.contextmanager
def variant_mode(variant: str) -> Iterator[None]:
    """Patch what ``variant`` changes in miniTE for the duration of its runs."""
    import minite_common.autograd as ag
    import minite_megatron.linear as ml

    saved = (ml.w4a4_linear_train, ag.HOPPER_CUBLAS_BACKWARD)
    try:
        if variant == "minite_qonly":
            ml.w4a4_linear_train = quantize_only_linear_train
        if variant == "minite_nvfp4bwd":
            ag.HOPPER_CUBLAS_BACKWARD = False
        yield
    finally:
        ml.w4a4_linear_train, ag.HOPPER_CUBLAS_BACKWARD = saved


# ---------------------------------------------------------------------------------------------
# Timing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kernel_category(name: str) -> str:
    """Which part of the split a GPU kernel's time belongs to."""
    n = name.lower()
    quantize = ("_grad_amax", "_grad_qdq", "quantize_nvfp4", "quantize_bf16", "absmax")
    if any(s in n for s in quantize):
        return "quantize"
    if "_decode_operand_kernel" in n:
        return "gemm"  # the NVFP4 GEMM's own decode of its operands (large-M path)
    if any(s in n for s in ("flash", "fmha", "attention", "sdpa")):
        return "attention"
    if any(s in n for s in ("gemm", "nvjet", "xmma", "cutlass", "wgmma", "matmul", "sm90_")):
        return "gemm"
    return "rest"


def is_strict(layer: torch.nn.Module) -> bool:
    """Whether ``layer`` was built from a strict spec (it has miniTE's strict attention core)."""
    from minite_megatron.strict import StrictDotProductAttention

    return any(isinstance(m, StrictDotProductAttention) for m in layer.modules())


class Runner:
    """Forward+backward iterations of one layer on fixed random inputs."""

    def __init__(self, layer, config, shape: LayerShape, seq: int, batch: int, device) -> None:
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        import minite_megatron as mm

        self.layer, self.device = layer, device
        g = torch.Generator(device="cpu").manual_seed(1)
        h = torch.randn(seq, batch, shape.hidden, generator=g).to(torch.bfloat16)
        self.hidden = h.to(device).requires_grad_()
        self.grad = (torch.randn(seq, batch, shape.hidden, generator=g) * 1e-2).to(
            device=device, dtype=torch.bfloat16
        )
        self.mask = mm.causal_attention_mask(seq, device)
        rope = RotaryEmbedding(
            kv_channels=shape.head_dim,
            rotary_percent=1.0,
            rotary_base=1000000,
            use_cpu_initialization=device.type != "cuda",
        )
        # A strict layer's attention core rotates queries and keys itself (the strict GPTModel
        # has position_embedding_type="none"), so Megatron's rotary embedding must not run.
        self.rope = None if is_strict(layer) else rope(seq).to(device)

    def step(self) -> None:
        """One forward+backward; gradients are dropped first, as every variant does."""
        for p in self.layer.parameters():
            p.grad = None
        self.hidden.grad = None
        out = self.layer(
            hidden_states=self.hidden, attention_mask=self.mask, rotary_pos_emb=self.rope
        )
        out = out[0] if isinstance(out, tuple) else out
        out.backward(self.grad)

    def timed(self, iters: int) -> dict[str, Any]:
        """Median and spread of ``iters`` iterations (ms), host time, peak memory (GiB)."""
        cuda = self.device.type == "cuda"
        times, host = [], []
        if cuda:
            _sync(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
        for _ in range(iters):
            t0 = time.perf_counter()
            if cuda:
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
            self.step()
            host.append((time.perf_counter() - t0) * 1e3)
            if cuda:
                end.record()
                _sync(self.device)
                times.append(start.elapsed_time(end))
            else:
                times.append((time.perf_counter() - t0) * 1e3)
        out = dict(
            ms=statistics.median(times),
            ms_min=min(times),
            ms_max=max(times),
            host_ms=statistics.median(host),
        )
        if cuda:
            peak = torch.cuda.max_memory_allocated(self.device)
            out.update(peak_gib=peak / 2**30, base_gib=base / 2**30, act_gib=(peak - base) / 2**30)
        return out

    def profiled(self) -> dict[str, Any]:
        """GPU kernel time of one iteration by category (ms) and the number of kernels."""
        from torch.profiler import ProfilerActivity, profile

        cuda = self.device.type == "cuda"
        activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
        with profile(activities=activities) as prof:
            self.step()
            _sync(self.device)
        split = dict(quantize=0.0, gemm=0.0, attention=0.0, rest=0.0)
        launches = 0
        top: dict[str, float] = {}
        for e in prof.key_averages():
            us = getattr(e, "self_device_time_total", 0.0) or getattr(e, "device_time_total", 0.0)
            if not cuda:
                us = e.self_cpu_time_total
            if us <= 0:
                continue
            cat = kernel_category(e.key)
            split[cat] += us / 1e3
            launches += e.count
            top[e.key[:90]] = top.get(e.key[:90], 0.0) + us / 1e3
        biggest = sorted(top.items(), key=lambda kv: -kv[1])[:12]
        return dict(split_ms=split, kernels=launches, top_kernels=biggest)


# ---------------------------------------------------------------------------------------------
# Ceilings and numerics checks (GPU)


def measure_ceilings(device: torch.device) -> dict[str, float]:
    """Copy bandwidth (read + written) and cuBLAS BF16 8192^3 rate, medians of do_bench."""
    from triton.testing import do_bench

    src = torch.empty(2**29, dtype=torch.float16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = do_bench(functools.partial(dst.copy_, src), warmup=25, rep=200, return_mode="median")
    bw = 2 * src.numel() * 2 / (ms * 1e-3)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    ms_mm = do_bench(lambda: a @ b, warmup=25, rep=200, return_mode="median")
    out = torch.empty(8192, 8192, device=device, dtype=torch.float32)
    try:
        ms_f32 = do_bench(
            lambda: torch.mm(a, b, out_dtype=torch.float32, out=out),
            warmup=25,
            rep=200,
            return_mode="median",
        )
    except Exception:  # noqa: BLE001  (no out_dtype on this torch)
        ms_f32 = float("nan")
    return dict(
        copy_tb_s=bw / 1e12,
        cublas_bf16_tflops=2 * 8192**3 / (ms_mm * 1e-3) / 1e12,
        cublas_bf16_f32out_tflops=2 * 8192**3 / (ms_f32 * 1e-3) / 1e12,
    )


def check_backward_numerics(device: torch.device) -> dict[str, float]:
    """The Hopper backward against the NVFP4-GEMM backward (nearest rounding: the same
    quantized operands, other accumulation order) and both against BF16 autograd."""
    import minite_common.autograd as ag
    from minite_common import NVFP4Recipe, quantize_weight, w4a4_linear_train

    g = torch.Generator(device="cpu").manual_seed(2)
    m, n, k = 4096, 1536, 2048
    w = (torch.randn(n, k, generator=g) / 40).to(device, torch.bfloat16)
    x = torch.randn(m, k, generator=g).to(device, torch.bfloat16)
    dy = torch.randn(m, n, generator=g).to(device, torch.bfloat16)
    out: dict[str, float] = {}

    def grads(recipe: NVFP4Recipe, hopper: bool) -> tuple[torch.Tensor, torch.Tensor]:
        ag.HOPPER_CUBLAS_BACKWARD = hopper
        try:
            xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
            w4a4_linear_train(xx, ww, quantize_weight(w, recipe=recipe), recipe=recipe).backward(dy)
            return xx.grad.float(), ww.grad.float()
        finally:
            ag.HOPPER_CUBLAS_BACKWARD = True

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    xr, wr = x.float().requires_grad_(), w.float().requires_grad_()
    torch.nn.functional.linear(xr, wr).backward(dy.float())
    nearest = NVFP4Recipe(grad_stochastic_rounding=False)
    hx, hw = grads(nearest, True)
    ox, ow = grads(nearest, False)
    out.update(nearest_dx_vs_nvfp4gemm=rel(hx, ox), nearest_dw_vs_nvfp4gemm=rel(hw, ow))
    sx, sw = grads(NVFP4Recipe(), True)
    tx, tw = grads(NVFP4Recipe(), False)
    out.update(
        sr_dx_vs_fp32=rel(sx, xr.grad),
        sr_dw_vs_fp32=rel(sw, wr.grad),
        nvfp4gemm_sr_dx_vs_fp32=rel(tx, xr.grad),
        nvfp4gemm_sr_dw_vs_fp32=rel(tw, wr.grad),
    )
    # Unbiased stochastic rounding: the mean of 16 draws approaches the nearest-rounding result.
    draws = [grads(NVFP4Recipe(), True)[0] for _ in range(16)]
    out["sr_dx_mean16_vs_fp32"] = rel(torch.stack(draws).mean(0), xr.grad)
    out["mm_out_dtype_f32"] = float(ag.mm_out_dtype_supported("cuda"))
    return out


def check_grouped_numerics(
    device: torch.device, shape: LayerShape = LAYERS["moe"], experts: int = 16
) -> dict[str, float]:
    """The grouped experts' GPU paths against their per-expert counterparts, at ``shape``'s fc1
    shape (``experts`` experts of [2 x expert_ffn, hidden], ragged token counts with empty and
    one-token experts): stacked weight quantization (one launch) against ``quantize_weight`` per
    HF tensor and the grouped backward operands against ``quantize_grad_operands`` per expert
    (nearest rounding, RHT), both bitwise (1.0 = equal); the grouped forward against
    ``w4a4_linear_train`` per expert (bitwise) and the grouped backward's dX / dW against the
    one-linear Hopper backward per expert (nearest rounding: relative difference); the time of
    the stacked quantization against the per-tensor loop (ms)."""
    import minite_kernels
    from minite_kernels.nvfp4_grouped import group_layout, quantize_grouped_grad_operands
    from triton.testing import do_bench

    from minite_common import (
        NVFP4Recipe,
        cat_rows,
        grouped_w4a4_linear_train,
        quantize_stacked_weight,
        quantize_weight,
        w4a4_linear_train,
    )
    from minite_common.hadamard import RHT_SIGNS

    g = torch.Generator(device="cpu").manual_seed(3)
    ffn, k = shape.expert_ffn, shape.hidden
    n = 2 * ffn
    sizes = torch.randint(1, 600, (experts,), generator=g).tolist()
    sizes[3], sizes[5] = 0, 1
    magnitude = 10.0 ** (torch.rand(2 * experts, generator=g) * 2 - 3)
    w = torch.randn(experts * n, k, generator=g) * magnitude.repeat_interleave(ffn)[:, None]
    w = w.to(device, torch.bfloat16)
    x = torch.randn(sum(sizes), k, generator=g).to(device, torch.bfloat16)
    dy = torch.randn(sum(sizes), n, generator=g).to(device, torch.bfloat16)

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))

    out: dict[str, float] = {}
    nearest = NVFP4Recipe(grad_stochastic_rounding=False)
    stacked = quantize_stacked_weight(w, ffn, recipe=nearest)
    parts = [w[i * ffn : (i + 1) * ffn] for i in range(2 * experts)]
    ref = cat_rows([quantize_weight(p, recipe=nearest) for p in parts])
    out["stacked_weight_bitwise"] = float(
        same(stacked.codes, ref.codes)
        and same(stacked.scales, ref.scales)
        and same(stacked.decode_scale, ref.decode_scale)
    )
    scale = stacked.channel_decode_scale()
    row, col, dec = quantize_grouped_grad_operands(
        dy, tuple(sizes), row=True, row_scale=scale, col=True, rht_signs=RHT_SIGNS
    )
    _, starts, pstarts = group_layout(tuple(sizes), device)
    equal = True
    for e, size in enumerate(sizes):
        if size:
            r, c, d = minite_kernels.quantize_grad_operands(
                dy[starts[e] : starts[e] + size],
                row=True,
                row_scale=scale[e * n : (e + 1) * n],
                col=True,
                rht_signs=RHT_SIGNS,
            )
            p = -(-size // 16) * 16
            equal &= same(r, row[starts[e] : starts[e] + size])
            equal &= same(c, col[pstarts[e] : pstarts[e] + p]) and same(d, dec[e])
    out["grad_operands_bitwise"] = float(equal)
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = grouped_w4a4_linear_train(xx, ww, stacked, sizes, recipe=nearest)
    y.backward(dy)
    ys, dxs, dws = [], [], []
    for e, size in enumerate(sizes):
        rows = slice(starts[e], starts[e] + size)
        xe = x[rows].clone().requires_grad_()
        we = w[e * n : (e + 1) * n].clone().requires_grad_()
        ye = w4a4_linear_train(xe, we, stacked.narrow_rows(e * n, n), recipe=nearest)
        ye.backward(dy[rows])
        ys.append(ye)
        dxs.append(xe.grad)
        dws.append(we.grad)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.float() - b.float()).norm() / b.float().norm())

    out["forward_bitwise"] = float(torch.equal(y, torch.cat(ys)))
    out["dx_rel_vs_per_expert"] = rel(xx.grad, torch.cat(dxs))
    out["dw_rel_vs_per_expert"] = rel(ww.grad, torch.cat(dws))
    out["stacked_quantize_ms"] = do_bench(
        lambda: quantize_stacked_weight(w, ffn), return_mode="median"
    )
    out["per_tensor_quantize_ms"] = do_bench(
        lambda: [quantize_weight(p) for p in parts],
        return_mode="median",
    )
    return out


def measure_host_overhead(device: torch.device, iters: int = 200) -> dict[str, float]:
    """Host (CPU) microseconds per call, GPU work kept tiny so that the host is the bound: one
    torch op, one Triton kernel launch, and one linear's forward+backward (an expert-sized
    [256 x 2048] x [1536 x 2048]) in BF16 and in miniTE; plus the backward's scale epilogue
    written three ways on a [32768 x 4096] float32 accumulator (GPU ms)."""
    import minite_kernels
    from triton.testing import do_bench

    from minite_common import quantize_weight, w4a4_linear_train

    def host_us(fn: Callable[[], Any]) -> float:
        for _ in range(5):
            fn()
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        host = (time.perf_counter() - t0) / iters * 1e6
        _sync(device)
        return host

    x = torch.randn(256, 2048, device=device, dtype=torch.bfloat16)
    w = (torch.randn(1536, 2048, device=device) / 40).to(torch.bfloat16)
    w_q = quantize_weight(w)
    dy = torch.randn(256, 1536, device=device, dtype=torch.bfloat16)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()

    def bf16_linear() -> None:
        torch.nn.functional.linear(xr, wr).backward(dy)

    def minite_linear() -> None:
        w4a4_linear_train(xr, wr, w_q).backward(dy)

    out = dict(
        torch_mul_us=host_us(lambda: torch.mul(x, 2.0)),
        triton_quantize_launch_us=host_us(
            lambda: minite_kernels.quantize_nvfp4(x, amax="row", block_2d=False)
        ),
        bf16_linear_fwd_bwd_us=host_us(bf16_linear),
        minite_linear_fwd_bwd_us=host_us(minite_linear),
    )
    acc = torch.randn(32768, 4096, device=device)
    scale = torch.tensor(0.37, device=device)
    dst = torch.empty(acc.shape, dtype=torch.bfloat16, device=device)
    acc_bf16 = acc.to(torch.bfloat16)
    out.update(
        epilogue_mul_out_bf16_ms=do_bench(
            lambda: torch.mul(acc, scale, out=dst), return_mode="median"
        ),
        epilogue_mul_inplace_then_cast_ms=do_bench(
            lambda: acc.mul_(scale).to(torch.bfloat16), return_mode="median"
        ),
        epilogue_bf16_inplace_ms=do_bench(lambda: acc_bf16.mul_(scale), return_mode="median"),
    )
    return out


# ---------------------------------------------------------------------------------------------
# Driver


def run_config(
    shape: LayerShape,
    variant: str,
    seq: int,
    batch: int,
    args: argparse.Namespace,
    device: torch.device,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Build, warm up, time, profile and per-step-time one (layer, seq, variant)."""
    from minite_megatron import invalidate_quantized_weights

    t_build = time.perf_counter()
    layer, config = build_layer(shape, variant, args.attention, device)
    runner = Runner(layer, config, shape, seq, batch, device)
    res: dict[str, Any] = dict(layer=shape.name, variant=variant, seq=seq, batch=batch)
    with variant_mode(variant):
        for _ in range(args.warmup):
            runner.step()
        _sync(device)
        res["build_warmup_s"] = time.perf_counter() - t_build
        res.update(runner.timed(args.iters))
        res["tokens_per_s"] = seq * batch / (res["ms"] * 1e-3)
        if args.profile:
            res.update(runner.profiled())
            kernel_ms = sum(res["split_ms"].values())
            res["split_ms"]["idle"] = max(res["ms"] - kernel_ms, 0.0)
        if variant not in BF16_VARIANTS:
            _sync(device)
            t0 = time.perf_counter()
            res["nvfp4_linears"] = invalidate_quantized_weights(layer)
            runner.step()
            _sync(device)
            res["first_after_requantize_ms"] = (time.perf_counter() - t0) * 1e3
            res["per_step_weight_ms"] = res["first_after_requantize_ms"] - res["ms"]
    log(
        f"{shape.name:5s} seq {seq:5d} x mb {batch:2d} {variant:16s} {res['ms']:9.2f} ms "
        f"({res['ms_min']:.2f}-{res['ms_max']:.2f}) host {res['host_ms']:8.2f} ms "
        f"{res['tokens_per_s']:10.0f} tok/s peak {res.get('peak_gib', 0):6.2f} GiB"
    )
    del runner, layer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res


def baselines(results: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    """The BF16 result every ratio of a (layer, seq) is quoted against: ``bf16_grouped`` for the
    MoE layer when it was measured (the fair peer of grouped NVFP4 experts), else ``bf16``."""
    base = {(r["layer"], r["seq"]): r for r in results if r["variant"] == "bf16"}
    for r in results:
        if r["variant"] == "bf16_grouped":
            base[(r["layer"], r["seq"])] = r
    return base


def tables(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The result tables (Markdown), the ratio table last."""
    lines: list[str] = []
    local = {(r["layer"], r["seq"]): r for r in results if r["variant"] == "bf16"}
    base = baselines(results)
    ceil = meta.get("ceilings", {})
    lines += [
        "Ratios are tokens/s over the BF16 baseline of the same run: the grouped BF16 experts "
        "for the MoE layer (where measured), the local spec for the dense layer; "
        "`vs SequentialMLP` is against Megatron's BF16 local expert loop.",
        "",
        "| layer | seq x mb | variant | ms / iter | tokens/s | vs BF16 baseline | "
        "vs SequentialMLP | peak GiB | activations GiB | host ms | per-step weight ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    nan = float("nan")
    for r in results:
        b = base.get((r["layer"], r["seq"]))
        s = local.get((r["layer"], r["seq"]))
        ratio = r["tokens_per_s"] / b["tokens_per_s"] if b else nan
        vs_seq = r["tokens_per_s"] / s["tokens_per_s"] if s and r["layer"] == "moe" else nan
        lines.append(
            f"| {r['layer']} | {r['seq']} x {r['batch']} | {VARIANTS[r['variant']]} | "
            f"{r['ms']:.1f} | {r['tokens_per_s']:,.0f} | {ratio:.2f}x | "
            + (f"{vs_seq:.2f}x" if vs_seq == vs_seq else "-")
            + f" | {r.get('peak_gib', 0):.1f} | {r.get('act_gib', 0):.1f} | {r['host_ms']:.1f} | "
            f"{r.get('per_step_weight_ms', nan):.1f} |"
        )
    if any("split_ms" in r for r in results):
        lines += [
            "",
            "| layer | seq | variant | quantize ms | GEMM ms | attention ms | rest ms | idle ms | "
            "kernels | GEMM TFLOP/s | quantize TB/s |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in results:
            if "split_ms" not in r:
                continue
            s, w = r["split_ms"], r["work"]
            gemm_tf = (w["gemm_flops"] + w["router_flops"]) / (s["gemm"] * 1e-3) / 1e12
            q_tb = w["quant_bytes"] / (s["quantize"] * 1e-3) / 1e12 if s["quantize"] else 0.0
            lines.append(
                f"| {r['layer']} | {r['seq']} | {VARIANTS[r['variant']]} | {s['quantize']:.1f} | "
                f"{s['gemm']:.1f} | {s['attention']:.1f} | {s['rest']:.1f} | {s['idle']:.1f} | "
                f"{r['kernels']} | {gemm_tf:.0f} | {q_tb:.2f} |"
            )
        lines += [
            "",
            "Counted per iteration: GEMM TFLOP (linears + router), attention TFLOP, quantize GB "
            "(minimum bytes of the quantize kernels), at the measured ceilings "
            f"(copy {ceil.get('copy_tb_s', float('nan')):.2f} TB/s, cuBLAS BF16 "
            f"{ceil.get('cublas_bf16_tflops', float('nan')):.0f} TFLOP/s):",
            "",
            "| layer | seq | GEMM TFLOP | GEMM ms at cuBLAS peak | attention TFLOP | "
            "quantize GB | quantize ms at copy bandwidth |",
            "|---|---|---|---|---|---|---|",
        ]
        for (layer, seq), r in base.items():
            w = r["work"]
            gf = (w["gemm_flops"] + w["router_flops"]) / 1e12
            lines.append(
                f"| {layer} | {seq} | {gf:.1f} | "
                f"{gf / ceil.get('cublas_bf16_tflops', float('nan')) * 1e3:.1f} | "
                f"{w['attn_flops'] / 1e12:.1f} | {w['quant_bytes'] / 1e9:.1f} | "
                f"{w['quant_bytes'] / 1e9 / ceil.get('copy_tb_s', float('nan')):.1f} |"
            )
    lines += [
        "",
        "Tokens/s over the BF16 baseline (MoE: grouped BF16 experts where measured):",
        "",
        "| layer | seq x mb | " + " | ".join(VARIANTS[v] for v in VARIANTS) + " |",
    ]
    lines.append("|---|---|" + "---|" * len(VARIANTS))
    for (layer, seq), b in base.items():
        cells = []
        for v in VARIANTS:
            r = next(
                (x for x in results if (x["layer"], x["seq"], x["variant"]) == (layer, seq, v)),
                None,
            )
            cells.append(f"{r['tokens_per_s'] / b['tokens_per_s']:.2f}x" if r else "-")
        lines.append(f"| {layer} | {seq} x {b['batch']} | " + " | ".join(cells) + " |")
    lines += strict_table(results)
    return "\n".join(lines)


def strict_table(results: list[dict[str, Any]]) -> list[str]:
    """Strict mode against default miniTE at the same layer, seq and micro-batch (Markdown lines;
    none without a strict result)."""
    key = ("layer", "seq", "batch")
    minite = {tuple(r[k] for k in key): r for r in results if r["variant"] == "minite"}
    strict = [r for r in results if r["variant"] in STRICT_VARIANTS]
    if not strict:
        return []
    lines = [
        "",
        "Strict ops against default miniTE (same layer, seq and micro-batch): overhead = strict "
        "ms / miniTE ms - 1 (issue 16 goal: <= 10%):",
        "",
        "| layer | seq x mb | miniTE ms / iter | strict ms / iter | overhead | miniTE peak GiB | "
        "strict peak GiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in strict:
        m = minite.get(tuple(r[k] for k in key))
        over = f"{100 * (r['ms'] / m['ms'] - 1):+.1f}%" if m else "- (no miniTE run)"
        lines.append(
            f"| {r['layer']} | {r['seq']} x {r['batch']} | "
            + (f"{m['ms']:.1f}" if m else "-")
            + f" | {r['ms']:.1f} | {over} | "
            + (f"{m.get('peak_gib', 0):.1f}" if m else "-")
            + f" | {r.get('peak_gib', 0):.1f} |"
        )
    return lines


def environment(device: torch.device) -> dict[str, Any]:
    """Versions and the device as seen now."""
    import megatron.core

    info: dict[str, Any] = dict(
        python=platform.python_version(),
        torch=torch.__version__,
        megatron_core=megatron.core.__version__,
        date_utc=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    )
    if device.type == "cuda":
        import triton

        info.update(device=torch.cuda.get_device_name(device), triton=triton.__version__)
        with contextlib.suppress(Exception):
            info["nvidia_smi"] = subprocess.run(
                [
                    "nvidia-smi",
                    "--query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu",
                    "--format=csv,noheader",
                ],
                capture_output=True,
                text=True,
                timeout=20,
            ).stdout.strip()
    return info


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (see the module docstring); returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU, one iteration")
    p.add_argument("--out", default=os.environ.get("OUT", "learner-out"))
    p.add_argument("--layers", default="dense,moe")
    p.add_argument("--seqs", default="4096,8192")
    p.add_argument("--tokens", type=int, default=32768, help="tokens per micro-batch")
    p.add_argument("--variants", default="bf16,bf16_grouped,minite,minite_qonly,minite_grouped")
    p.add_argument("--nvfp4bwd-seqs", default="4096", help="seqs that also run minite_nvfp4bwd")
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--attention", choices=("sdpa", "local"), default="sdpa")
    p.add_argument("--no-profile", dest="profile", action="store_false")
    p.add_argument("--no-checks", dest="checks", action="store_false")
    p.add_argument("--no-host", dest="host", action="store_false", help="skip host-overhead probes")
    args = p.parse_args(argv)

    if args.cpu_smoke:
        args.seqs, args.tokens, args.iters, args.warmup = "32", 64, 1, 1
        args.nvfp4bwd_seqs = "32"
        shapes = TINY
        device = torch.device("cpu")
    else:
        shapes = LAYERS
        device = torch.device("cuda", torch.cuda.current_device())
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    log_file = (out_dir / "learner.log").open("a")

    def log(msg: str) -> None:
        print(msg, flush=True)
        log_file.write(msg + "\n")
        log_file.flush()

    import minite_megatron as mm

    mm.init_megatron(1)
    meta: dict[str, Any] = dict(
        args=vars(args), env=environment(device), command=" ".join([sys.argv[0], *sys.argv[1:]])
    )
    log(json.dumps(meta["env"]))
    if device.type == "cuda":
        meta["ceilings"] = measure_ceilings(device)
        log(f"ceilings: {json.dumps(meta['ceilings'])}")
        if args.checks:
            meta["numerics"] = check_backward_numerics(device)
            log(f"backward numerics: {json.dumps(meta['numerics'])}")
        if "minite_grouped" in args.variants.split(","):
            meta["grouped_numerics"] = check_grouped_numerics(device)
            log(f"grouped experts numerics: {json.dumps(meta['grouped_numerics'])}")
        if args.host:
            meta["host_overhead"] = measure_host_overhead(device)
            log(f"host overhead: {json.dumps(meta['host_overhead'])}")
    results: list[dict[str, Any]] = []
    nvfp4bwd_seqs = {int(s) for s in args.nvfp4bwd_seqs.split(",") if s}
    seqs = [int(s) for s in args.seqs.split(",")]
    names = args.layers.split(",")
    # The main variants of every configuration first, the slow before/after variant last.
    plan = [
        (seq, name, v)
        for seq in seqs
        for name in names
        for v in args.variants.split(",")
        if shapes[name].experts or v not in MOE_ONLY_VARIANTS
    ]
    plan += [
        (seq, name, "minite_nvfp4bwd") for seq in seqs if seq in nvfp4bwd_seqs for name in names
    ]
    for seq, name, variant in plan:
        shape = shapes[name]
        batch = max(1, args.tokens // seq)
        try:
            res = run_config(shape, variant, seq, batch, args, device, log)
        except Exception as exc:  # noqa: BLE001  (record and go on: one GPU call)
            log(f"FAILED {name} seq {seq} {variant}: {type(exc).__name__}: {exc}")
            import traceback

            log(traceback.format_exc())
            if args.cpu_smoke:
                raise
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        res["work"] = count_work(shape, seq, batch)
        results.append(res)
        (out_dir / "learner.json").write_text(
            json.dumps(dict(meta=meta, results=results), indent=1, default=str)
        )
    if args.cpu_smoke:
        got = {(r["layer"], r["variant"]) for r in results}
        want = {
            (n, v)
            for n in args.layers.split(",")
            for v in [*args.variants.split(","), "minite_nvfp4bwd"]
            if shapes[n].experts or v not in MOE_ONLY_VARIANTS
        }
        missing = want - got
        log(f"cpu smoke: {len(results)} configurations ran; missing: {sorted(missing) or 'none'}")
        if missing:
            return 1
    text = tables(results, meta)
    (out_dir / "learner_tables.md").write_text(text + "\n")
    log(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
