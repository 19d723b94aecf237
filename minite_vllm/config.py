"""The ``minite`` quantization config: which vLLM layers run NVFP4 W4A4 and under which recipe.

Two modes, chosen by the checkpoint:
- *online*: a BF16 checkpoint served with ``--quantization minite``; every linear layer and MoE
  expert set is quantized layer by layer while loading, under :data:`DEFAULT_RECIPE` or the recipe
  in the JSON file named by ``MINITE_RECIPE``;
- *pre-quantized*: a miniTE checkpoint (``quantization_config.quant_method == "minite"``, written
  by ``minite quantize-model``) whose packed weights and scales are loaded as they are.
"""

from __future__ import annotations

import os
from functools import partial
from typing import Any

import torch
from vllm.model_executor.layers.fused_moe import RoutedExperts
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
    UnquantizedFusedMoEMethod,
)
from vllm.model_executor.layers.linear import LinearBase
from vllm.model_executor.layers.quantization.base_config import (
    QuantizationConfig,
    QuantizeMethodBase,
)

from minite_common import DEFAULT_RECIPE, NVFP4Recipe, check_fingerprints
from minite_common.checkpoint import (
    QUANT_METHOD,
    recipe_from_file,
    recipe_from_quantization_config,
)
from minite_common.debug import debug_recipe, linear_hook

#: Environment variable naming a JSON file with the recipe for online quantization: either
#: ``NVFP4Recipe.to_dict()`` or a whole miniTE ``quantization_config``.
RECIPE_ENV = "MINITE_RECIPE"


def recipe_from_env() -> NVFP4Recipe | None:
    """The recipe in the file named by ``MINITE_RECIPE``, or None when the variable is unset."""
    path = os.environ.get(RECIPE_ENV)
    return recipe_from_file(path, RECIPE_ENV) if path else None


def hf_module_names(prefix: str, packed_modules_mapping: dict[str, list[str]]) -> list[str]:
    """HF module names held by the vLLM module ``prefix`` (``...qkv_proj`` -> q/k/v_proj)."""
    parent, _, leaf = prefix.rpartition(".")
    parts = packed_modules_mapping.get(leaf)
    if not parts:
        return [prefix]
    return [f"{parent}.{p}" if parent else p for p in parts]


def hf_expert_names(prefix: str, layer: RoutedExperts) -> list[tuple[str, str, str]]:
    """``(gate, up, down)`` HF module names of each expert of ``layer`` (global expert order)."""
    return [
        tuple(
            f"{prefix}.{e}.{name}"
            for name in (
                layer.ckpt_gate_proj_name,
                layer.ckpt_up_proj_name,
                layer.ckpt_down_proj_name,
            )
        )
        for e in range(layer.global_num_experts)
    ]


def _num_hidden_layers() -> int | None:
    from vllm.config import get_current_vllm_config_or_none

    vllm_config = get_current_vllm_config_or_none()
    if vllm_config is None or vllm_config.model_config is None:
        return None
    return getattr(vllm_config.model_config.hf_text_config, "num_hidden_layers", None)


DEBUG_ENGINE = "vllm"


def debug_weight(
    layer: torch.nn.Module, method: QuantizeMethodBase, names: list[str], name: str
) -> torch.Tensor:
    """The weight rows of HF module ``name`` as the layer serves them (dequantized if NVFP4)."""
    parts = getattr(method, "parts", None)
    if parts is not None:
        part = next(p for p in parts if p.hf_name == name)
        return method.read_part(layer, part).dequantize()
    sizes = list(getattr(layer, "output_partition_sizes", [layer.weight.shape[0]]))
    if len(sizes) != len(names):
        return layer.weight
    return layer.weight.split(sizes)[names.index(name)]


