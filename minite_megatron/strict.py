"""Strict mode in Megatron-Core: spec modules that run the ops around the NVFP4 linears through
:mod:`minite_common.ops`, the functions vLLM's strict path calls too.

:func:`make_strict_spec` rewrites a layer or block spec (what
:func:`~minite_megatron.spec.get_gpt_decoder_block_minite_spec` does for a recipe with
``strict_ops``), through the spec's submodule slots: RMSNorms (input, pre-MLP, q/k, final) become
:class:`StrictRMSNorm`, residual adds :func:`strict_bias_dropout_add`, the attention core
(``core_attention``) :class:`StrictDotProductAttention`, which applies the rotary embedding too
(the ``GPTModel`` is built with ``position_embedding_type="none"``), the MLP activation
:class:`StrictSwiGLU`. Where the spec has no slot, :mod:`minite_megatron.engine_patches` overrides
Megatron methods, version-checked: MoE layers become
:class:`~minite_megatron.engine_patches.StrictMoELayer` (routing and combine; experts keep their
NVFP4 linears), linears the recipe keeps in BF16 ``StrictColumnParallelLinear`` /
``StrictRowParallelLinear``, and :func:`finalize_strict_model` routes the output layer (LM head)
through :func:`minite_common.ops.linear`.

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
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from minite_common import ops

from .engine_patches import (
    StrictColumnParallelLinear,
    StrictMoELayer,
    StrictRowParallelLinear,
    check_megatron_version,
    install_strict_output_layer,
)
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


class StrictRotary(torch.nn.Module):
    """The rotary embedding (NeoX layout) of ``[s, b, heads, d]`` queries or keys at positions
    ``0..s-1`` through :func:`ops.rope_cos_sin` / :func:`ops.apply_rope`."""

    def __init__(self, base: float, dim: int) -> None:
        super().__init__()
        self.base, self.dim = float(base), int(dim)

    def forward(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(query.shape[0], device=query.device)
        cos, sin = ops.rope_cos_sin(positions, self.dim, self.base)
        cos, sin = cos[:, None, None, :], sin[:, None, None, :]  # [s, 1, 1, dim/2]
        return ops.apply_rope(query, cos, sin), ops.apply_rope(key, cos, sin)


class StrictCausalAttention(torch.nn.Module):
    """Causal attention of ``[s, b, heads, d]`` through :func:`ops.causal_attention`, one sequence
    of the batch at a time, ``[s, b, heads * d]`` out."""

    def __init__(self, softmax_scale: float) -> None:
        super().__init__()
        self.softmax_scale = softmax_scale

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        seq, batch = query.shape[:2]
        pos = torch.arange(seq, device=query.device)
        out = [
            ops.causal_attention(query[:, b], key[:, b], value[:, b], pos, self.softmax_scale)
            for b in range(batch)
        ]
        return torch.stack(out, dim=1).reshape(seq, batch, -1)


class StrictDotProductAttention(MegatronModule):
    """The ``core_attention`` submodule of strict self-attention: the rotary embedding
    (:class:`StrictRotary`, when the spec gives ``rotary_base``; the ``GPTModel`` is then built
    with ``position_embedding_type="none"`` so that Megatron rotates nothing itself), then
    :class:`StrictCausalAttention`. ``[s, b, heads, d]`` in, ``[s, b, heads * d]`` out; the mask
    must be causal, queries and keys the same ``s`` positions ``0..s-1``."""

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
        rotary_base: float | None = None,
        rotary_percent: float = 1.0,
    ) -> None:
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal or attention_type != "self":
            raise ValueError(
                f"miniTE strict mode: causal self-attention only (got {attn_mask_type}, "
                f"{attention_type})"
            )
        check_strict_config(config)
        head_dim = config.kv_channels
        rotary_dim = int(head_dim * rotary_percent)
        self.rotary = None if rotary_base is None else StrictRotary(rotary_base, rotary_dim)
        self.attention = StrictCausalAttention(
            head_dim**-0.5 if softmax_scale is None else softmax_scale
        )

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
        if key.shape[0] != query.shape[0]:
            raise NotImplementedError(
                "miniTE strict mode: queries and keys of the same positions 0..s-1 (no inference "
                f"context or KV cache; got {query.shape[0]} queries, {key.shape[0]} keys)"
            )
        if self.rotary is not None:
            query, key = self.rotary(query, key)
        return self.attention(query, key, value)


# -- spec rewriting and model finalization -------------------------------------------------------

_NORM_FIELDS = ("input_layernorm", "pre_mlp_layernorm", "q_layernorm", "k_layernorm", "layer_norm")
_BDA_FIELDS = ("self_attn_bda", "mlp_bda")
_STRICT_MODULES = {
    MoELayer: StrictMoELayer,
    ColumnParallelLinear: StrictColumnParallelLinear,
    RowParallelLinear: StrictRowParallelLinear,
}


def _is_identity(obj: Any) -> bool:
    module = obj.module if isinstance(obj, ModuleSpec) else obj
    return isinstance(module, type) and issubclass(module, IdentityOp)


def _strict_node(node: Any, path: tuple[str, ...], core_attention: Callable) -> Any:
    if isinstance(node, type):
        return _STRICT_MODULES.get(node, node)
    if dataclasses.is_dataclass(node) and not isinstance(node, ModuleSpec):
        visit = functools.partial(_strict_node, core_attention=core_attention)
        new = {}
        for f in (f for f in dataclasses.fields(node) if f.init):
            value = getattr(node, f.name)
            if f.name in _NORM_FIELDS and value is not None and not _is_identity(value):
                new[f.name] = StrictRMSNorm
            elif f.name in _BDA_FIELDS:
                new[f.name] = strict_bias_dropout_add
            elif f.name == "core_attention":
                new[f.name] = core_attention
            elif f.name == "activation_func" and isinstance(node, MLPSubmodules):
                new[f.name] = StrictSwiGLU
            else:
                new[f.name] = map_spec(value, visit)
        return dataclasses.replace(node, **new)
    return DESCEND


def make_strict_spec(obj: Any, rotary_base: float | None, rotary_percent: float = 1.0) -> Any:
    """A copy of the spec tree ``obj`` (layer spec, block submodules) with the strict modules of
    this module in place of Megatron's norms, residual adds, attention core (with the rotary
    embedding of base ``rotary_base``, ``None`` for none), activation, MoE layer and plain BF16
    linears (miniTE's NVFP4 linears stay). A model built from it takes
    ``position_embedding_type="none"``: the strict attention core rotates queries and keys."""
    check_megatron_version()
    core = functools.partial(
        StrictDotProductAttention, rotary_base=rotary_base, rotary_percent=rotary_percent
    )
    return map_spec(obj, functools.partial(_strict_node, core_attention=core))


def finalize_strict_model(model: torch.nn.Module) -> None:
    """Finish a ``GPTModel`` built from a strict spec: check that Megatron applies no position
    embedding of its own (``position_embedding_type="none"``; the strict attention core rotates),
    route its output layer (LM head) through :func:`ops.linear` and mark it ``minite_strict``
    (``token_logprobs`` then normalizes with :func:`ops.log_softmax`). Idempotent; raises if the
    model has no strict attention."""
    if not any(isinstance(m, StrictDotProductAttention) for m in model.modules()):
        raise ValueError(
            "finalize_strict_model: the model has no strict attention layers; build it from "
            "get_gpt_decoder_block_minite_spec(config, recipe, rotary_base=...) with "
            "recipe.strict_ops=True"
        )
    check_strict_config(model.config)
    check_megatron_version()
    position = getattr(model, "position_embedding_type", "none")
    if position != "none":
        raise ValueError(
            f"finalize_strict_model: the GPTModel applies position embedding {position!r} itself; "
            "in strict mode the attention core applies the rotary embedding (the spec's "
            "rotary_base): build the GPTModel with position_embedding_type='none'"
        )
    output = getattr(model, "output_layer", None)
    if output is not None:
        install_strict_output_layer(output)
    model.minite_strict = True  # token_logprobs: the fixed-order ops.log_softmax
