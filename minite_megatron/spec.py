"""GPT layer specs whose linears are miniTE's NVFP4 linears.

The specs are Megatron's own local-module specs (``get_gpt_layer_local_spec`` /
``get_gpt_decoder_block_spec`` with ``use_transformer_engine=False``: separate norms, Megatron's
attention core, ``SequentialMLP`` experts) with every ``ColumnParallelLinear`` /
``RowParallelLinear`` of the decoder layers replaced by :class:`MiniTEColumnParallelLinear` /
:class:`MiniTERowParallelLinear`, except where the recipe keeps a layer in BF16. Embeddings, the
LM head and MoE routers are never built from the layer spec and stay BF16. Rewriting Megatron's
spec tree (``ModuleSpec``, ``functools.partial`` and submodule dataclasses) keeps the structure
each Megatron-Core release expects (0.16 ``ModuleSpec(MLP, ...)``, 0.19 ``partial(...)``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from typing import Any

from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
)
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from minite_common import DEFAULT_RECIPE, NVFP4Recipe
from minite_common.checkpoint import recipe_from_file
from minite_common.debug import debug_recipe
from minite_common.recipe import DEFAULT_BF16_MODULES

from .compat import accepted_kwargs
from .experts import use_grouped_experts
from .linear import MiniTEColumnParallelLinear, MiniTERowParallelLinear, check_config_supported
from .spec_tree import DESCEND, map_spec
from .strict import check_strict_config, make_strict_spec

#: The engine name under which the learner reads the debug configuration.
DEBUG_ENGINE = "megatron"

_NVFP4_CLASS = {
    ColumnParallelLinear: MiniTEColumnParallelLinear,
    RowParallelLinear: MiniTERowParallelLinear,
}

#: HF module suffixes (under ``model.layers.N.``) that each Megatron linear slot holds.
_SLOT_HF_NAMES = {
    ("attention", "linear_qkv"): ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("attention", "linear_proj"): ("self_attn.o_proj",),
    ("mlp", "linear_fc1"): ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp", "linear_fc2"): ("mlp.down_proj",),
    ("shared_experts", "linear_fc1"): ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"),
    ("shared_experts", "linear_fc2"): ("mlp.shared_expert.down_proj",),
    ("experts", "linear_fc1"): ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj"),
    ("experts", "linear_fc2"): ("mlp.experts.{e}.down_proj",),
}


def _slot(path: tuple[str, ...]) -> tuple[str, str]:
    for context in ("shared_experts", "experts"):
        if context in path:
            return context, path[-1]
    return ("attention" if "self_attention" in path else "mlp"), path[-1]


def _hf_names(path: tuple[str, ...], layer_index: int, num_experts: int | None) -> list[str]:
    names = _SLOT_HF_NAMES.get(_slot(path))
    if names is None:
        raise ValueError(f"miniTE spec: no HF name is known for the Megatron linear at {path}")
    experts = range(num_experts or 1)
    return sorted({f"model.layers.{layer_index}.{n.format(e=e)}" for n in names for e in experts})


def _uses_nvfp4(
    path: tuple[str, ...],
    *,
    recipe: NVFP4Recipe,
    index: int,
    num_layers: int | None,
    num_experts: int | None,
) -> bool:
    """Whether the linear at spec ``path`` of layer ``index`` runs NVFP4 under ``recipe``."""
    names = _hf_names(path, index, num_experts)
    kept = {name: recipe.keeps_bf16(name, num_layers) for name in names}
    if len(set(kept.values())) > 1:
        raise ValueError(
            "miniTE spec: the recipe keeps only some of the HF tensors fused into one Megatron "
            f"linear in BF16 ({kept}); keep all of them or none"
        )
    return not next(iter(kept.values()))


def _rewrite(obj: Any, use_nvfp4: Callable[[tuple[str, ...]], bool], recipe: NVFP4Recipe) -> Any:
    """A copy of the spec tree ``obj`` with linear classes replaced where ``use_nvfp4(path)``."""

    def visit(node: Any, path: tuple[str, ...]) -> Any:
        module = node.module if isinstance(node, ModuleSpec) else node
        if isinstance(module, type) and module in _NVFP4_CLASS and use_nvfp4(path):
            params = dict(node.params) if isinstance(node, ModuleSpec) else {}
            return ModuleSpec(module=_NVFP4_CLASS[module], params={**params, "recipe": recipe})
        return DESCEND

    return map_spec(obj, visit)


def check_recipe_supported(recipe: NVFP4Recipe, moe: bool) -> None:
    """Raise unless the recipe keeps in BF16 what Megatron cannot run in NVFP4.

    Megatron's embedding, LM head and MoE router are not built from the layer spec, so the
    sampler must keep them BF16 too; the recipe says so for both engines.
    """
    names = ["model.embed_tokens", "lm_head"] + (["model.layers.0.mlp.gate"] if moe else [])
    quantized = [n for n in names if not recipe.keeps_bf16(n, num_layers=None)]
    if quantized:
        raise ValueError(
            f"miniTE spec: the recipe quantizes {quantized}, which the Megatron learner keeps in "
            "BF16 (embeddings, LM head, router); add them to NVFP4Recipe.bf16_modules"
        )


def get_gpt_layer_minite_spec(
    num_experts: int | None = None,
    qk_layernorm: bool = False,
    normalization: str = "RMSNorm",
    *,
    recipe: NVFP4Recipe = DEFAULT_RECIPE,
    layer_index: int | None = None,
    num_layers: int | None = None,
    grouped_experts: bool = False,
    rotary_base: float | None = None,
    rotary_percent: float = 1.0,
) -> ModuleSpec:
    """One GPT layer spec (dense, or MoE if ``num_experts``) with NVFP4 linears.

    ``layer_index`` (0-based) and ``num_layers`` place the layer for the recipe's per-layer BF16
    rules; without them the spec is the same for every layer, which only a recipe without
    per-layer or per-module decoder rules allows (use
    :func:`get_gpt_decoder_block_minite_spec` otherwise). ``qk_layernorm`` must match
    ``TransformerConfig.qk_layernorm``. ``grouped_experts`` runs NVFP4 experts through
    :class:`~minite_megatron.experts.MiniTEGroupedMLP` instead of ``SequentialMLP``.
    ``rotary_base`` / ``rotary_percent``: the rotary embedding, which a strict recipe's attention
    core applies (:func:`strict_rotary`).
    """
    check_recipe_supported(recipe, moe=num_experts is not None)
    if layer_index is None and (
        recipe.bf16_first_layers
        or recipe.bf16_last_layers
        or recipe.bf16_modules != DEFAULT_BF16_MODULES
    ):
        raise ValueError(
            "get_gpt_layer_minite_spec: this recipe keeps some decoder layers or modules in BF16, "
            "so one spec cannot serve every layer; use get_gpt_decoder_block_minite_spec(config)"
        )
    base = get_gpt_layer_local_spec(
        **accepted_kwargs(
            get_gpt_layer_local_spec,
            dict(
                num_experts=num_experts,
                moe_grouped_gemm=False,
                qk_layernorm=qk_layernorm,
                normalization=normalization,
            ),
        )
    )
    index = 0 if layer_index is None else layer_index
    decide = functools.partial(
        _uses_nvfp4, recipe=recipe, index=index, num_layers=num_layers, num_experts=num_experts
    )
    spec = _rewrite(base, decide, recipe)
    if grouped_experts:
        spec = use_grouped_experts(spec)
    if recipe.strict_ops:
        return make_strict_spec(spec, strict_rotary(rotary_base), rotary_percent)
    return spec


def strict_rotary(rotary_base: float | None) -> float:
    """``rotary_base``, which a strict spec needs: its attention core applies the rotary
    embedding, so the ``GPTModel`` is built with ``position_embedding_type="none"``."""
    if rotary_base is None:
        raise ValueError(
            "miniTE strict mode applies the rotary embedding in the attention core: pass "
            "rotary_base=<the model's RoPE theta> to the spec function and build the GPTModel "
            "with position_embedding_type='none'"
        )
    return float(rotary_base)


def check_spec_config(config: TransformerConfig) -> None:
    """Raise ``ValueError`` for TransformerConfig options the miniTE spec cannot build."""
    check_config_supported(config, "miniTE spec")
    if config.multi_latent_attention:
        raise ValueError("miniTE spec: multi-latent attention is not supported")
    if config.moe_grouped_gemm:
        raise ValueError(
            "miniTE spec: moe_grouped_gemm builds TE/legacy grouped experts with their own "
            "weights; miniTE runs experts through SequentialMLP: turn moe_grouped_gemm off"
        )
    if getattr(config, "first_last_layers_bf16", False):
        raise ValueError(
            "miniTE spec: config.first_last_layers_bf16 is Transformer Engine's; keep layers in "
            "BF16 with NVFP4Recipe(bf16_first_layers=..., bf16_last_layers=...) so the sampler "
            "does too"
        )
    if getattr(config, "pipeline_model_parallel_layout", None) is not None:
        raise ValueError("miniTE spec: pipeline_model_parallel_layout is not supported")


def get_gpt_decoder_block_minite_spec(
    config: TransformerConfig,
    recipe: NVFP4Recipe = DEFAULT_RECIPE,
    *,
    vp_stage: int | None = None,
    grouped_experts: bool = False,
    rotary_base: float | None = None,
    rotary_percent: float = 1.0,
) -> TransformerBlockSubmodules:
    """The model-provider switch: ``GPTModel(config, get_gpt_decoder_block_minite_spec(config),
    ...)`` builds this pipeline stage's layers with NVFP4 linears, each layer as the recipe says
    (dense/MoE pattern from ``config.moe_layer_freq``, BF16 first/last layers). An active
    debug configuration (``MINITE_DEBUG_CONFIG``) adds its BF16 layers to the recipe.
    ``grouped_experts``: NVFP4 experts in :class:`~minite_megatron.experts.MiniTEGroupedMLP`.
    ``rotary_base`` / ``rotary_percent``: the rotary embedding, which a strict recipe's attention
    core applies (the ``GPTModel`` then takes ``position_embedding_type="none"``).
    """
    check_spec_config(config)
    recipe = debug_recipe(recipe, DEBUG_ENGINE)
    check_recipe_supported(recipe, moe=config.num_moe_experts is not None)
    block = get_gpt_decoder_block_spec(
        config,
        use_transformer_engine=False,
        normalization=config.normalization,
        vp_stage=vp_stage,
    )
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    layer_specs = [
        _rewrite(
            spec,
            functools.partial(
                _uses_nvfp4,
                recipe=recipe,
                index=offset + j,
                num_layers=config.num_layers,
                num_experts=config.num_moe_experts,
            ),
            recipe,
        )
        for j, spec in enumerate(block.layer_specs)
    ]
    if grouped_experts:
        layer_specs = use_grouped_experts(layer_specs)
    block = dataclasses.replace(block, layer_specs=layer_specs)
    if recipe.strict_ops:  # strict mode (minite_megatron.strict): norms, attention, MoE, ...
        check_strict_config(config)
        block = make_strict_spec(block, strict_rotary(rotary_base), rotary_percent)
    return block


#: Environment variable naming a JSON recipe file (as for the vLLM plugin) for
#: :func:`minite_block_spec`.
RECIPE_ENV = "MINITE_RECIPE"


def minite_block_spec(
    args: Any, config: TransformerConfig, vp_stage: int | None = None
) -> TransformerBlockSubmodules:
    """``--spec minite_megatron.spec minite_block_spec`` for training scripts that call the
    ``--spec`` object as ``spec(args, config, vp_stage)`` (slime's model provider does):
    :func:`get_gpt_decoder_block_minite_spec` of this config and pipeline stage, so per-layer
    recipe rules and the config checks apply. The recipe is the one in the JSON file named by
    ``MINITE_RECIPE`` (the variable the vLLM plugin reads), else the default; ``args`` is unused.
    Megatron-LM's own ``pretrain_gpt.py`` does not call the object: use a layer spec there.
    """
    path = os.environ.get(RECIPE_ENV)
    recipe = recipe_from_file(path, RECIPE_ENV) if path else DEFAULT_RECIPE
    rope = getattr(args, "rotary_base", None) if recipe.strict_ops else None
    return get_gpt_decoder_block_minite_spec(config, recipe, vp_stage=vp_stage, rotary_base=rope)


#: ``--spec minite_megatron.spec minite_layer_spec``: dense layer, no q/k norm (Llama-style).
minite_layer_spec = get_gpt_layer_minite_spec()
#: ``--spec minite_megatron.spec minite_qk_norm_layer_spec``: dense with q/k RMSNorm (Qwen3).
minite_qk_norm_layer_spec = get_gpt_layer_minite_spec(qk_layernorm=True)
#: ``--spec minite_megatron.spec minite_moe_qk_norm_layer_spec``: MoE with q/k RMSNorm
#: (Qwen3-MoE); the expert count comes from the config (``--num-experts``).
minite_moe_qk_norm_layer_spec = get_gpt_layer_minite_spec(num_experts=1, qk_layernorm=True)
