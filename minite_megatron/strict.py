"""Strict mode in Megatron-Core: spec modules that run the ops around the NVFP4 linears through
:mod:`minite_common.ops`, the functions vLLM's strict path calls too.

:func:`make_strict_spec` rewrites a layer or block spec (what
:func:`~minite_megatron.spec.get_gpt_decoder_block_minite_spec` does for a recipe with
``strict_ops``): RMSNorms (input, pre-MLP, q/k, final) become :class:`StrictRMSNorm`, residual adds
:func:`strict_bias_dropout_add`, self-attention :class:`StrictSelfAttention` (rotary embedding)
with :class:`StrictDotProductAttention`, the MLP activation :class:`StrictSwiGLU`, MoE layers
:class:`StrictMoELayer` (routing and combine; experts keep their NVFP4 linears), linears the recipe
keeps in BF16 :class:`StrictColumnParallelLinear` / :class:`StrictRowParallelLinear`. After building
the ``GPTModel``, :func:`finalize_strict_model` gives the attention layers the model's rotary
base and routes the output layer (LM head) through :func:`minite_common.ops.linear`.

Everything here is layout (Megatron's ``[s, b, ...]`` to the ops' shapes); no formula. Strict
mode covers tensor (and expert-tensor) parallelism, whose row-parallel NVFP4 linears then combine
their partial accumulators deterministically (:mod:`minite_common.parallel`) so that every TP
degree gives TP=1's bits (the LM head's logits are gathered whole before the fixed-order
log-softmax), and causal self-attention without packed sequences or an inference
context (the learner's scoring and training passes), and needs
``TransformerConfig(use_te_activation_func=True)`` so that MLPs call the spec's activation module
(only Megatron's switch; nothing of Transformer Engine runs).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_pg_size

from minite_common import ops

from .spec_tree import DESCEND, map_spec


def check_strict_config(config: TransformerConfig) -> None:
    """Raise ``ValueError`` naming every ``config`` option that strict mode does not cover."""
    get = functools.partial(getattr, config)
    problems = {
        "normalization must be 'RMSNorm'": config.normalization != "RMSNorm",
        "use_te_activation_func must be True (MLPs then call the spec's activation module, "
        "miniTE's strict SwiGLU; no Transformer Engine code runs)": not get(
            "use_te_activation_func", False
        ),
        "the MLP must be SwiGLU (gated_linear_unit=True, activation_func=F.silu)": not (
            config.gated_linear_unit and config.activation_func is F.silu
        ),
        "add_bias_linear must be False": config.add_bias_linear or config.add_qkv_bias,
        "hidden_dropout and attention_dropout must be 0": bool(
            config.hidden_dropout or config.attention_dropout
        ),
        "context and expert-model parallel sizes must be 1 (tensor and expert-tensor "
        "parallelism are TP-invariant)": any(
            (get(name, 1) or 1) != 1
            for name in ("context_parallel_size", "expert_model_parallel_size")
        ),
        "rotary_interleaved, apply_rope_fusion and no_rope_freq must be off": bool(
            get("rotary_interleaved", False) or get("apply_rope_fusion", False)
        )
        or bool(get("no_rope_freq", None)),
        "apply_query_key_layer_scaling, window_size, attention_output_gate must be off and "
        "softmax_type 'vanilla'": bool(
            get("apply_query_key_layer_scaling", False)
            or get("window_size", None)
            or get("attention_output_gate", False)
        )
        or get("softmax_type", "vanilla") != "vanilla",
        "layernorm_zero_centered_gamma must be False": get("layernorm_zero_centered_gamma", False),
        "MoE routing must be plain softmax top-k (no expert bias, group limit, scaling factor, "
        "shared experts or latent size)": config.num_moe_experts is not None
        and (
            get("moe_router_score_function", "softmax") != "softmax"
            or get("moe_router_enable_expert_bias", False)
            or get("moe_router_num_groups", None) is not None
            or get("moe_router_topk_scaling_factor", None) is not None
            or get("moe_shared_expert_intermediate_size", None) is not None
            or get("moe_latent_size", None) is not None
        ),
    }
    bad = [message for message, failed in problems.items() if failed]
    if bad:
        raise ValueError("miniTE strict mode: " + "; ".join(bad))


# -- modules -------------------------------------------------------------------------------------


class StrictRMSNorm(torch.nn.Module):
    """RMSNorm over the last dimension through :func:`ops.rms_norm` (weight named ``weight``)."""

    def __init__(
        self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: Any
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class StrictSwiGLU(torch.nn.Module):
    """The MLP activation of ``[gate | up]`` through :func:`ops.swiglu`."""

    def __init__(self, config: TransformerConfig | None = None, **_: Any) -> None:
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.swiglu(x)


def strict_bias_dropout_add(training: bool, fused: bool) -> Callable:
    """Megatron's bias-dropout-add slot: ``residual + x`` through :func:`ops.residual_add`
    (no bias, no dropout)."""

    def residual_add(
        x_with_bias: tuple[torch.Tensor, torch.Tensor | None], residual: torch.Tensor, prob: float
    ) -> torch.Tensor:
        x, bias = x_with_bias
        if bias is not None or (training and prob):
            raise ValueError("miniTE strict mode: residual adds take no bias and no dropout")
        return ops.residual_add(x, residual)

    return residual_add


class StrictDotProductAttention(MegatronModule):
    """Causal attention core through :func:`ops.causal_attention`, one sequence of the batch at a
    time: ``[s, b, heads, d]`` in, ``[s, b, heads * d]`` out (the mask must be causal)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal or attention_type != "self":
            raise ValueError(
                f"miniTE strict mode: causal self-attention only (got {attn_mask_type}, "
                f"{attention_type})"
            )
        check_strict_config(config)
        head_dim = config.kv_channels
        self.softmax_scale = head_dim**-0.5 if softmax_scale is None else softmax_scale

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if attention_bias is not None or packed_seq_params is not None:
            raise NotImplementedError("miniTE strict mode: attention bias or packed sequences")
        if attn_mask_type not in (None, AttnMaskType.causal):
            raise NotImplementedError(f"miniTE strict mode: mask type {attn_mask_type}")
        seq, batch = query.shape[:2]
        pos = torch.arange(seq, device=query.device)
        scale = self.softmax_scale
        out = [
            ops.causal_attention(query[:, b], key[:, b], value[:, b], pos, scale)
            for b in range(batch)
        ]
        return torch.stack(out, dim=1).reshape(seq, batch, -1)


