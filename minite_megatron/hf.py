"""Hugging Face Qwen3 / Qwen3-MoE <-> Megatron-Core ``GPTModel``: config, loader and exporter.

Names are the checkpoint's (``model.layers.N.self_attn.q_proj.weight``, per-expert
``model.layers.N.mlp.experts.E.gate_proj.weight``), i.e. what ``save_pretrained`` writes and
what vLLM and ``from_pretrained`` read. Fused Megatron weights are split and joined through
:mod:`minite_megatron.layout`. Both directions stream one tensor at a time and handle tensor
parallelism (each rank reads its shard; export all-gathers each tensor on every TP rank).
Pipeline stages load and export their own layers. Expert parallelism, biases and shared experts
are not mapped.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_pg_rank, get_pg_size
from safetensors import safe_open

from minite_common.checkpoint import quantization_config

from .experts import MiniTEGroupedMLP
from .layout import (
    GATED_FC1_PARTS,
    QKV_PARTS,
    RowSegment,
    gated_fc1_segments,
    qkv_segments,
    single_segment,
)
from .linear import NVFP4LinearMixin

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe")
#: The dtype of the sampler's copy of the weights (and of what the NVFP4 linears quantize).
EXPORT_DTYPE = torch.bfloat16


def _rope_theta(hf_config: Any) -> float:
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    rope = rope or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"HF config: rope_type {rope_type!r} is not supported (only 'default')")
    theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ValueError("HF config: no rope_theta found")
    return float(theta)


def _num_experts(hf_config: Any) -> int | None:
    if hf_config.model_type != "qwen3_moe":
        return None
    return getattr(hf_config, "num_experts", None) or hf_config.num_local_experts


def transformer_config_from_hf(hf_config: Any, **overrides: Any) -> TransformerConfig:
    """The Megatron ``TransformerConfig`` of a HF Qwen3 / Qwen3-MoE config.

    RMSNorm, q/k RMSNorm, SwiGLU, GQA, no biases, dropout 0, BF16 parameters, the TP size of the
    initialized model-parallel state. MoE: softmax top-k routing matching ``norm_topk_prob``,
    the HF dense/sparse layer pattern, no auxiliary loss. ``overrides`` set any other field.
    """
    if hf_config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"HF model_type {hf_config.model_type!r} is not supported; supported: "
            f"{SUPPORTED_MODEL_TYPES}"
        )
    if getattr(hf_config, "attention_bias", False):
        raise ValueError("HF config: attention_bias=True is not supported (no biases are mapped)")
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError("HF config: sliding-window attention is not supported")
    _rope_theta(hf_config)
    tp = (
        parallel_state.get_tensor_model_parallel_world_size()
        if parallel_state.model_parallel_is_initialized()
        else 1
    )
    cpu = not torch.cuda.is_available()
    fields: dict[str, Any] = dict(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads,
        kv_channels=getattr(hf_config, "head_dim", None)
        or hf_config.hidden_size // hf_config.num_attention_heads,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
        tensor_model_parallel_size=tp,
        use_cpu_initialization=cpu,
    )
    num_experts = _num_experts(hf_config)
    if num_experts:
        step = getattr(hf_config, "decoder_sparse_step", 1)
        dense_only = set(getattr(hf_config, "mlp_only_layers", []) or [])
        fields.update(
            num_moe_experts=num_experts,
            moe_router_topk=hf_config.num_experts_per_tok,
            moe_ffn_hidden_size=hf_config.moe_intermediate_size,
            moe_router_pre_softmax=not hf_config.norm_topk_prob,
            moe_layer_freq=[
                int(i not in dense_only and (i + 1) % step == 0)
                for i in range(hf_config.num_hidden_layers)
            ],
            moe_aux_loss_coeff=0.0,
            moe_router_load_balancing_type="none",
            # The all-to-all dispatcher creates CUDA streams; all-gather runs anywhere.
            moe_token_dispatcher_type="allgather" if cpu else "alltoall",
        )
    known = {f.name for f in dataclasses.fields(TransformerConfig)}
    fields = {k: v for k, v in fields.items() if k in known}
    fields.update(overrides)
    return TransformerConfig(**fields)


def gpt_model_kwargs_from_hf(hf_config: Any, *, strict: bool = False) -> dict[str, Any]:
    """``GPTModel`` keyword arguments (vocabulary, positions, RoPE, tying) of a HF config;
    ``strict``: no position embedding of Megatron's own (a strict spec's attention core applies
    the rotary embedding, with ``rotary_base``)."""
    return dict(
        vocab_size=hf_config.vocab_size,
        max_sequence_length=hf_config.max_position_embeddings,
        position_embedding_type="none" if strict else "rope",
        rotary_percent=1.0,
        rotary_base=_rope_theta(hf_config),
        share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
    )


@dataclass(frozen=True)
class WeightBinding:
    """One Megatron parameter and the HF tensor(s) it holds.

    ``kind``: "replicated" (same on every rank), "column" (rows sharded over ``group``, laid
    out by ``segments(tp_rank, tp_size)``; ``hf_names`` maps each part to its HF name) or "row"
    (columns sharded over ``group``). ``module`` is the owning linear, for NVFP4 export.
    ``expert``: the binding holds ``param[expert]`` of a stacked experts parameter.
    """

    param: torch.nn.Parameter
    kind: str
    hf_names: dict[str, str]
    group: dist.ProcessGroup | None = None
    segments: Callable[[int, int], list[RowSegment]] | None = None
    module: torch.nn.Module | None = None
    expert: int | None = None

    @property
    def tensor(self) -> torch.Tensor:
        """The bound tensor: ``param``, or its slice ``param[expert]``."""
        return self.param if self.expert is None else self.param[self.expert]


def _replicated(param: torch.nn.Parameter, name: str) -> WeightBinding:
    return WeightBinding(param, "replicated", {"weight": name})


def _vocab(module: torch.nn.Module, name: str) -> WeightBinding:
    rows = module.weight.shape[0]
    return WeightBinding(
        module.weight,
        "column",
        {"weight": name},
        module.tp_group,
        lambda rank, size: single_segment("weight", rows, rank),
    )


def _row(linear: torch.nn.Module, name: str) -> WeightBinding:
    return WeightBinding(linear.weight, "row", {"weight": name}, linear.tp_group, module=linear)


def _mlp(mlp: torch.nn.Module, prefix: str) -> Iterator[WeightBinding]:
    fc1 = mlp.linear_fc1
    ffn = fc1.output_size // 2
    yield WeightBinding(
        fc1.weight,
        "column",
        {p: f"{prefix}.{p}.weight" for p in GATED_FC1_PARTS},
        fc1.tp_group,
        lambda rank, size: gated_fc1_segments(ffn, rank, size),
        fc1,
    )
    yield _row(mlp.linear_fc2, f"{prefix}.down_proj.weight")


def _grouped_experts(experts: MiniTEGroupedMLP, prefix: str) -> Iterator[WeightBinding]:
    """Per expert, its slices of the stacked fc1 / fc2 weights (in ``_mlp``'s order)."""
    fc1, fc2 = experts.linear_fc1, experts.linear_fc2
    ffn = fc1.weight.shape[1] // 2
    segments = lambda rank, size: gated_fc1_segments(ffn, rank, size)
    for e in range(experts.num_local_experts):
        names = {part: f"{prefix}.{e}.{part}.weight" for part in GATED_FC1_PARTS}
        yield WeightBinding(fc1.weight, "column", names, None, segments, fc1, expert=e)
        names = {"weight": f"{prefix}.{e}.down_proj.weight"}
        yield WeightBinding(fc2.weight, "row", names, None, module=fc2, expert=e)


def weight_bindings(model: torch.nn.Module) -> Iterator[WeightBinding]:
    """Every parameter of a Qwen3-style ``GPTModel`` (this pipeline stage) with its HF name(s)."""
    config = model.config
    if not config.gated_linear_unit:
        raise NotImplementedError("HF mapping: only SwiGLU (gated) MLPs are mapped")
    if config.num_moe_experts and config.expert_model_parallel_size > 1:
        raise NotImplementedError("HF mapping: expert parallelism (EP > 1) is not supported")
    if getattr(model, "pre_process", True):
        yield _vocab(model.embedding.word_embeddings, "model.embed_tokens.weight")
    heads, head_dim = config.num_attention_heads, config.kv_channels
    groups = config.num_query_groups or heads
    for layer in model.decoder.layers:
        p = f"model.layers.{layer.layer_number - 1}"
        yield _replicated(layer.input_layernorm.weight, f"{p}.input_layernorm.weight")
        attn = layer.self_attention
        yield WeightBinding(
            attn.linear_qkv.weight,
            "column",
            {part: f"{p}.self_attn.{part}.weight" for part in QKV_PARTS},
            attn.linear_qkv.tp_group,
            lambda rank, size: qkv_segments(heads, groups, head_dim, rank, size),
            attn.linear_qkv,
        )
        if config.qk_layernorm:
            yield _replicated(attn.q_layernorm.weight, f"{p}.self_attn.q_norm.weight")
            yield _replicated(attn.k_layernorm.weight, f"{p}.self_attn.k_norm.weight")
        yield _row(attn.linear_proj, f"{p}.self_attn.o_proj.weight")
        yield _replicated(layer.pre_mlp_layernorm.weight, f"{p}.post_attention_layernorm.weight")
        mlp = layer.mlp
        if hasattr(mlp, "router"):
            if mlp.shared_experts is not None:
                raise NotImplementedError("HF mapping: shared experts are not supported")
            yield _replicated(mlp.router.weight, f"{p}.mlp.gate.weight")
            if isinstance(mlp.experts, MiniTEGroupedMLP):
                yield from _grouped_experts(mlp.experts, f"{p}.mlp.experts")
            else:
                for e, expert in enumerate(mlp.experts.local_experts):
                    yield from _mlp(expert, f"{p}.mlp.experts.{e}")
        else:
            yield from _mlp(mlp, f"{p}.mlp")
    if getattr(model, "post_process", True):
        yield _replicated(model.decoder.final_layernorm.weight, "model.norm.weight")
        if not model.share_embeddings_and_output_weights:
            yield _vocab(model.output_layer, "lm_head.weight")


class HFCheckpoint:
    """Lazy reader of a HF safetensors checkpoint directory (single file or sharded index)."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        index = path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._file_of = {name: path / file for name, file in weight_map.items()}
        elif (path / "model.safetensors").exists():
            file = path / "model.safetensors"
            with safe_open(str(file), "pt") as f:
                self._file_of = dict.fromkeys(f.keys(), file)
        else:
            raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")
        self._open: dict[Path, Any] = {}

    def names(self) -> set[str]:
        """All tensor names in the checkpoint."""
        return set(self._file_of)

    def read(
        self, name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """Tensor ``name``, or only its rows ``[a, b)`` / columns ``[a, b)``."""
        if name not in self._file_of:
            raise KeyError(f"HF checkpoint has no tensor {name!r}")
        file = self._file_of[name]
        if file not in self._open:
            self._open[file] = safe_open(str(file), "pt")
        view = self._open[file].get_slice(name)
        r = slice(*rows) if rows else slice(None)
        c = slice(*cols) if cols else slice(None)
        return view[r, c] if len(view.get_shape()) == 2 else view[r]


def _hf_shard(ckpt: HFCheckpoint, b: WeightBinding) -> torch.Tensor:
    if b.kind == "replicated":
        return ckpt.read(b.hf_names["weight"])
    rank, size = get_pg_rank(b.group), get_pg_size(b.group)
    if b.kind == "row":
        k = b.tensor.shape[1]
        return ckpt.read(b.hf_names["weight"], cols=(rank * k, (rank + 1) * k))
    return torch.cat(
        [
            ckpt.read(b.hf_names[s.part], rows=(s.hf_start, s.hf_start + s.rows))
            for s in b.segments(rank, size)
        ]
    )


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, hf_dir: str | Path) -> None:
    """Copy a HF checkpoint's weights into ``model`` (this rank's shards), strictly.

    Raises if a parameter is not mapped, a HF tensor is missing or unused, or a shape differs.
    """
    ckpt = HFCheckpoint(hf_dir)
    bound, used = set(), set()
    for b in weight_bindings(model):
        value = _hf_shard(ckpt, b)
        if tuple(value.shape) != tuple(b.tensor.shape):
            raise ValueError(
                f"{sorted(b.hf_names.values())}: HF gives {list(value.shape)} for a Megatron "
                f"parameter of shape {list(b.tensor.shape)}"
            )
        b.tensor.copy_(value)
        bound.add(id(b.param))
        used.update(b.hf_names.values())
    unmapped = [n for n, p in model.named_parameters() if id(p) not in bound]
    if unmapped:
        raise ValueError(f"load_hf_weights: Megatron parameters without a HF source: {unmapped}")
    unused = sorted(ckpt.names() - used)
    if unused and getattr(model, "pre_process", True) and getattr(model, "post_process", True):
        raise ValueError(f"load_hf_weights: HF tensors the model does not use: {unused}")


def _gather(b: WeightBinding, shard: torch.Tensor) -> list[torch.Tensor]:
    size = get_pg_size(b.group)
    if b.kind == "replicated" or size == 1:
        return [shard]
    shards = [torch.empty_like(shard) for _ in range(size)]
    dist.all_gather(shards, shard.contiguous(), group=b.group)
    return shards


def _full_hf_tensors(
    b: WeightBinding, shard: torch.Tensor | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each HF tensor of binding ``b``, whole; ``shard`` (default: this rank's weight) may be
    any tensor with the weight's row layout, e.g. its NVFP4 codes or scales."""
    shards = _gather(b, b.tensor.detach() if shard is None else shard)
    if b.kind == "replicated":
        yield b.hf_names["weight"], shards[0]
    elif b.kind == "row":
        yield b.hf_names["weight"], torch.cat(shards, dim=1)
    else:
        size = len(shards)
        for part, name in b.hf_names.items():
            pieces = sorted(
                (
                    (s.hf_start, shards[rank][s.local_start : s.local_start + s.rows])
                    for rank in range(size)
                    for s in b.segments(rank, size)
                    if s.part == part
                ),
                key=lambda piece: piece[0],
            )
            yield name, torch.cat([tensor for _, tensor in pieces])