class MiniteConfig(QuantizationConfig):
    """vLLM quantization config ``minite``: NVFP4 W4A4 linear layers and MoE experts.

    ``recipe`` is the NVFP4 recipe; ``prequantized`` says whether the checkpoint holds miniTE
    NVFP4 tensors (True) or BF16 weights to quantize while loading (False).
    """

    def __init__(self, recipe: NVFP4Recipe | None = None, prequantized: bool = False) -> None:
        super().__init__()
        env_recipe = recipe_from_env()
        if recipe is None:
            recipe = env_recipe or DEFAULT_RECIPE
        elif env_recipe is not None:
            check_fingerprints(recipe.fingerprint(), env_recipe.fingerprint(), RECIPE_ENV)
        self.recipe = debug_recipe(recipe, DEBUG_ENGINE)
        self.prequantized = prequantized

    def __repr__(self) -> str:
        mode = "pre-quantized" if self.prequantized else "online"
        return f"MiniteConfig({mode}, recipe={self.recipe.fingerprint()})"

    @classmethod
    def get_name(cls) -> str:
        return QUANT_METHOD

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> MiniteConfig:
        """A pre-quantized miniTE checkpoint's config (refuses a tampered fingerprint)."""
        return cls(recipe_from_quantization_config(config), prequantized=True)

    @classmethod
    def override_quantization_method(
        cls, hf_quant_cfg: dict[str, Any], user_quant: str | None, hf_config: Any = None
    ) -> str | None:
        """Claim miniTE checkpoints, validating their recipe before any worker starts."""
        if hf_quant_cfg.get("quant_method") != QUANT_METHOD:
            return None
        recipe_from_quantization_config(hf_quant_cfg)
        return QUANT_METHOD

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        """NVFP4 for linear layers and routed experts, BF16 for those the recipe keeps; with
        ``recipe.strict_ops`` the strict methods of :mod:`minite_vllm.strict` (BF16 GEMMs, experts,
        LM head) and the strict attention implementation."""
        from .linear import MiniteBF16LinearMethod, MiniteLinearMethod
        from .moe import MiniteMoEMethod

        strict = self.recipe.strict_ops
        bf16_method, moe_method = MiniteBF16LinearMethod, MiniteMoEMethod
        if strict:
            from .strict import StrictBF16LinearMethod, StrictMoEMethod

            bf16_method, moe_method = StrictBF16LinearMethod, StrictMoEMethod
        num_layers = _num_hidden_layers()
        if isinstance(layer, LinearBase):
            names = hf_module_names(prefix, self.packed_modules_mapping)
            if self.keeps_bf16(prefix, names, num_layers):
                method = bf16_method()
            else:
                method = MiniteLinearMethod(self, names)
            hook = linear_hook(DEBUG_ENGINE, names, partial(debug_weight, layer, method, names))
            if hook is not None:
                layer.register_forward_hook(hook)
            return method
        if isinstance(layer, RoutedExperts):
            experts = hf_expert_names(prefix, layer)
            if self.keeps_bf16(prefix, [n for e in experts for n in e], num_layers):
                if strict:
                    raise NotImplementedError(f"{prefix}: strict mode runs NVFP4 experts only")
                return UnquantizedFusedMoEMethod(layer.moe_config)
            return moe_method(self, layer.moe_config, experts)
        if strict:
            from .strict import strict_layer_method

            return strict_layer_method(layer)
        return None

    def keeps_bf16(self, prefix: str, names: list[str], num_layers: int | None) -> bool:
        """Whether the vLLM layer ``prefix``, made of HF weights ``names``, stays BF16; raises if
        the recipe keeps only some of them (vLLM cannot split a fused layer)."""
        kept = [n for n in names if self.recipe.keeps_bf16(n, num_layers)]
        if kept and len(kept) != len(names):
            raise ValueError(
                f"{prefix}: the recipe keeps {kept} in BF16 but not "
                f"{[n for n in names if n not in kept]}; vLLM fuses them into one layer, so list "
                "all of them (or none) in NVFP4Recipe.bf16_modules"
            )
        return bool(kept)