class StrictSelfAttention(SelfAttention):
    """Megatron's ``SelfAttention`` whose forward applies the rotary embedding with
    :func:`ops.rope_cos_sin` / :func:`ops.apply_rope` at positions ``0..s-1`` (the q/k norms and
    the attention core are the spec's modules). ``rope`` = ``(base, rotary_dim)`` is set by
    :func:`finalize_strict_model`."""

    rope: tuple[float, int] | None = None

    def forward(  # type: ignore[override]
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        key_value_states: torch.Tensor | None = None,
        inference_context: Any = None,
        rotary_pos_emb: Any = None,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        extra = [a for a in args if a is not None] + [k for k, v in kwargs.items() if v is not None]
        if key_value_states is not None or inference_context is not None or extra:
            raise NotImplementedError(
                "miniTE strict mode: self-attention without key/value states, inference context, "
                f"packed sequences or precomputed rotary tables (got {extra or 'kv/inference'})"
            )
        query, key, value = self.get_query_key_value_tensors(hidden_states)
        if rotary_pos_emb is not None:
            if self.rope is None:
                raise RuntimeError(
                    "miniTE strict mode: call minite_megatron.strict.finalize_strict_model(model) "
                    "after building the GPTModel (it sets the rotary base)"
                )
            base, dim = self.rope
            positions = torch.arange(query.shape[0], device=query.device)
            cos, sin = ops.rope_cos_sin(positions, dim, base)
            cos, sin = cos[:, None, None, :], sin[:, None, None, :]  # [s, 1, 1, dim/2]
            query, key = ops.apply_rope(query, cos, sin), ops.apply_rope(key, cos, sin)
        core = self.core_attention(
            query, key, value, attention_mask, attn_mask_type=self.attn_mask_type
        )
        return self.linear_proj(core)


class StrictMoELayer(MoELayer):
    """Megatron's ``MoELayer`` (router weight, ``SequentialMLP`` experts) whose forward routes
    with :func:`ops.linear` + :func:`ops.topk_routing` (softmax over the top-k logits unless
    ``moe_router_pre_softmax``), runs each expert's MLP on its tokens and combines with
    :func:`ops.moe_combine`: routing weights apply to expert outputs, as in the sampler."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.experts, SequentialMLP):
            raise NotImplementedError(
                f"miniTE strict mode runs MoE experts as SequentialMLP, not "
                f"{type(self.experts).__name__} (turn grouped experts off)"
            )
        for expert in self.experts.local_experts:  # no token dispatcher sums their outputs
            expert.linear_fc2.output_is_final = True

    def forward(  # type: ignore[override]
        self,
        hidden_states: torch.Tensor,
        intermediate_tensors: Any = None,
        padding_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, None]:
        if intermediate_tensors is not None:
            raise NotImplementedError("miniTE strict mode: partial MoE forward passes")
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        logits = ops.linear(x, self.router.weight)
        weights, ids = ops.topk_routing(
            logits, self.config.moe_router_topk, renormalize=not self.config.moe_router_pre_softmax
        )
        per_slot = x.new_zeros(x.shape[0], ids.shape[1], shape[-1])
        for e, expert in enumerate(self.experts.local_experts):
            token, slot = (ids == e).nonzero(as_tuple=True)
            if token.numel():
                out, _ = expert(x[token])
                per_slot = per_slot.index_put((token, slot), out)
        return ops.moe_combine(per_slot, weights).reshape(shape), None


def strict_linear_impl(
    input: torch.Tensor,
    weight: torch.Tensor,
    *args: Any,
    bias: Any = None,
    allreduce_dgrad: bool = False,
    sequence_parallel: bool = False,
    tp_group: Any = None,
    **kwargs: Any,
) -> torch.Tensor:
    """A ``_forward_impl`` for Megatron's column-parallel BF16 linears (and the output layer):
    :func:`ops.linear` on this rank's output columns (each column's bits do not depend on the
    others), with Megatron's input communication for tensor parallelism."""
    if sequence_parallel:
        input = gather_from_sequence_parallel_region(
            input, tensor_parallel_output_grad=True, group=tp_group
        )
    elif allreduce_dgrad:
        input = copy_to_tensor_model_parallel_region(input, group=tp_group)
    return ops.linear(input, weight, bias)