def export_hf_weights(
    model: torch.nn.Module, *, quantized: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream ``(hf_name, tensor)`` for the sampler, one HF tensor at a time, in BF16.

    With ``quantized``, each weight of an NVFP4 linear comes as the miniTE checkpoint tensors
    (``.weight`` codes, ``.weight_scale``, ``.weight_scale_2``; see
    :mod:`minite_common.checkpoint`) taken from the NVFP4 copy the linear computes with
    (quantized from the BF16 weight when stale): bitwise ``quantize_weight`` of the HF tensor
    under that linear's recipe, the bytes both engines compute with. Call on every TP rank (each
    all-gathers).
    """
    for b in weight_bindings(model):
        if quantized and isinstance(b.module, NVFP4LinearMixin):
            yield from _quantized_hf_tensors(b)
            continue
        for name, tensor in _full_hf_tensors(b):
            yield name, tensor.to(EXPORT_DTYPE)


def _quantized_hf_tensors(b: WeightBinding) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint tensors of each HF weight of NVFP4 binding ``b``, cut from its linear's
    cached NVFP4 copy (rows in the binding's layout; experts stacked) and gathered over TP."""
    w_q = b.module.quantized_weight()
    rows = b.tensor.shape[0]
    start = 0 if b.expert is None else b.expert * rows
    layout = {
        "weight": w_q.codes[start : start + rows],
        "weight_scale": w_q.scales[start : start + rows].view(torch.uint8),
        "weight_scale_2": w_q.channel_decode_scale()[start : start + rows].unsqueeze(1),
    }
    whole = {suffix: dict(_full_hf_tensors(b, t.contiguous())) for suffix, t in layout.items()}
    for name in whole["weight"]:
        prefix = name.removesuffix(".weight")
        yield f"{prefix}.weight", whole["weight"][name]
        yield f"{prefix}.weight_scale", whole["weight_scale"][name].view(torch.float8_e4m3fn)
        yield f"{prefix}.weight_scale_2", whole["weight_scale_2"][name][0, 0].clone()


def hf_quantization_config(model: torch.nn.Module) -> dict[str, Any]:
    """The ``quantization_config`` for ``config.json`` of a quantized export of ``model``."""
    recipes = {m.recipe for m in model.modules() if isinstance(m, NVFP4LinearMixin)}
    if len(recipes) != 1:
        raise ValueError(f"model has NVFP4 linears under {len(recipes)} recipes; expected one")
    return quantization_config(recipes.pop())
