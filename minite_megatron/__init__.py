"""miniTE's Megatron-Core adapter: NVFP4 W4A4 linears, GPT layer specs, HF weight exchange.

One-line switch in a model provider::

    spec = minite_megatron.get_gpt_decoder_block_minite_spec(config)   # instead of Megatron's

or ``--spec minite_megatron.spec minite_qk_norm_layer_spec`` on Megatron's training scripts.
All numerics come from :mod:`minite_common`; see ``docs/megatron.md``.
"""

from .bridge import register_with_megatron_bridge
from .cpu_shim import apply_cpu_shim
from .experts import MiniTEGroupedMLP
from .hf import (
    export_hf_weights,
    gpt_model_kwargs_from_hf,
    hf_quantization_config,
    load_hf_weights,
    transformer_config_from_hf,
)
from .linear import (
    MiniTEColumnParallelLinear,
    MiniTERowParallelLinear,
    invalidate_quantized_weights,
)
from .model import build_gpt_model_from_hf, causal_attention_mask, init_megatron, token_logprobs
from .spec import (
    get_gpt_decoder_block_minite_spec,
    get_gpt_layer_minite_spec,
    minite_block_spec,
    minite_layer_spec,
    minite_moe_qk_norm_layer_spec,
    minite_qk_norm_layer_spec,
)

register_with_megatron_bridge()

__all__ = [
    "MiniTEColumnParallelLinear",
    "MiniTEGroupedMLP",
    "MiniTERowParallelLinear",
    "apply_cpu_shim",
    "build_gpt_model_from_hf",
    "causal_attention_mask",
    "export_hf_weights",
    "get_gpt_decoder_block_minite_spec",
    "get_gpt_layer_minite_spec",
    "gpt_model_kwargs_from_hf",
    "hf_quantization_config",
    "init_megatron",
    "invalidate_quantized_weights",
    "load_hf_weights",
    "minite_block_spec",
    "minite_layer_spec",
    "minite_moe_qk_norm_layer_spec",
    "minite_qk_norm_layer_spec",
    "register_with_megatron_bridge",
    "token_logprobs",
    "transformer_config_from_hf",
]