class StrictColumnParallelLinear(ColumnParallelLinear):
    """A column-parallel linear the recipe keeps in BF16, through :func:`ops.linear`."""

    def _forward_impl(self, input: torch.Tensor, weight: torch.Tensor, *args: Any, **kwargs: Any):
        return strict_linear_impl(input, weight, *args, **kwargs)


class StrictRowParallelLinear(RowParallelLinear):
    """A row-parallel linear the recipe keeps in BF16, through :func:`ops.linear` (TP 1 only:
    the all-reduce of BF16 partial outputs would depend on the TP degree)."""

    def _forward_impl(self, input: torch.Tensor, weight: torch.Tensor, *args: Any, **kwargs: Any):
        if get_pg_size(self.tp_group) > 1:
            raise NotImplementedError(
                f"miniTE strict mode: a BF16 row-parallel linear ({type(self).__name__}, input "
                f"size {self.input_size}) at TP={get_pg_size(self.tp_group)} would all-reduce "
                "rounded partial outputs; keep it in NVFP4 (drop it from bf16_modules) or run TP=1"
            )
        return strict_linear_impl(input, weight, *args, **kwargs)


# -- spec rewriting and model finalization -------------------------------------------------------

_NORM_FIELDS = ("input_layernorm", "pre_mlp_layernorm", "q_layernorm", "k_layernorm", "layer_norm")
_BDA_FIELDS = ("self_attn_bda", "mlp_bda")
_STRICT_MODULES = {
    SelfAttention: StrictSelfAttention,
    MoELayer: StrictMoELayer,
    ColumnParallelLinear: StrictColumnParallelLinear,
    RowParallelLinear: StrictRowParallelLinear,
}


def _is_identity(obj: Any) -> bool:
    module = obj.module if isinstance(obj, ModuleSpec) else obj
    return isinstance(module, type) and issubclass(module, IdentityOp)


def _strict_field(owner: Any, name: str, value: Any) -> Any:
    if name in _NORM_FIELDS and value is not None and not _is_identity(value):
        return StrictRMSNorm
    if name in _BDA_FIELDS:
        return strict_bias_dropout_add
    if name == "core_attention":
        return StrictDotProductAttention
    if name == "activation_func" and isinstance(owner, MLPSubmodules):
        return StrictSwiGLU
    return make_strict_spec(value)


def _strict_node(node: Any, path: tuple[str, ...]) -> Any:
    if isinstance(node, type):
        return _STRICT_MODULES.get(node, node)
    if dataclasses.is_dataclass(node) and not isinstance(node, ModuleSpec):
        fields = [f for f in dataclasses.fields(node) if f.init]
        return dataclasses.replace(
            node, **{f.name: _strict_field(node, f.name, getattr(node, f.name)) for f in fields}
        )
    return DESCEND


def make_strict_spec(obj: Any) -> Any:
    """A copy of the spec tree ``obj`` (layer spec, block submodules) with the strict modules of
    this module in place of Megatron's norms, residual adds, attention, activation, MoE layer and
    plain BF16 linears (miniTE's NVFP4 linears stay)."""
    return map_spec(obj, _strict_node)


def finalize_strict_model(model: torch.nn.Module) -> None:
    """Finish a ``GPTModel`` built from a strict spec: give its attention layers the rotary base
    and dimension (``model.rotary_base``, ``rotary_percent``), route its output layer through
    :func:`ops.linear` and mark it ``minite_strict`` (``token_logprobs`` then normalizes with
    :func:`ops.log_softmax`). Idempotent; raises if the model has no strict attention."""
    layers = [m for m in model.modules() if isinstance(m, StrictSelfAttention)]
    if not layers:
        raise ValueError(
            "finalize_strict_model: the model has no strict attention layers; build it from "
            "get_gpt_decoder_block_minite_spec(config, recipe) with recipe.strict_ops=True"
        )
    check_strict_config(model.config)
    rope = None
    if getattr(model, "position_embedding_type", None) == "rope":
        rope = (float(model.rotary_base), int(model.config.kv_channels * model.rotary_percent))
    for layer in layers:
        layer.rope = rope
    output = getattr(model, "output_layer", None)
    if output is not None:
        output._forward_impl = strict_linear_impl
    model.minite_strict = True  # token_logprobs: the fixed-order ops.log_softmax
